"""``python -m bench.charts RESULTS.json``: the charts of a recorded run, drawn from its results.json alone.

One chart per checkpoint size: blocking save, time until durable, restore
from shared memory and restore from storage, for each rank count, with
Stowaway, the peers and the physical references side by side (medians, the
whiskers spanning min-max). One summary chart (the README's): every
configuration's time over its physical reference, per system, so that where
each one sits against the floor shows at a glance. A series the run did not
measure (DLRover in a run without it, the pinned copy off a GPU) is left out
and named under the chart.

``python -m bench --out DIR`` draws them after a run; this command redraws
them without measuring again. matplotlib is imported only to draw: the
harness's own environment (``python -m bench.env``) has it, the project's
does not, and the series below are plain data that need no drawing library.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import report

Result = dict[str, Any]
COLOURS = {
    "stowaway": ("#1f5fa8", "#6fa3dc"),
    "dlrover": ("#d9731a", "#f2b36d"),
    "dcp": ("#2f8f46", "#8fcf95"),
    "torch": ("#7b4fa6", "#c0a2dd"),
    "reference": ("#5a5a5a", "#b0b0b0"),
}
SIZE_COLOURS = ("#9ecae1", "#4292c6", "#08519c", "#08306b")
SUMMARY = "summary.png"


@dataclass(frozen=True)
class Series:
    """One bar of a group: the fastest median among ``keys``, and for the summary, over that of ``floor``."""

    label: str
    keys: tuple[str, ...]
    system: str
    floor: tuple[str, ...] = ()


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]


COPY = ("reference.copy",)
WRITE = ("reference.write_buffered", "reference.write_direct")
# How the summary names each floor.
FLOORS = {
    COPY: "the copy into shared memory",
    WRITE: "write + fdatasync",
    ("reference.copy_out_fresh",): "copy out",
    ("reference.copy_back",): "copy back",
    ("reference.read_direct",): "an O_DIRECT read",
}
PANELS = (
    Panel("save: blocking time", (
        Series("Stowaway save", ("stowaway.save.steady",), "stowaway", COPY),
        Series("DLRover save to memory", ("dlrover.save.steady",), "dlrover", COPY),
        Series("DCP async_save", ("dcp.async_save",), "dcp", COPY),
        Series("torch.save (not durable)", ("torch.save",), "torch", COPY),
        Series("copy into shared memory", COPY, "reference"),
    )),
    Panel("save: until durable", (
        Series("Stowaway committed", ("stowaway.committed.steady",), "stowaway", WRITE),
        Series("DLRover committed + fsync", ("dlrover.committed_fsync",), "dlrover", WRITE),
        Series("DCP async_save completed", ("dcp.async_save_done",), "dcp", WRITE),
        Series("DCP save", ("dcp.save",), "dcp", WRITE),
        Series("torch.save + fsync", ("torch.save_fsync",), "torch", WRITE),
        Series("write + fdatasync (faster of buffered, O_DIRECT)", WRITE, "reference"),
    )),
    Panel("restore from shared memory", (
        Series("Stowaway, into new tensors", ("stowaway.restore.memory",), "stowaway", ("reference.copy_out_fresh",)),
        Series("Stowaway, into the state's tensors", ("stowaway.restore.memory_into",), "stowaway",
               ("reference.copy_back",)),
        Series("DLRover, into the state's tensors", ("dlrover.restore.memory_into",), "dlrover",
               ("reference.copy_back",)),
        Series("copy out into new tensors", ("reference.copy_out_fresh",), "reference"),
        Series("copy back into the state's tensors", ("reference.copy_back",), "reference"),
    )),
    Panel("restore from storage (cold cache)", (
        Series("Stowaway", ("stowaway.restore.storage",), "stowaway", ("reference.read_direct",)),
        Series("DLRover", ("dlrover.restore.storage",), "dlrover", ("reference.read_direct",)),
        Series("torch.load", ("torch.load",), "torch", ("reference.read_direct",)),
        Series("DCP load (in place)", ("dcp.load",), "dcp", ("reference.read_direct",)),
        Series("read, O_DIRECT", ("reference.read_direct",), "reference"),
    )),
)


def measured(results: list[Result], series: Series) -> bool:
    """Whether every result holds one of the series' measurements, and its floor's."""
    return all(any(key in r["seconds"] for key in series.keys) and
               all(key in r["seconds"] for key in series.floor) for r in results)


def fastest(result: Result, keys: tuple[str, ...]) -> list[float]:
    """The timings of whichever of ``keys`` has the lowest median in ``result``."""
    found = [result["seconds"][key] for key in keys if key in result["seconds"]]
    return min(found, key=statistics.median)


def bars(results: list[Result], panel: Panel) -> list[tuple[Series, list[tuple[float, float, float]]]]:
    """Per measured series, per result: median, min and max in milliseconds."""
    drawn = []
    for series in panel.series:
        if measured(results, series):
            values = [fastest(r, series.keys) for r in results]
            drawn.append((series, [(statistics.median(v) * 1e3, min(v) * 1e3, max(v) * 1e3) for v in values]))
    return drawn


def ratios(results: list[Result], panel: Panel) -> list[tuple[Series, list[tuple[Result, float]]]]:
    """Per measured series that has a floor, per result: its median over the floor's median."""
    return [(series, [(r, statistics.median(fastest(r, series.keys)) / statistics.median(fastest(r, series.floor)))
                      for r in results])
            for series in panel.series if series.floor and measured(results, series)]


