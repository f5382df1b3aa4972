"""Ranks of one job agree on the step to restore, whatever each of them sees.

Three real processes in a real gloo process group ask the questions
``Checkpointer.load`` asks. Ranks usually agree, and ``agreement`` answers
that case with one small reduction; these tests cover that case and every way
ranks can differ, because a rank that decides differently from the others
restores another step than they do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("agreement_worker.py")
WORLD = 3


def ask(tmp_path: Path, questions: list[dict]) -> list[list]:
    """Every rank's answers to ``questions``, by rank."""
    asked = tmp_path / "questions.json"
    asked.write_text(json.dumps(questions))
    ranks = [
        subprocess.Popen([sys.executable, str(WORKER), str(rank), str(WORLD), str(tmp_path / "store"), str(asked)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(WORLD)
    ]
    answers = []
    for rank in ranks:
        out, err = rank.communicate(timeout=120)
        assert rank.returncode == 0, err[-3000:]
        answers.append(json.loads(out))
    return answers


@pytest.mark.timeout(180)
def test_ranks_agree_on_rank_zeros_run_id_and_the_steps_all_of_them_can_restore(tmp_path):
    questions = [
        {"ask": "candidates", "run_id": ["r"] * WORLD, "steps": [[1, 3, 2]] * WORLD},
        {"ask": "candidates", "run_id": ["r0", "r1", "r2"], "steps": [[1, 2]] * WORLD},
        {"ask": "candidates", "run_id": ["r"] * WORLD, "steps": [[1, 2, 3], [2, 3, 4], [9, 3, 2]]},
        {"ask": "candidates", "run_id": ["r"] * WORLD, "steps": [[2, 1], [1, 2, 2], [2, 1]]},
        {"ask": "candidates", "run_id": ["r"] * WORLD, "steps": [[5], [5], []]},
    ]
    expected = [["r", [3, 2, 1], []], ["r0", [2, 1], []], ["r", [3, 2], []], ["r", [2, 1], []], ["r", [], []]]
    for rank, answers in enumerate(ask(tmp_path, questions)):
        assert answers == expected, f"rank {rank}"


@pytest.mark.timeout(180)
def test_a_step_of_another_world_size_seen_by_one_rank_is_known_to_all_so_all_refuse_it(tmp_path):
    """One rank may ask after the last incarnation's final step committed, the others before."""
    questions = [
        {"ask": "candidates", "run_id": ["r"] * WORLD, "steps": [[1]] * WORLD, "other_world": [[[2, 8]]] * WORLD},
        {"ask": "candidates", "run_id": ["r"] * WORLD, "steps": [[1]] * WORLD,
         "other_world": [[[2, 8]], [[2, 8], [3, 8]], [[2, 8]]]},
    ]
    expected = [["r", [1], [[2, 8]]], ["r", [1], [[2, 8], [3, 8]]]]
    for rank, answers in enumerate(ask(tmp_path, questions)):
        assert answers == expected, f"rank {rank}"


@pytest.mark.timeout(180)
def test_every_rank_learns_every_ranks_failure_so_all_fall_back_together(tmp_path):
    questions = [
        {"ask": "outcomes", "refused": [None] * WORLD, "error": [None] * WORLD},
        {"ask": "outcomes", "refused": [None] * WORLD, "error": [None, "slot 1 is torn", None]},
        {"ask": "outcomes", "refused": [None, None, "holds a pickled object"], "error": ["checksum", None, None]},
    ]
    expected = [
        [[], []],
        [[], [[1, "slot 1 is torn"]]],
        [[[2, "holds a pickled object"]], [[0, "checksum"]]],
    ]
    for rank, answers in enumerate(ask(tmp_path, questions)):
        assert answers == expected, f"rank {rank}"
