"""Turn raw timings into the markdown tables of docs/benchmarks.md: medians, spreads and target ratios."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    """A ratio of two medians (steady state) and the bound it must stay under."""

    label: str
    numerator: str
    denominators: tuple[str, ...]
    bound: float


TARGETS = (
    Target("save blocking / copy reference", "stowaway.save.steady", ("reference.copy",), 1.25),
    Target("committed / fastest write+fdatasync", "stowaway.committed.steady",
           ("reference.write_buffered", "reference.write_direct"), 1.3),
    Target("restore from memory / copy-out reference", "stowaway.restore.memory", ("reference.copy_out_fresh",), 1.25),
    Target("save blocking / DCP async_save blocking", "stowaway.save.steady", ("dcp.async_save",), 0.5),
)
PAGE_CACHE_BOUND = 0.05

# Ratios with no target, for context: numerator over the sum of the denominators' medians.
# A ratio whose measurements a run lacks (the pinned copy is measured on a GPU only) is left out.
CONTEXT = (
    # On a GPU: how close save comes to the link's speed.
    ("save blocking / pinned copy reference", "stowaway.save.steady", (("reference.copy_pinned",),)),
    # The floor of "save blocking / DCP async_save blocking": save cannot block for less than the copy.
    ("copy reference / DCP async_save blocking", "reference.copy", (("dcp.async_save",),)),
    # A save into the second slot while the sidecar persists from the first; the first time, into the spare slot.
    ("save while the previous persists / copy reference", "stowaway.save.overlapped.steady", (("reference.copy",),)),
    ("first save into the spare slot / copy reference", "stowaway.save.overlapped.first", (("reference.copy",),)),
    ("first save after reserve() / copy reference", "stowaway.save.reserved.first", (("reference.copy",),)),
    # One slot per rank and a spare pooled by all: every rank saves again at once, one borrows the spare, the others
    # wait for their own slots (docs/operator.md, "Pooled spare slots").
    ("save while the previous persists, one spare pooled / copy reference", "stowaway.save.pooled.steady",
     (("reference.copy",),)),
    # Issue 23 bounds it at 1.0: reserve(wait=True) readies the first save's slot for no more than first-touching
    # the same bytes costs, and so no more than the cold first save it replaces.
    ("reserve(wait=True) / first-touch reference", "stowaway.reserve.first", (("reference.first_touch.first",),)),
    ("first save, without reserve() / first-touch reference", "stowaway.save.first",
     (("reference.first_touch.first",),)),
    # Near 1: a memory mapping of the training loop waited for the whole reserve().
    ("longest mmap during reserve() / reserve() itself", "stowaway.mmap_during_reserve.first",
     (("stowaway.reserve.first",),)),
    # The save's work beyond the copy, where the cores are shared and wall time cannot tell it from waiting.
    ("save blocking / copy, CPU time", "stowaway.save.steady.cpu", (("reference.copy.cpu",),)),
    ("committed / (copy + fastest write)", "stowaway.committed.steady",
     (("reference.copy",), ("reference.write_buffered", "reference.write_direct"))),
    # Per-tensor work shows in CPU time even where the wall time hides it behind memory bandwidth.
    ("restore from memory / copy-out, CPU time", "stowaway.restore.memory.cpu", (("reference.copy_out_fresh.cpu",),)),
    # load(into=...): no allocation, so the floor is a plain copy back into the state's resident tensors.
    ("restore into the state / copy-back reference", "stowaway.restore.memory_into", (("reference.copy_back",),)),
    ("restore into the state / copy-back, CPU time", "stowaway.restore.memory_into.cpu",
     (("reference.copy_back.cpu",),)),
    ("restore into the state / restore into new tensors", "stowaway.restore.memory_into",
     (("stowaway.restore.memory",),)),
    ("restore from storage / (read + copy-out)", "stowaway.restore.storage",
     (("reference.read_direct",), ("reference.copy_out_fresh",))),
    ("committed / torch.save + fsync", "stowaway.committed.steady", (("torch.save_fsync",),)),
    ("committed / DCP save", "stowaway.committed.steady", (("dcp.save",),)),
    ("committed / DCP async_save completed", "stowaway.committed.steady", (("dcp.async_save_done",),)),
    ("restore from storage / torch.load", "stowaway.restore.storage", (("torch.load",),)),
    # Issue 23 bounds it at 1.15: read from storage straight into the state's own tensors (CPU runs only).
    ("restore from storage into the state / O_DIRECT read reference", "stowaway.restore.storage_into",
     (("reference.read_direct",),)),
    ("restore from storage / DCP load", "stowaway.restore.storage", (("dcp.load",),)),
)

# Stowaway against DLRover's flash checkpoint, and DLRover against the same physical references; shown where
# the run measured DLRover (python -m bench.env's environment has it).
DLROVER = (
    ("save blocking / DLRover save to memory", "stowaway.save.steady", (("dlrover.save.steady",),)),
    ("committed / DLRover committed + fsync", "stowaway.committed.steady", (("dlrover.committed_fsync",),)),
    # DLRover's own "done": its tracker file names the step, while the rank files may still be in the page cache.
    ("committed / DLRover committed, not fsynced", "stowaway.committed.steady", (("dlrover.committed",),)),
    ("restore into the state / DLRover's", "stowaway.restore.memory_into", (("dlrover.restore.memory_into",),)),
    ("restore from storage / DLRover's", "stowaway.restore.storage", (("dlrover.restore.storage",),)),
    ("DLRover save to memory / copy reference", "dlrover.save.steady", (("reference.copy",),)),
    ("DLRover committed + fsync / fastest write+fdatasync", "dlrover.committed_fsync",
     (("reference.write_buffered", "reference.write_direct"),)),
    ("DLRover restore into the state / copy-back reference", "dlrover.restore.memory_into",
     (("reference.copy_back",),)),
)

# Wall time over the least it could take given the CPU it used: all ranks' CPU time spread over every core.
# Near 1, the cores were busy throughout and the measurement is bound by CPU work; well above 1, by memory,
# the device, or other processes (the sidecar among them).
CPU_FLOORS = (
    ("save blocking / its CPU floor", "stowaway.save.steady"),
    ("copy reference / its CPU floor", "reference.copy"),
    ("restore from memory / its CPU floor", "stowaway.restore.memory"),
    ("copy-out reference / its CPU floor", "reference.copy_out_fresh"),
)

ROWS = (
    ("stowaway.save.first", "Stowaway save, first (blocking)"),
    ("stowaway.reserve.first", "Stowaway reserve(wait=True): until the first save's slot is allocated and faulted in"),
    ("reference.first_touch.first", "reference: first touch of as many bytes of fresh memory"),
    ("stowaway.mmap_during_reserve.first", "longest mmap+munmap of 64 MiB by the rank while reserve() runs"),
    ("reference.mmap.first", "reference: longest mmap+munmap of 64 MiB, with nothing running"),
    ("stowaway.save.reserved.first", "Stowaway save, first after reserve() (blocking)"),
    ("stowaway.save.steady", "Stowaway save, steady (blocking)"),
    ("stowaway.save.steady.cpu", "Stowaway save, steady, CPU time"),
    ("stowaway.save.overlapped.first", "Stowaway save while the previous persists, first into the spare slot"),
    ("stowaway.save.overlapped.steady", "Stowaway save while the previous persists, steady"),
    ("stowaway.save.pooled.first", "Stowaway save while the previous persists, one slot per rank and a pooled spare, "
                                   "first"),
    ("stowaway.save.pooled.steady", "Stowaway save while the previous persists, one slot per rank and a pooled spare, "
                                    "steady"),
    ("stowaway.committed.first", "Stowaway committed, first"),
    ("stowaway.committed.steady", "Stowaway committed, steady"),
    ("stowaway.restore.memory", "Stowaway restore from shared memory"),
    ("stowaway.restore.memory.cpu", "Stowaway restore from shared memory, CPU time"),
    ("stowaway.restore.memory_into", "Stowaway restore from shared memory into the state's own tensors"),
    ("stowaway.restore.memory_into.cpu", "Stowaway restore from shared memory into the state's own tensors, "
                                         "CPU time"),
    ("stowaway.restore.storage", "Stowaway restore from storage"),
    ("stowaway.restore.storage_into", "Stowaway restore from storage into the state's own tensors"),
    ("reference.copy", "reference: copy_ into resident shared memory"),
    ("reference.copy.cpu", "reference: copy_ into resident shared memory, CPU time"),
    ("reference.copy_pinned", "reference: non-blocking copy_ into pinned shared memory (GPU)"),
    ("reference.copy_out_fresh", "reference: copy out into new tensors"),
    ("reference.copy_out_fresh.cpu", "reference: copy out into new tensors, CPU time"),
    ("reference.copy_back", "reference: copy_ back into the state's own tensors"),
    ("reference.copy_back.cpu", "reference: copy_ back into the state's own tensors, CPU time"),
    ("reference.write_buffered", "reference: write + fdatasync, buffered"),
    ("reference.write_direct", "reference: write + fdatasync, O_DIRECT"),
    ("reference.read_direct", "reference: read, O_DIRECT"),
    ("torch.save", "torch.save (not durable)"),
    ("torch.save_fsync", "torch.save + fsync"),
    ("torch.load", "torch.load (cold cache)"),
    ("dcp.save", "DCP save"),
    ("dcp.async_save", "DCP async_save (blocking)"),
    ("dcp.async_save_done", "DCP async_save (completed)"),
    ("dcp.load", "DCP load (cold cache, in place)"),
    ("dlrover.save.first", "DLRover save to memory, first (blocking)"),
    ("dlrover.save.steady", "DLRover save to memory, steady (blocking)"),
    ("dlrover.save_to_storage", "DLRover save to storage (blocking)"),
    ("dlrover.committed", "DLRover committed: its tracker names the step (rank files not fsynced)"),
    ("dlrover.committed_fsync", "DLRover committed, then each rank's file fsynced"),
    ("dlrover.restore.memory", "DLRover restore from shared memory, as returned (views of it)"),
    ("dlrover.restore.memory_into", "DLRover restore from shared memory, copied into the state's own tensors"),
    ("dlrover.restore.storage", "DLRover restore from storage (cold cache)"),
)

# python -m bench.training_step: a real training step with no save, a blocking save, an overlapped one (issue 26).
STEP_TARGETS = (
    Target("overlapped step / step without a save", "step.overlapped_save", ("step.no_save",), 1.05),
    # At most 1.25: the blocking save copies at 80% or more of the reference's speed. The reference is the pinned
    # copy on a GPU, the plain copy on the CPU; a run measures one of them.
    Target("blocking save / copy reference", "save.blocking", ("reference.copy_pinned", "reference.copy"), 1.25),
)
STEP_ROWS = (
    ("step.no_save", "training step, no checkpoint"),
    ("step.blocking_save", "save(), then the training step"),
    ("save.blocking", "save() itself (blocking: the copy into the slot)"),
    ("step.overlapped_save", "save(overlap=True), then the training step (guarded optimizer)"),
    ("save.overlapped.staging", "save(overlap=True): from save() to the end of its copy"),
    ("reference.copy_pinned", "reference: non-blocking copy_ into pinned shared memory (GPU)"),
    ("reference.copy", "reference: copy_ into resident shared memory"),
)

# Sizes each run records beside the timings, in bytes, and the decimals to show them in MiB with. A row is
# shown where every result holds it: a run recorded before a size was measured lacks it, and so does a run
# without DLRover for DLRover's.
FOOTPRINT = (
    ("rank_peak_rss_bytes", "peak RSS of a rank (state, slot and restores), MiB", 0),
    ("sidecar_peak_rss_bytes", "peak RSS of the sidecar (with the slots it maps), MiB", 0),
    ("sidecar_peak_private_bytes", "peak private memory of the sidecar (RssAnon), MiB", 0),
    ("stowaway_peak_shm_bytes", "peak shared memory of Stowaway's slots (all ranks), MiB", 0),
    ("stowaway_pooled_shm_bytes", "shared memory with one slot per rank and a pooled spare (all ranks), MiB", 0),
    ("stowaway_pooled_ranks_private_bytes", "private memory of the ranks while they save with a pooled spare "
     "(RssAnon, each rank's peak, summed), MiB", 0),
    ("page_cache_growth_bytes", "page-cache growth during persist, MiB", 1),
    ("dlrover_rank_peak_rss_bytes", "DLRover: peak RSS of a rank (state, its shared memory and restores), MiB", 0),
    ("dlrover_saver_peak_rss_bytes", "DLRover: peak RSS of its saver (with the shared memory it maps), MiB", 0),
    ("dlrover_saver_peak_private_bytes", "DLRover: peak private memory of its saver (RssAnon), MiB", 0),
    ("dlrover_peak_shm_bytes", "DLRover: peak shared memory (all ranks), MiB", 0),
    ("dlrover_ranks_private_bytes", "DLRover: private memory of the ranks while they save (RssAnon, each rank's "
     "peak, summed), MiB", 0),
    ("dlrover_page_cache_growth_bytes", "DLRover: page-cache growth during persist, MiB", 1),
)


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratio(seconds: dict[str, list[float]], target: Target) -> float:
    return median(seconds[target.numerator]) / min(median(seconds[name]) for name in target.denominators)


UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """``256M``, ``1G``, ``4GiB`` or a number of bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def size_label(nbytes: float) -> str:
    return f"{nbytes / 2**30:.0f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def _spread(values: list[float]) -> str:
    return f"{median(values) * 1e3:,.1f} ({min(values) * 1e3:,.1f}-{max(values) * 1e3:,.1f})"