def missing(results: list[Result]) -> list[str]:
    """Labels of the series this run did not measure."""
    return [f"{series.label} ({panel.title})" for panel in PANELS for series in panel.series
            if not measured(results, series)]


def _colour(series: Series, panel: Panel) -> str:
    shades = COLOURS[series.system]
    same = [s for s in panel.series if s.system == series.system]
    return shades[min(same.index(series), len(shades) - 1)]


def _footnote(figure: Any, results: list[Result]) -> None:
    absent = missing(results)
    if absent:
        figure.supxlabel("Not measured in this run: " + "; ".join(absent), fontsize=7, wrap=True)


def _plain_log_axis(axis: Any) -> None:
    """A log scale labelled 20, 50, 100 rather than 2 x 10^1."""
    from matplotlib import ticker

    axis.set_yscale("log")
    axis.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:,.{0 if value >= 1 else 1}f}"))
    axis.yaxis.set_minor_formatter(ticker.NullFormatter())


def draw_times(results: list[Result], path: Path) -> None:
    """The four panels for one checkpoint size, grouped by rank count."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    results = sorted(results, key=lambda r: r["ranks"])
    figure, axes = pyplot.subplots(2, 2, figsize=(13, 9), layout="constrained")
    reps = max(len(values) for r in results for values in r["seconds"].values())
    figure.suptitle(f"{report.size_label(results[0]['total'])} in total, per rank count: median of up to {reps} "
                    "repetitions, whiskers min-max (log scale)")
    for axis, panel in zip(axes.flat, PANELS, strict=True):
        drawn = bars(results, panel)
        width = 0.8 / max(len(drawn), 1)
        for index, (series, values) in enumerate(drawn):
            positions = [group + (index - (len(drawn) - 1) / 2) * width for group in range(len(results))]
            medians = [median for median, _, _ in values]
            whiskers = [[median - low for median, low, _ in values], [high - median for median, _, high in values]]
            axis.bar(positions, medians, width, yerr=whiskers, label=series.label, color=_colour(series, panel),
                     hatch="//" if series.system == "reference" else None, edgecolor="white", linewidth=0.3,
                     error_kw={"elinewidth": 0.8, "capsize": 1.5})
        axis.set_xticks(range(len(results)), [f"{r['ranks']} rank{'s' if r['ranks'] > 1 else ''}" for r in results])
        _plain_log_axis(axis)
        # Room above the tallest whisker for the legend (a factor, on a log scale).
        low, high = axis.get_ylim()
        axis.set_ylim(low, high * 5)
        axis.set_ylabel("milliseconds")
        axis.set_title(panel.title)
        axis.grid(axis="y", which="major", alpha=0.3)
        axis.legend(fontsize=7, loc="upper left")
    _footnote(figure, results)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def draw_summary(results: list[Result], path: Path) -> None:
    """Every configuration's time over its physical reference, one column of points per system and panel."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    sizes = sorted({r["total"] for r in results})
    ranks = sorted({r["ranks"] for r in results})
    figure, axes = pyplot.subplots(1, 4, figsize=(17, 5.5), layout="constrained")
    figure.suptitle(f"Time over the physical reference in the same run, median of each of {len(results)} "
                    "configurations (1 = the bare copy, write or read of the same bytes; log scale)")
    for axis, panel in zip(axes.flat, PANELS, strict=True):
        drawn = ratios(results, panel)
        for column, (series, points) in enumerate(drawn):
            for result, value in points:
                offset = (ranks.index(result["ranks"]) - (len(ranks) - 1) / 2) * 0.12
                axis.scatter(column + offset, value, s=18, zorder=3,
                             color=SIZE_COLOURS[min(sizes.index(result["total"]), len(SIZE_COLOURS) - 1)])
            middle = statistics.median(value for _, value in points)
            axis.hlines(middle, column - 0.35, column + 0.35, color=_colour(series, panel), linewidth=2.5, zorder=2)
        axis.axhline(1, color="#5a5a5a", linestyle="--", linewidth=1)
        floors = {FLOORS[series.floor] for series, _ in drawn}
        labels = [series.label if len(floors) == 1 else f"{series.label}\n÷ {FLOORS[series.floor]}"
                  for series, _ in drawn]
        axis.set_xticks(range(len(drawn)), labels, rotation=30, ha="right", fontsize=8)
        axis.set_title(panel.title + (f"\n÷ {floors.pop()}" if len(floors) == 1 else "\n÷ its reference"),
                       fontsize=9)
        _plain_log_axis(axis)
        axis.grid(axis="y", which="major", alpha=0.3)
    handles = [pyplot.Line2D([], [], marker="o", linestyle="", color=SIZE_COLOURS[min(i, len(SIZE_COLOURS) - 1)],
                             label=report.size_label(size)) for i, size in enumerate(sizes)]
    handles.append(pyplot.Line2D([], [], color="black", linewidth=2.5, label="median of the configurations"))
    figure.legend(handles=handles, loc="outside right upper", fontsize=8,
                  title=f"one point a configuration:\n{', '.join(map(str, ranks))} ranks left to right",
                  title_fontsize=8)
    _footnote(figure, results)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def times_name(total: int) -> str:
    return f"times-{report.size_label(total).replace(' ', '')}.png"


def draw(results: list[Result], out: Path) -> list[Path]:
    """Every chart of a run into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for total in sorted({r["total"] for r in results}):
        paths.append(out / times_name(total))
        draw_times([r for r in results if r["total"] == total], paths[-1])
    paths.append(out / SUMMARY)
    draw_summary(results, paths[-1])
    return paths


def draw_or_say_why(results: list[Result], out: Path) -> None:
    """After a run: the charts, or why there are none (this Python has no matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"bench: matplotlib is not installed in this Python ({sys.executable}), so no charts were drawn; "
              f"run `python -m bench.charts {out / 'results.json'}` from the harness's own environment "
              "(python -m bench.env prints it) to draw them", file=sys.stderr)
        return
    for path in draw(results, out):
        print(f"bench: drew {path}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.charts", description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a results.json written by python -m bench --out")
    parser.add_argument("--out", type=Path, default=None, help="where to write the PNGs (default: beside results)")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    for path in draw(results, args.out or args.results.parent):
        print(path)


if __name__ == "__main__":
    main()
