"""``python -m stowaway.operator``: run the operator with the settings from the environment."""

from __future__ import annotations

import os
import sys

import kopf

from stowaway.operator import main as _handlers  # noqa: F401  (importing registers the kopf handlers)
from stowaway.operator import metrics, settings


def run() -> int:
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
