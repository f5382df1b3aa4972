"""The product image, as built from the project's Dockerfile: slim, non-root, both entrypoints answer."""

from __future__ import annotations

import subprocess

import pytest

from .environment import PRODUCT_IMAGE, TRAINER_IMAGE, Environment

pytestmark = pytest.mark.e2e


def _run(image: str, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", "run", "--rm", "--network", "none", image, *command],
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_product_image_holds_no_torch(e2e_environment: Environment) -> None:
    found = _run(PRODUCT_IMAGE, "python", "-c", "import importlib.util; print(importlib.util.find_spec('torch'))")
    assert (found.returncode, found.stdout.strip()) == (0, "None"), found.stderr


def test_the_product_image_runs_as_65532_with_a_user_name(e2e_environment: Environment) -> None:
    ids = _run(PRODUCT_IMAGE, "id", "-u")
    assert (ids.returncode, ids.stdout.strip()) == (0, "65532"), ids.stderr
    groups = _run(PRODUCT_IMAGE, "id", "-g")
    assert (groups.returncode, groups.stdout.strip()) == (0, "65532"), groups.stderr
    # kopf names the operator's identity after the user: a uid without a name crashes it at start.
    name = _run(PRODUCT_IMAGE, "python", "-c", "import getpass; print(getpass.getuser())")
    assert (name.returncode, name.stdout.strip()) == (0, "stowaway"), name.stderr


def test_the_sidecar_entrypoint_prints_its_help(e2e_environment: Environment) -> None:
    shown = _run(PRODUCT_IMAGE, "stowaway", "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: stowaway")
    assert "sidecar" in shown.stdout


def test_the_operator_entrypoint_prints_its_help(e2e_environment: Environment) -> None:
    shown = _run(PRODUCT_IMAGE, "python", "-m", "stowaway.operator", "--help")
    assert shown.returncode == 0, shown.stderr
    assert "usage:" in shown.stdout


def test_the_trainer_image_runs_the_example_with_torch_as_uid_1000(e2e_environment: Environment) -> None:
    probe = ("import os, torch, stowaway, pathlib; "
             "print(os.getuid(), pathlib.Path('/app/train.py').is_file(), torch.ones(3).sum().item())")
    shown = _run(TRAINER_IMAGE, "python", "-c", probe)
    assert (shown.returncode, shown.stdout.split()) == (0, ["1000", "True", "3.0"]), shown.stderr
