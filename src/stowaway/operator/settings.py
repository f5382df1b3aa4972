"""The operator's settings, read once from the environment the chart gives it.

Pure: takes a mapping (``os.environ`` in production, a dict in tests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


class SettingsError(ValueError):
    """A setting is missing or malformed; the message names the variable."""


@dataclass(frozen=True)
class OperatorSettings:
    """What the chart's Deployment sets as ``STOWAWAY_*`` environment variables."""

    # Pods here are never injected (the operator must not depend on itself to start).
    namespace: str
    sidecar_image: str
    webhook_port: int
    # Directory with tls.crt and tls.key (a mounted Secret); None only in dev mode.
    cert_dir: Path | None
    health_port: int
    # Prometheus /metrics of the operator itself (the sidecars serve their own).
    metrics_port: int
    # Local development: kopf registers its own MutatingWebhookConfiguration with this host.
    dev_host: str | None


def from_environ(environ: Mapping[str, str]) -> OperatorSettings:
    """Read and check the settings; a missing required one is an error that names it."""
    dev_host = environ.get("STOWAWAY_WEBHOOK_DEV_HOST") or None
    cert_dir = environ.get("STOWAWAY_WEBHOOK_CERT_DIR") or None
    if cert_dir is None and dev_host is None:
        raise SettingsError(
            "STOWAWAY_WEBHOOK_CERT_DIR is not set: point it at the mounted webhook TLS Secret (tls.crt, tls.key), "
            "or set STOWAWAY_WEBHOOK_DEV_HOST for local development (see docs/operator.md)"
        )
    return OperatorSettings(
        namespace=_required(environ, "STOWAWAY_OPERATOR_NAMESPACE"),
        sidecar_image=_required(environ, "STOWAWAY_SIDECAR_IMAGE"),
        webhook_port=_port(environ, "STOWAWAY_WEBHOOK_PORT", 8443),
        cert_dir=None if cert_dir is None else Path(cert_dir),
        health_port=_port(environ, "STOWAWAY_HEALTH_PORT", 8080),
        metrics_port=_port(environ, "STOWAWAY_METRICS_PORT", 9464),
        dev_host=dev_host,
    )


def _required(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if not value:
        raise SettingsError(f"{name} is not set; the Helm chart sets it (see docs/operator.md)")
    return value


def _port(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, str(default))
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise SettingsError(f"{name}={raw!r} is not a TCP port number")
    return int(raw)
