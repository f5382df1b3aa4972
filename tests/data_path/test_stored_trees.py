"""The state trees in stored files follow the grammar and the JSON Schema of ``docs/storage-format.md``.

Each state of the test corpus (the training state of ``test_state_fidelity``,
the state of ``test_encoder_reuse``, a pickled object, the DTensors of
``test_dtensors``) is saved twice through a real sidecar, the second time
with new scalars so that its tree comes from the template, and each file is
read back from storage with the safetensors library. Between them the
states hold every kind of node, optional field and placement the schema
knows, so every branch of it is checked against what a save writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unit import tree_grammar
from unit.test_encoder_reuse import base_state

from data_path import test_dtensors
from data_path.stored import rank_files
from data_path.test_state_fidelity import real_training_state
from stowaway import Checkpointer

meshes = test_dtensors.meshes


def training_state_with_new_scalars(state: dict) -> None:
    state["python"].update(int=8, float=2 / 3, nan=0.5, inf=1.0, none="now a string")
    state["scheduler"]["last_epoch"] = 2


def encoder_state_with_new_scalars(state: dict) -> None:
    state["scalars"].update(step=8, loss=math.inf, nan=0.5, none="now a string", flag=False)


def new_epoch(state: dict) -> None:
    state["epoch"] += 1


def stored_tree(storage: Path, job: str, step: int) -> tuple[Any, list[str]]:
    [stored] = rank_files(storage / job / f"step-{step:012d}", 1)
    return tree_grammar.tree_of(stored["metadata"]), list(stored["tensors"])


def test_every_state_of_the_corpus_is_stored_as_a_tree_the_storage_format_allows(start_sidecar, storage, meshes):
    corpus: dict[str, tuple[Any, Callable[[Any], None], bool]] = {
        "training": (real_training_state(), training_state_with_new_scalars, False),
        "encoder": (base_state(), encoder_state_with_new_scalars, False),
        "pickled": ({"obj": {1, 2, 3}, "epoch": 1}, new_epoch, True),
        "sharded": (test_dtensors.sharded_state(*meshes), new_epoch, False),
    }
    sidecar = start_sidecar()
    found: dict[str, list[str]] = {}
    features: set[str] = set()
    for job, (state, change, allow_pickle) in corpus.items():
        with Checkpointer(job=job, socket=sidecar.socket, rank=0, world_size=1, timeout=30,
                          allow_pickle=allow_pickle) as ckpt:
            ckpt.save(1, state).wait(30)
            change(state)
            ckpt.save(2, state).wait(30)
        for step in (1, 2):
            tree, names = stored_tree(storage, job, step)
            found[f"{job} step {step}"] = tree_grammar.problems(tree, names)
            features |= tree_grammar.Walk(tree["root"]).features
    assert {saved: problems for saved, problems in found.items() if problems} == {}
    expected = {*tree_grammar.TAGS, "T.P", "D.P", "D.pl", "D.sh", "D.st", "D.m", "d.o", "d.m", "N.nd", "N.sh",
                "pl.s", "pl.s.sf", "pl.r", "pl.p"}
    assert expected <= features, f"the corpus no longer holds {sorted(expected - features)}"
