"""Locate (and if needed build) the pinned control-plane binaries.

The binaries come from ``hack/control-plane/build``, which compiles them from
Kubernetes' own Go modules into a version-keyed cache outside the repository.
The script is the single source of truth for versions and paths: we ask it
(``build env``) instead of duplicating the cache layout here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "control-plane" / "build"
MISSING_EXIT = 3  # `build env` exit status when some binary is not built yet

# Set to 1 to forbid the suite from compiling (then missing binaries fail fast).
NO_BUILD_ENV = "STOWAWAY_K8S_NO_BUILD"


class ToolsMissing(RuntimeError):
    """The control-plane binaries are not built and could not be built."""


@dataclass(frozen=True)
class Tools:
    """Absolute paths of the control-plane binaries plus the pinned versions."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    helm: Path
    kubernetes_version: str
    etcd_version: str

    def missing(self) -> list[Path]:
        """Binaries that are not present (or not executable)."""
        paths = [
            self.etcd,
            self.kube_apiserver,
            self.kube_controller_manager,
            self.kube_scheduler,
            self.kubectl,
            self.kwok,
            self.helm,
        ]
        return [p for p in paths if not os.access(p, os.X_OK)]


def _parse_env(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def _run_script(*args: str, capture: bool) -> subprocess.CompletedProcess[str]:
    if not os.access(BUILD_SCRIPT, os.X_OK):
        raise ToolsMissing(f"{BUILD_SCRIPT} is missing or not executable")
    return subprocess.run(
        [str(BUILD_SCRIPT), *args],
        check=False,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if capture else None,
    )


def locate() -> Tools:
    """Where the pinned binaries are (or would be) cached; builds nothing."""
    result = _run_script("env", capture=True)
    if result.returncode not in (0, MISSING_EXIT):
        raise ToolsMissing(f"`{BUILD_SCRIPT} env` failed:\n{result.stderr}")
    env = _parse_env(result.stdout)
    return Tools(
        etcd=Path(env["STOWAWAY_ETCD"]),
        kube_apiserver=Path(env["STOWAWAY_KUBE_APISERVER"]),
        kube_controller_manager=Path(env["STOWAWAY_KUBE_CONTROLLER_MANAGER"]),
        kube_scheduler=Path(env["STOWAWAY_KUBE_SCHEDULER"]),
        kubectl=Path(env["STOWAWAY_KUBECTL"]),
        kwok=Path(env["STOWAWAY_KWOK"]),
        helm=Path(env["STOWAWAY_HELM"]),
        kubernetes_version=env["STOWAWAY_KUBERNETES_VERSION"],
        etcd_version=env["STOWAWAY_ETCD_VERSION"],
    )


def ensure_built() -> Tools:
    """The pinned binaries, building them first when they are missing.

    The build is cached, so this costs a fraction of a second once warm; a cold
    build takes many minutes, which is why the conftest calls this before the
    first test rather than inside a (time-limited) fixture. Progress lines of
    the build go straight to the terminal.
    """
    tools = locate()
    if not tools.missing():
        return tools
    hint = f"Build them with `{BUILD_SCRIPT.relative_to(REPO_ROOT)}` (cached afterwards)."
    if os.environ.get(NO_BUILD_ENV) == "1":
        missing = ", ".join(str(p) for p in tools.missing())
        raise ToolsMissing(f"control-plane binaries missing ({missing}) and {NO_BUILD_ENV}=1. {hint}")
    result = _run_script(capture=False)
    tools = locate()
    if result.returncode != 0 or tools.missing():
        raise ToolsMissing(f"`{BUILD_SCRIPT}` failed with status {result.returncode} (see its output above). {hint}")
    return tools


def client_binary(name: str, built: Path | None) -> Path | None:
    """A client CLI (kubectl/helm) for an external cluster: ours if built, else PATH."""
    if built is not None and os.access(built, os.X_OK):
        return built
    found = shutil.which(name)
    return Path(found) if found else None
