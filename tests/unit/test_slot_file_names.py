"""Whether a slot file is still where the sidecar opens it: the test a reconnected rank makes before registering."""

from __future__ import annotations

import os
from pathlib import Path

from stowaway.slots import shm


def test_a_slot_file_is_linked_at_its_own_path(tmp_path: Path) -> None:
    slot = shm.SlotFile.create(tmp_path / "slot", 4096)
    assert slot.linked_at(tmp_path / "slot")
    slot.close()


def test_a_slot_file_removed_from_its_directory_is_linked_nowhere(tmp_path: Path) -> None:
    slot = shm.SlotFile.create(tmp_path / "slot", 4096)
    (tmp_path / "slot").unlink()
    assert not slot.linked_at(tmp_path / "slot")
    slot.close()


def test_a_slot_file_replaced_by_another_at_its_path_is_not_linked_there(tmp_path: Path) -> None:
    slot = shm.SlotFile.create(tmp_path / "slot", 4096)
    (tmp_path / "slot").unlink()
    other = shm.SlotFile.create(tmp_path / "slot", 4096)
    assert not slot.linked_at(tmp_path / "slot") and other.linked_at(tmp_path / "slot")
    slot.close()
    other.close()


def test_a_slot_file_is_not_linked_at_the_same_name_in_another_directory(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    slot = shm.SlotFile.create(tmp_path / "a" / "slot", 4096)
    assert not slot.linked_at(tmp_path / "b" / "slot"), "the directory is missing a file of that name"
    os.link(tmp_path / "a" / "slot", tmp_path / "b" / "slot")
    assert slot.linked_at(tmp_path / "b" / "slot"), "a hard link names the very file"
    assert not slot.linked_at(tmp_path / "c" / "slot"), "a directory that does not exist"
    slot.close()
