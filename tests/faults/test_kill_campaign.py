"""The kill -9 campaign: the sidecar or a rank dies at a random point of save, persist or commit.

Each trial saves one step on every rank, waits until the step reaches the
chosen point (observed in the slot headers and the storage directory, never
guessed from a sleep), SIGKILLs the victim, restarts what died, and checks
what a user relies on:

- no committed checkpoint is torn: ``stowaway verify`` passes every step
  committed so far, and each manifest names a file for every rank;
- no committed checkpoint is lost: every step committed before the trial is
  still committed after it;
- ``load()`` returns one step, the newest committed one, intact on every rank;
- the next save (at that step + 1, as a training loop continues) commits.

It runs twice: with blocking saves, and with ``save(overlap=True)``, where
``save()`` returns while the rank's copy thread still copies into the slot
(``WRITING``), so a rank killed at ``WRITING`` after its save returned dies
mid-staging. Such a slot stays torn: the rank never handed it over, and the
trial checks that storage holds no file of it for that step.

A third run gives each rank one slot and the two ranks one pooled spare.
Each trial then saves a step ahead of the one it aims at, so that the
aimed save finds its rank's slot still persisting and borrows the spare,
and a kill lands while the spare is being written or persisted.

``STOWAWAY_FAULT_TRIALS`` sets the number of trials (CI runs a few; see
docs/reliability.md for the long run), ``STOWAWAY_FAULT_SEED`` replays a run,
``STOWAWAY_FAULT_REPORT`` names a JSON file that receives the tally.
"""

from __future__ import annotations

import enum
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from data_path.processes import RankProcess, SidecarProcess, wait_for

from stowaway.protocol.messages import POOLED_SLOT_BASE
from stowaway.slots import header, naming
from stowaway.storage import catalog, layout, manifest

pytestmark = pytest.mark.faults

TRIALS = int(os.environ.get("STOWAWAY_FAULT_TRIALS", "8"))
SEED = int(os.environ.get("STOWAWAY_FAULT_SEED") or random.SystemRandom().randrange(2**32))
REPORT = os.environ.get("STOWAWAY_FAULT_REPORT")
JOB = "campaign"
WORLD = 2
SLOTS = 2
SMALL = 2**17  # float64 elements: 1 MiB per rank
BIG = 2**20  # 8 MiB per rank, so that a slot stays WRITING long enough to be caught
RATE = 8 * 2**20  # bytes/s: a 1 MiB persist lasts about 125 ms, long enough to be caught mid-copy
STAGING = 4 * BIG  # 32 MiB per rank: the copy thread copies for milliseconds after save() returned
STAGING_ATTEMPTS = 5  # trials aimed at a rank's copy thread before the overlapped run gives up on catching it
POOLED = {"STOWAWAY_SLOTS_PER_RANK": "1", "STOWAWAY_POOLED_SPARES": "1"}


class Point(enum.IntEnum):
    """How far a step has got, as seen from outside the processes; each point implies the ones before."""

    QUIET = 0
    WRITING = 1  # a rank's slot is being written, or holds the step but nothing reached storage
    COPYING = 2  # the sidecar is copying a slot: a rank file under its temporary name
    DURABLE = 3  # a rank file under its final name, no receipt yet
    RECEIPT = 4  # the node's receipt is written, the manifest is not
    COMMITTED = 5  # the manifest exists


TARGETS = {
    "sidecar": [Point.WRITING, Point.COPYING, Point.DURABLE, Point.RECEIPT, Point.COMMITTED],
    "rank": [Point.WRITING, Point.COPYING, Point.DURABLE, Point.COMMITTED],
}


