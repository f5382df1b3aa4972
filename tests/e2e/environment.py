"""The world the ``e2e`` tests run in: a Docker engine, the images, and a kind cluster whose pods really run.

Everything comes from the ``hack/e2e`` scripts, which build from sources reachable without an image registry
and cache what they build outside the repository. Preparing takes minutes when cold, longer than one test may
run, so the conftest prepares once before the first test and undoes after the last what it started: the
cluster's node is stopped (not deleted: with the images loaded into it, it is the slowest thing to make, and
the next session starts it again) and the Docker engine is stopped. ``STOWAWAY_E2E_KEEP=1`` leaves both
running; ``hack/e2e/cluster down`` deletes the cluster.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
HACK = REPO_ROOT / "hack" / "e2e"
PRODUCT_IMAGE = "stowaway/stowaway:e2e"
# The same image under the tag deploy/ names (the chart's appVersion), which hack/e2e/images also gives it.
DEPLOY_IMAGE = "stowaway/stowaway:" + str(
    yaml.safe_load((REPO_ROOT / "charts" / "stowaway" / "Chart.yaml").read_text())["appVersion"])
TRAINER_IMAGE = "stowaway-e2e/trainer:e2e"
KEEP_ENV = "STOWAWAY_E2E_KEEP"
CLUSTER_ENV = "STOWAWAY_E2E_CLUSTER"


class DockerUnavailable(RuntimeError):
    """No Docker engine can run here: the e2e tests are skipped with this reason."""


class SetupFailed(RuntimeError):
    """Docker runs but building the images or the cluster failed: the e2e tests fail with this message."""


@dataclass(frozen=True)
class Environment:
    """What the session prepared, and what it must undo."""

    started_docker: bool
    kubeconfig: Path | None
    # The kind cluster this session created or started (stopped afterwards); None when it was running already
    # or the cluster was given.
    started_cluster: str | None
    # A Prometheus built with Kubernetes service discovery (Debian's has none), when a cluster was prepared.
    prometheus: Path | None = None


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``hack/e2e/<script>``: its progress goes to the terminal, its stdout is returned."""
    result = subprocess.run(
        [str(HACK / script), *args], stdout=subprocess.PIPE, text=True, check=False, env=env
    )
    if result.returncode != 0:
        raise SetupFailed(f"`hack/e2e/{script} {' '.join(args)}` failed with status {result.returncode} "
                          "(its output is above)")
    return result.stdout


def _start_docker() -> bool:
    """True when this call started the engine (and so the session must stop it)."""
    result = subprocess.run([str(HACK / "docker"), "ensure"], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        reason = result.stderr.strip().splitlines()[-1:] or [f"status {result.returncode}"]
        raise DockerUnavailable(f"no Docker engine can run here: {reason[0]}")
    return result.stdout.strip() == "started"


def kind_cluster_of(kubeconfig: Path) -> str | None:
    """The kind cluster a kubeconfig's current context names (kind calls its contexts kind-NAME), if any."""
    config = yaml.safe_load(kubeconfig.read_text()) or {}
    context = str(config.get("current-context") or "")
    return context.removeprefix("kind-") if context.startswith("kind-") else None


def _build_clients() -> None:
    """kubectl and helm, from the pinned builds the k8s tests use."""
    script = REPO_ROOT / "hack" / "control-plane" / "build"
    if subprocess.run([str(script), "kubernetes", "helm"], stdout=subprocess.DEVNULL, check=False).returncode != 0:
        raise SetupFailed(f"`{script.relative_to(REPO_ROOT)} kubernetes helm` failed (its output is above)")


def _load_images(cluster: str) -> None:
    _run("cluster", "load", PRODUCT_IMAGE, DEPLOY_IMAGE, TRAINER_IMAGE, env={**os.environ, CLUSTER_ENV: cluster})


def prepare(*, needs_cluster: bool, external_kubeconfig: str | None) -> Environment:
    """Start Docker, build the images and (when a selected test needs one) bring up and fill the cluster.

    With ``external_kubeconfig`` nothing is created: a kind cluster it names gets the images loaded; any
    other cluster must already hold them (the tests' pods never pull).
    """
    started = _start_docker()
    cluster: str | None = None
    try:
        _run("images", "product", "trainer")
        if not needs_cluster:
            return Environment(started_docker=started, kubeconfig=None, started_cluster=None)
        _build_clients()
        prometheus = Path(_run("gobuild", "prometheus").strip().split("=", 1)[1]) / "prometheus"
        if external_kubeconfig:
            path = Path(external_kubeconfig.split(os.pathsep)[0]).expanduser().resolve()
            name = kind_cluster_of(path)
            if name is not None:
                _load_images(name)
            return Environment(started_docker=started, kubeconfig=path, started_cluster=None, prometheus=prometheus)
        name = os.environ.get(CLUSTER_ENV, "stowaway-e2e")
        fields = dict(line.split("=", 1) for line in _run("cluster", "up").splitlines() if "=" in line)
        cluster = name if fields.get("started") == "true" else None
        _load_images(name)
        return Environment(started_docker=started, kubeconfig=Path(fields["kubeconfig"]), started_cluster=cluster,
                           prometheus=prometheus)
    except SetupFailed:
        teardown(Environment(started_docker=started, kubeconfig=None, started_cluster=cluster))
        raise


def teardown(environment: Environment) -> None:
    """Undo what :func:`prepare` did, unless ``STOWAWAY_E2E_KEEP=1``."""
    if os.environ.get(KEEP_ENV) == "1":
        return
    if environment.started_cluster is not None:
        _run("cluster", "stop", env={**os.environ, CLUSTER_ENV: environment.started_cluster})
    if environment.started_docker:
        _run("docker", "stop")
