"""``python -m bench.env``: the harness's own environment, with DLRover and matplotlib; prints its path.

The harness needs two packages Stowaway does not: DLRover, a peer it
measures in the same run, and matplotlib, which draws the charts. Neither
may enter the project's environment: that one is keyed by pyproject.toml
and shared by every checkout on the machine, and the sidecar's image is
built from the same dependency list. So the harness makes an environment of
its own, on top of the one it is run from: a virtual environment whose
``.pth`` file adds the project environment's site-packages (torch,
Stowaway's editable install), so nothing is downloaded twice, and into which
only the pinned packages below are installed. It lives in the same cache as
``hack/venv``'s, keyed by the Python version, the project environment's path
and the pins, so a change of either makes a new one, and ``.complete`` marks
one that was finished. ``hack/bench`` runs the harness from it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# DLRover's flash checkpoint imports grpc (its master client, used only to report a failure) without
# declaring it outside its "k8s" extra. pynvml 13 is a shim that makes `import torch` warn in every
# process; 12 is not.
PINS = ("dlrover==0.6.1", "grpcio==1.85.3", "pynvml==12.0.0", "matplotlib==3.11.2")
COMPLETE = ".complete"


def cache_dir() -> Path:
    return Path(os.environ.get("STOWAWAY_CACHE", Path.home() / ".cache" / "stowaway"))


def project_site_packages() -> Path:
    """The site-packages of the environment this Python runs in: the one the harness's environment builds on."""
    return Path(sysconfig.get_paths()["purelib"])


def location() -> Path:
    base = project_site_packages()
    key = hashlib.sha256("\n".join((str(base), *PINS)).encode()).hexdigest()[:12]
    return cache_dir() / f"bench-py{sys.version_info[0]}{sys.version_info[1]}-{key}"


def python(env: Path) -> Path:
    return env / "bin" / "python"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process builds an environment at a time; the others wait and then find it complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure() -> Path:
    """The harness's environment, made when missing (a minute or so: pip installs the pins and their few needs)."""
    env = location()
    if (env / COMPLETE).exists():
        return env
    with _locked(env.with_name(env.name + ".lock")):
        if (env / COMPLETE).exists():
            return env
        print(f"bench.env: creating {env} with {', '.join(PINS)} on top of {project_site_packages()}",
              file=sys.stderr, flush=True)
        shutil.rmtree(env, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
        purelib = subprocess.run([str(python(env)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        # An "import" line of a .pth file runs at start-up: addsitedir also runs the .pth files found there,
        # Stowaway's editable install among them.
        (Path(purelib) / "stowaway_project.pth").write_text(
            f"import site; site.addsitedir({str(project_site_packages())!r})\n")
        # The project environment's pip, pointed at the new one: it sees torch and the rest there as installed.
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python(env)), "install", "--quiet",
                        "--disable-pip-version-check", *PINS], check=True, stdout=sys.stderr)
        (env / COMPLETE).touch()
    return env


def main() -> None:
    try:
        env = ensure()
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"bench.env: `{' '.join(map(str, error.cmd))}` failed (exit {error.returncode}; its "
                         f"output is above), so {location()} was not made; DLRover and matplotlib need a "
                         "reachable package index once, the first time") from None
    print(env)


if __name__ == "__main__":
    main()
