"""``python -m stowaway.operator``: run the operator with the settings from the environment."""

from __future__ import annotations

import argparse
import os
import sys

import kopf

from stowaway.operator import main as _handlers  # noqa: F401  (importing registers the kopf handlers)
from stowaway.operator import metrics, settings

_DESCRIPTION = """\
Run the Stowaway operator: the CheckpointPolicy handlers and the webhook that injects the saver sidecar.
It takes no arguments: the chart's Deployment sets its settings as environment variables
(STOWAWAY_OPERATOR_NAMESPACE, STOWAWAY_SIDECAR_IMAGE, STOWAWAY_WEBHOOK_SERVICE, STOWAWAY_WEBHOOK_CONFIGURATION,
and STOWAWAY_WEBHOOK_CERT_DIR or STOWAWAY_WEBHOOK_TLS_SECRET or STOWAWAY_WEBHOOK_DEV_HOST; ports:
STOWAWAY_WEBHOOK_PORT, STOWAWAY_HEALTH_PORT, STOWAWAY_METRICS_PORT). See docs/operator.md."""


def run(argv: list[str] | None = None) -> int:
    # Arguments first, so that --help answers without the settings a Deployment would give.
    argparse.ArgumentParser(prog="python -m stowaway.operator", description=_DESCRIPTION,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    try:
        config = settings.from_environ(os.environ)
    except settings.SettingsError as exc:
        print(f"stowaway operator: {exc}", file=sys.stderr)
        return 2
    exported = metrics.OperatorMetrics()
    try:
        exported.serve(config.metrics_port)
    except OSError as exc:
        print(f"stowaway operator: cannot serve metrics on STOWAWAY_METRICS_PORT={config.metrics_port}: {exc}",
              file=sys.stderr)
        return 2
    kopf.configure(verbose=False)
    kopf.run(
        clusterwide=True,
        standalone=True,
        memo=kopf.Memo(config=config, metrics=exported),
        liveness_endpoint=f"http://0.0.0.0:{config.health_port}/healthz",
    )
    return 0


if __name__ == "__main__":
    sys.exit(run())