@dataclass
class Tally:
    seed: int
    trials: int = 0
    by_victim_target: Counter[str] = field(default_factory=Counter)
    by_victim_landed: Counter[str] = field(default_factory=Counter)
    overlap: bool = False
    pooled: bool = False
    # Trials in which a rank wrote the pooled spare (pooled only).
    spare_written: int = 0
    torn_slots_left: int = 0
    # Of those, slots whose save() had returned: killed while the copy thread copied (overlap only).
    killed_mid_staging: int = 0
    save_errors: Counter[str] = field(default_factory=Counter)
    committed: int = 0
    verified: int = 0
    lost: int = 0
    torn: int = 0
    seconds: float = 0.0

    def as_json(self) -> dict[str, object]:
        return {key: dict(value) if isinstance(value, Counter) else value for key, value in vars(self).items()}


class Campaign:
    def __init__(self, sidecar: SidecarProcess, start_rank: Callable[..., RankProcess], storage: Path,
                 tally: Tally) -> None:
        self.overlap = tally.overlap
        self.pooled = tally.pooled
        self.sidecar = sidecar
        self.start_rank = start_rank
        self.job_path = storage / JOB
        self.tally = tally
        self.ranks = [self._start(rank) for rank in range(WORLD)]
        self.committed: set[int] = set()
        self.verified: set[int] = set()
        # The spare's generation as the trial began: a spare a rank left torn in an earlier trial is not this one's.
        self.spare_before: int | None = None

    def _start(self, rank: int) -> RankProcess:
        return self.start_rank(self.sidecar, job=JOB, rank=rank, world_size=WORLD,
                               extra_env=POOLED if self.pooled else None)

    def point(self, step: int, ranks: list[int]) -> Point:
        step_path = layout.step_dir(self.job_path, step)
        if (step_path / layout.MANIFEST).exists():
            return Point.COMMITTED
        if (step_path / layout.receipt_name(self.sidecar.name)).exists():
            return Point.RECEIPT
        names = set(os.listdir(step_path)) if step_path.is_dir() else set()
        files = [layout.rank_file_name(rank, WORLD) for rank in ranks]
        if any(name in names for name in files):
            return Point.DURABLE
        if any(name + layout.TMP_SUFFIX in names for name in files):
            return Point.COPYING
        if any(found.state is header.SlotState.WRITING or (found.complete and found.step == step)
               for found in self.slot_headers(ranks)):
            return Point.WRITING
        return Point.QUIET

    def slot_headers(self, ranks: list[int]) -> list[header.SlotHeader]:
        """The headers of these ranks' slots, and of the pooled spare if written in this trial (by any rank)."""
        found = [self._header(naming.slot_path(self.sidecar.shm_dir, JOB, rank, index))
                 for rank in ranks for index in range(SLOTS)]
        spare = self.spare_header()
        if spare is not None and spare.generation != self.spare_before:
            found.append(spare)
        return [one for one in found if one is not None]

    def spare_header(self) -> header.SlotHeader | None:
        return self._header(naming.slot_path(self.sidecar.shm_dir, JOB, 0, POOLED_SLOT_BASE)) if self.pooled else None

    @staticmethod
    def _header(path: Path) -> header.SlotHeader | None:
        try:
            with open(path, "rb") as handle:
                return header.read(handle.read(64))
        except (OSError, header.SlotHeaderError):
            return None  # not created yet, or created and not yet initialised

    def trial(self, rng: random.Random, mid_staging: bool = False) -> None:
        """One trial; ``mid_staging`` aims at a rank whose ``save(overlap=True)`` has returned and still copies."""
        victim = rng.choice(sorted(TARGETS))
        target = rng.choice(TARGETS[victim])
        victim_rank = rng.randrange(WORLD)
        if mid_staging:
            victim, target = "rank", Point.WRITING
        step = max(self.committed, default=0) + 1
        if self.pooled:
            # A step ahead, persisting (slowly) as the aimed one is saved: the first rank to save it borrows the spare.
            spare = self.spare_header()
            self.spare_before = None if spare is None else spare.generation
            for rank in self.ranks:
                assert "saved" in rank.save(step, numel=SMALL, overlap=self.overlap)
            step += 1
        watched = list(range(WORLD)) if victim == "sidecar" else [victim_rank]
        numel = (STAGING if mid_staging else BIG) if target is Point.WRITING else SMALL
        self.tally.by_victim_target[f"{victim} at {target.name}{' after save()' if mid_staging else ''}"] += 1

        for rank in self.ranks:
            rank.send(op="save", step=step, numel=numel, overlap=self.overlap)

        def reached() -> Point | None:
            now = self.point(step, watched)
            return now if now >= target else None

        returned = False
        if mid_staging:
            # save() has returned once the rank replies; the copy thread copies on, its slot WRITING until done.
            answer = self.ranks[victim_rank].read()
            assert "saved" in answer, answer
            returned = True
            landed = self.point(step, watched)
        else:
            landed = wait_for(reached, f"step {step} to reach {target.name}", interval=0.0005)
        torn = False
        if victim == "sidecar":
            self.sidecar.kill()
            landed = self.point(step, watched)  # frozen now: nothing else writes storage
            self.sidecar.start()
            self._collect_save_replies(self.ranks)  # saves blocked on the dead sidecar went to the new one
        else:
            self.ranks[victim_rank].kill()
            survivors = [r for i, r in enumerate(self.ranks) if i != victim_rank]
            self._collect_save_replies(survivors)
            if self.pooled and self.overlap:  # a spare a survivor still copies into is not the victim's torn one
                for rank in survivors:
                    wait_for(lambda rank=rank: rank.call(op="staged", step=step)["staged"], "a survivor's copy")
            torn = any(found.state is header.SlotState.WRITING for found in self.slot_headers([victim_rank]))
            returned = returned or any("saved" in answer for answer in self.ranks[victim_rank].replies_left())
            if torn:
                self.tally.torn_slots_left += 1
                # A blocking save publishes its slot before it returns; only an overlapped one returns first.
                assert self.overlap or not returned, f"step {step}: a blocking save returned with its slot torn"
                self.tally.killed_mid_staging += int(returned)
        spare = self.spare_header()
        self.tally.spare_written += int(spare is not None and spare.generation != self.spare_before)
        # Settle before load(): SIGTERM drains what the sidecar still persists or commits, so every rank's
        # load() sees the same committed steps. Without a process group nothing else makes ranks agree while
        # a commit is in flight (client/agreement.py), and a training job restarts its ranks after a crash.
        assert self.sidecar.stop() == 0, self.sidecar.log()[-3000:]
        self.sidecar.start()
        if victim == "rank":
            if torn:
                self.check_never_persisted(step, victim_rank)
            self.ranks[victim_rank] = self._start(victim_rank)
        self.tally.by_victim_landed[f"{victim} at {landed.name}"] += 1

        self.check_storage()
        restored = self.check_load()
        following = restored + 1
        for rank in self.ranks:
            rank.save(following, numel=SMALL, overlap=self.overlap)
        for rank in self.ranks:
            answer = rank.wait(following)
            assert answer["committed"], f"the first save after the restart (step {following}) failed: {answer}"
        self.check_storage()
        self.tally.trials += 1

    def _collect_save_replies(self, ranks: list[RankProcess]) -> None:
        """A save interrupted by a dying sidecar may raise, but with a clear error, and only a Stowaway one."""
        for rank in ranks:
            answer = rank.read()
            if "error" in answer:
                assert answer["type"] in {"SidecarUnavailable", "SaveFailed"} and answer["error"], answer
                self.tally.save_errors[answer["type"]] += 1
            else:
                assert "saved" in answer, answer

    def check_never_persisted(self, step: int, rank: int) -> None:
        """A slot the rank left torn never reaches storage: no file of the rank for that step, final or not."""
        name = layout.rank_file_name(rank, WORLD)
        step_path = layout.step_dir(self.job_path, step)
        found = sorted(path.name for path in step_path.glob(f"{name}*")) if step_path.is_dir() else []
        assert not found, f"step {step}: rank {rank} was killed with its slot torn, yet storage holds {found}"

    def check_storage(self) -> None:
        now = set(catalog.committed_steps(self.job_path))
        lost = self.committed - now
        self.tally.lost += len(lost)
        assert not lost, f"committed checkpoints disappeared: steps {sorted(lost)}"
        for step in sorted(now - self.verified):
            verify = subprocess.run([sys.executable, "-m", "stowaway", "verify", str(self.job_path),
                                     "--step", str(step)], capture_output=True, text=True, timeout=120)
            if verify.returncode != 0:
                self.tally.torn += 1
            assert verify.returncode == 0 and f"step {step}: ok" in verify.stdout, verify.stdout + verify.stderr
            found = manifest.read_manifest(layout.step_dir(self.job_path, step))
            assert [entry.rank for entry in found.files] == list(range(WORLD)), found.files
            self.verified.add(step)
        self.committed = now
        self.tally.committed = len(now)
        self.tally.verified = len(self.verified)

    def check_load(self) -> int:
        answers = [rank.call(op="load") for rank in self.ranks]
        newest = max(self.committed)
        assert answers == [{"step": newest, "intact": True, "numel": answers[0]["numel"]}] * WORLD, (
            f"every rank must restore the newest committed step {newest} intact: {answers}")
        return newest


