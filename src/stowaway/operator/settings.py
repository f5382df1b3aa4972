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
class ManagedTLS:
    """The objects the operator keeps its webhook certificate in and announces it through (TLS mode ``operator``).

    All three are created by the manifests; the operator only fills in the
    Secret and the configuration's ``caBundle``, so its RBAC names each one.
    """

    # Secret in the operator's namespace holding ca.crt, tls.crt and tls.key (created empty by the manifests).
    secret: str
    # Service in front of the webhook: the certificate names it as the API server calls it.
    service: str
    # MutatingWebhookConfiguration whose webhooks get the CA as caBundle.
    configuration: str


@dataclass(frozen=True)
class OperatorSettings:
    """What the chart's Deployment sets as ``STOWAWAY_*`` environment variables."""

    # Pods here are never injected (the operator must not depend on itself to start).
    namespace: str
    sidecar_image: str
    webhook_port: int
    # Directory with tls.crt and tls.key (a mounted Secret); None in the operator's own TLS mode and in dev mode.
    cert_dir: Path | None
    health_port: int
    # Prometheus /metrics of the operator itself (the sidecars serve their own).
    metrics_port: int
    # Local development: kopf registers its own MutatingWebhookConfiguration with this host.
    dev_host: str | None
    # The operator makes, keeps and announces its own certificate (what deploy/ uses); None: cert_dir or dev_host.
    managed_tls: ManagedTLS | None = None


def from_environ(environ: Mapping[str, str]) -> OperatorSettings:
    """Read and check the settings; a missing required one is an error that names it."""
    dev_host = environ.get("STOWAWAY_WEBHOOK_DEV_HOST") or None
    cert_dir = environ.get("STOWAWAY_WEBHOOK_CERT_DIR") or None
    managed_tls = _managed_tls(environ)
    if cert_dir is not None and managed_tls is not None:
        raise SettingsError(
            "STOWAWAY_WEBHOOK_CERT_DIR and STOWAWAY_WEBHOOK_TLS_SECRET are both set: the certificate comes either "
            "from a mounted Secret or from the operator itself; unset one (see docs/operator.md)"
        )
    if cert_dir is None and managed_tls is None and dev_host is None:
        raise SettingsError(
            "STOWAWAY_WEBHOOK_CERT_DIR is not set: point it at the mounted webhook TLS Secret (tls.crt, tls.key), "
            "set STOWAWAY_WEBHOOK_TLS_SECRET to let the operator make its own, "
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
        managed_tls=managed_tls,
    )


def _managed_tls(environ: Mapping[str, str]) -> ManagedTLS | None:
    secret = environ.get("STOWAWAY_WEBHOOK_TLS_SECRET") or None
    if secret is None:
        return None
    return ManagedTLS(
        secret=secret,
        service=_required(environ, "STOWAWAY_WEBHOOK_SERVICE"),
        configuration=_required(environ, "STOWAWAY_WEBHOOK_CONFIGURATION"),
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
