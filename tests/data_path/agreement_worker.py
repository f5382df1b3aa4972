"""One rank of a real gloo process group, asking ``agreement`` the questions a test passes in.

argv: RANK WORLD_SIZE STORE_FILE QUESTIONS_FILE; the questions file holds a JSON list, each
``{"ask": "candidates", "run_id": [...per rank], "steps": [...per rank]}``, optionally with
``"other_world": [...per rank, each a list of [step, world size]]``, or
``{"ask": "outcomes", "refused": [...per rank], "error": [...per rank]}``;
stdout: this rank's answers, as JSON.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from stowaway.client import agreement


def main() -> None:
    rank, world_size, store, questions = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    answers = []
    for question in json.loads(questions.read_text()):
        if question["ask"] == "candidates":
            other_world = dict(question.get("other_world", [[]] * world_size)[rank])
            run_id, steps, resized = agreement.candidates(question["run_id"][rank], question["steps"][rank],
                                                          other_world, world_size)
            answers.append([run_id, steps, sorted(resized.items())])
        else:
            answers.append(agreement.restore_outcomes(question["refused"][rank], question["error"][rank], rank,
                                                      world_size))
    dist.destroy_process_group()
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    main()