@pytest.mark.timeout(120 + 40 * TRIALS)
@pytest.mark.parametrize(("overlap", "pooled"), [(False, False), (True, False), (False, True)],
                         ids=["blocking", "overlapped", "pooled-spare"])
def test_kill_9_at_random_points_never_tears_or_loses_a_committed_checkpoint(
    start_sidecar, start_rank, storage, capsys, overlap, pooled
):
    tally = Tally(SEED, overlap=overlap, pooled=pooled)
    mode = "pooled-spare" if pooled else "overlapped" if overlap else "blocking"
    with capsys.disabled():
        print(f"\nkill campaign ({mode} saves): {TRIALS} trials, seed {SEED} (replay: STOWAWAY_FAULT_SEED={SEED})",
              flush=True)
    rng = random.Random(SEED)
    sidecar = start_sidecar(extra=["--write-rate-limit", str(RATE)])
    campaign = Campaign(sidecar, start_rank, storage, tally)
    for rank in campaign.ranks:
        rank.save(1, numel=SMALL, overlap=overlap)
    for rank in campaign.ranks:
        assert rank.wait(1)["committed"]
    campaign.check_storage()

    started = time.monotonic()
    if overlap:
        # A kill during staging is the point of this run, and a random pick aims at it once in nine trials, often
        # before save() returns: aim at it first, killing a rank once its save() returned, until the kill lands
        # before its copy ended (each try is a full trial).
        for attempt in range(STAGING_ATTEMPTS):
            try:
                campaign.trial(rng, mid_staging=True)
            except AssertionError as exc:
                raise AssertionError(f"seed {SEED}, kill during staging, try {attempt}: {exc}") from exc
            if tally.killed_mid_staging:
                break
        assert tally.killed_mid_staging, f"no kill landed during staging in {STAGING_ATTEMPTS} tries: {tally}"
    aimed = tally.trials
    for index in range(TRIALS):
        try:
            campaign.trial(rng)
        except AssertionError as exc:
            raise AssertionError(f"seed {SEED}, trial {index}: {exc}") from exc
    tally.seconds = round(time.monotonic() - started, 1)

    every = subprocess.run([sys.executable, "-m", "stowaway", "verify", str(storage / JOB)],
                           capture_output=True, text=True, timeout=600)
    assert every.returncode == 0, every.stdout[-3000:] + every.stderr
    assert tally.trials == aimed + TRIALS and tally.lost == 0 and tally.torn == 0
    assert not pooled or tally.spare_written >= TRIALS // 2, f"the spare was written in few trials: {tally}"
    with capsys.disabled():
        print(f"kill campaign ({mode} saves): {json.dumps(tally.as_json(), sort_keys=True)}", flush=True)
    if REPORT:
        # One file per mode: the blocking run's at the path given, the others' beside it.
        path = Path(REPORT) if mode == "blocking" else Path(REPORT).with_stem(f"{Path(REPORT).stem}-{mode}")
        path.write_text(json.dumps(tally.as_json(), indent=2, sort_keys=True) + "\n")