def ratio_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| checkpoint | ranks | " + " | ".join(f"{t.label} (≤ {t.bound})" for t in TARGETS)
        + f" | page-cache growth / checkpoint (≤ {PAGE_CACHE_BOUND:.0%}) |",
        "|---|---:|" + "---:|" * (len(TARGETS) + 1),
    ]
    for result in results:
        cells = []
        for target in TARGETS:
            value = ratio(result["seconds"], target)
            cells.append(f"{value:.2f} {'✓' if value <= target.bound else '✗'}")
        growth = result["page_cache_growth_bytes"] / result["bytes"]
        cells.append(f"{growth:.1%} {'✓' if growth <= PAGE_CACHE_BOUND else '✗'}")
        lines.append(f"| {size_label(result['total'])} | {result['ranks']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _measured(results: list[dict[str, Any]], *names: str) -> bool:
    return all(name in result["seconds"] for result in results for name in names)


Ratios = tuple[tuple[str, str, tuple[tuple[str, ...], ...]], ...]


def context_table(results: list[dict[str, Any]], ratios_of: Ratios = CONTEXT, with_floors: bool = True) -> str:
    """Each term of a denominator is the fastest of its alternatives; the terms are added.

    Only the ratios whose measurements every result holds are shown; with none, the table is empty ("").
    """
    ratios = [(label, numerator, terms) for label, numerator, terms in ratios_of
              if _measured(results, numerator, *(name for term in terms for name in term))]
    floors = [(label, wall) for label, wall in CPU_FLOORS
              if with_floors and _measured(results, wall, f"{wall}.cpu_all")
              and all("cores" in result for result in results)]
    if not ratios and not floors:
        return ""
    labels = [label for label, _, _ in ratios] + [label for label, _ in floors]
    lines = ["| checkpoint | ranks | " + " | ".join(labels) + " |", "|---|---:|" + "---:|" * len(labels)]
    for result in results:
        seconds = result["seconds"]
        cells = []
        for _, numerator, terms in ratios:
            denominator = sum(min(median(seconds[name]) for name in term) for term in terms)
            cells.append(f"{median(seconds[numerator]) / denominator:.2f}")
        for _, wall in floors:
            floor = median(seconds[f"{wall}.cpu_all"]) / result["cores"]
            cells.append(f"{median(seconds[wall]) / floor:.2f}")
        lines.append(f"| {size_label(result['total'])} | {result['ranks']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Issue 23's bounds on the save-phase footprint with pooled spares, against DLRover's, by rank count (others: none).
POOLED_FOOTPRINT_BOUNDS = {1: 1.55, 8: 1.1}
_BESIDE_THE_STATE = ("stowaway_peak_shm_bytes", "stowaway_pooled_shm_bytes", "sidecar_peak_private_bytes",
                     "dlrover_peak_shm_bytes", "dlrover_saver_peak_private_bytes")
_RANKS_PRIVATE = ("stowaway_pooled_ranks_private_bytes", "dlrover_ranks_private_bytes")


def footprint_table(results: list[dict[str, Any]]) -> str:
    """Stowaway's save-phase footprint over DLRover's. Empty without DLRover.

    Issue 23's measure, which its bounds are set against, is the ranks'
    private memory (the state among it) plus shared memory plus the saver's
    private memory. Beside it, the same without the ranks' private memory:
    what each checkpointer adds beside the state, the stricter ratio. A run
    recorded before the ranks' private memory was measured shows only that
    one, without a verdict.
    """
    if not all(key in result for result in results for key in _BESIDE_THE_STATE):
        return ""
    with_ranks = all(key in result for result in results for key in _RANKS_PRIVATE)
    columns = ["two slots per rank / DLRover, beside the state",
               "one slot per rank and a pooled spare / DLRover, beside the state"]
    if with_ranks:
        columns.append("one slot per rank and a pooled spare / DLRover, with the ranks' private memory")
    lines = ["| checkpoint | ranks | " + " | ".join(columns) + " |", "|---|---:|" + "---:|" * len(columns)]
    for result in results:
        dlrover = result["dlrover_peak_shm_bytes"] + result["dlrover_saver_peak_private_bytes"]
        sidecar = result["sidecar_peak_private_bytes"]
        two = (result["stowaway_peak_shm_bytes"] + sidecar) / dlrover
        pooled = (result["stowaway_pooled_shm_bytes"] + sidecar) / dlrover
        cells = [f"{two:.2f}", f"{pooled:.2f}"]
        if with_ranks:
            ratio_with_ranks = ((result["stowaway_pooled_shm_bytes"] + sidecar
                                 + result["stowaway_pooled_ranks_private_bytes"])
                                / (dlrover + result["dlrover_ranks_private_bytes"]))
            bound = POOLED_FOOTPRINT_BOUNDS.get(result["ranks"])
            verdict = "" if bound is None else f" {'✓' if ratio_with_ranks <= bound else '✗'} (≤ {bound})"
            cells.append(f"{ratio_with_ranks:.2f}{verdict}")
        lines.append(f"| {size_label(result['total'])} | {result['ranks']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def times_table(results: list[dict[str, Any]]) -> str:
    """One row per measurement, one column per rank count: median (min-max) in milliseconds."""
    header = "| milliseconds: median (min-max) | " + " | ".join(f"{r['ranks']} ranks" for r in results) + " |"
    lines = [header, "|---|" + "---:|" * len(results)]
    for key, label in ROWS:
        if not _measured(results, key):
            continue
        lines.append(f"| {label} | " + " | ".join(_spread(r["seconds"][key]) for r in results) + " |")
    for key, label, digits in FOOTPRINT:
        if all(key in r for r in results):
            lines.append(f"| {label} | " + " | ".join(f"{r[key] / 2**20:,.{digits}f}" for r in results) + " |")
    return "\n".join(lines)


def markdown(results: list[dict[str, Any]], command: str, machine: str) -> str:
    sections = [
        f"Command: `{command}`  \nMachine: {machine}\n",
        "### Targets (medians, steady state)\n",
        ratio_table(results),
        "\n### Other ratios (medians, steady state; below 1 means Stowaway is faster)\n",
        context_table(results),
    ]
    against_dlrover = context_table(results, DLROVER, with_floors=False)
    if against_dlrover:
        sections += ["\n### Against DLRover's flash checkpoint (medians, steady state; below 1 means Stowaway is "
                     "faster)\n", against_dlrover]
    footprint = footprint_table(results)
    if footprint:
        sections += ["\n### Save-phase footprint against DLRover's (shared memory, the saver's private memory "
                     "and, where measured, the ranks')\n", footprint]
    for size in sorted({r["total"] for r in results}):
        same = sorted((r for r in results if r["total"] == size), key=lambda r: r["ranks"])
        sections += [f"\n### {size_label(size)} in total\n", times_table(same)]
    return "\n".join(sections) + "\n"


def step_markdown(result: dict[str, Any], command: str, machine: str) -> str:
    """The report of ``python -m bench.training_step``: its targets, then every measurement."""
    seconds = result["seconds"]
    lines = [f"Command: `{command}`  \nMachine: {machine}\n",
             f"{result['layers']} layers of {result['width']} features, {result['batch']} rows a step; "
             f"{size_label(result['bytes'])} checkpointed on {result['device']}\n",
             "| target (medians) | ratio | bound |", "|---|---:|---:|"]
    for target in STEP_TARGETS:
        present = tuple(name for name in target.denominators if name in seconds)
        value = ratio(seconds, Target(target.label, target.numerator, present, target.bound))
        lines.append(f"| {target.label} | {value:.3f} {'✓' if value <= target.bound else '✗'} | ≤ {target.bound} |")
    lines += ["", "| milliseconds: median (min-max) | |", "|---|---:|"]
    lines += [f"| {label} | {_spread(seconds[key])} |" for key, label in STEP_ROWS if key in seconds]
    return "\n".join(lines) + "\n"
