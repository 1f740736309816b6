"""A PNG of the handoff latency distributions and the throughput (needs matplotlib: the
benchmark extra)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.report import HandoffResult

if TYPE_CHECKING:
    from benchmarks.throughput import ThroughputResult

__all__ = ["write_chart", "write_handoff_chart"]


def write_chart(
    handoff: list[HandoffResult],
    throughput: list[ThroughputResult],
    path: Path,
    title: str,
) -> None:
    """One figure: the handoff CDF (left) and throughput per client (right), whichever ran."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot

    panels = [panel for panel in (handoff, throughput) if panel]
    if not panels:
        return
    figure, axes_list = pyplot.subplots(
        1, len(panels), figsize=(9 * len(panels), 5.5), dpi=120, squeeze=False
    )
    axes_iter = iter(axes_list[0])
    if handoff:
        axes = next(axes_iter)
        for result in handoff:
            ordered = sorted(result.latencies_ms)
            count = len(ordered)
            # An empirical CDF: every trial is one step, so tails stay visible.
            axes.step(
                ordered,
                [(index + 1) / count for index in range(count)],
                where="post",
                label=f"{result.name} (p50 {result.p50_ms:.3f} ms)",
            )
        axes.set_xscale("log")
        axes.set_xlabel("release -> waiter running (ms, log scale)")
        axes.set_ylabel("fraction of handoffs")
        axes.set_title("Handoff latency", fontsize=10)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8, loc="lower right")
    if throughput:
        axes = next(axes_iter)
        kinds = list(dict.fromkeys(row.kind for row in throughput))
        by_case = {(row.kind, row.keys): row for row in throughput}
        height = 0.4
        for offset, (keys, label) in enumerate((("one", "one key"), ("many", "distinct keys"))):
            positions = [index + offset * height for index in range(len(kinds))]
            values = [
                by_case[(kind, keys)].ops_per_second if (kind, keys) in by_case else 0.0
                for kind in kinds
            ]
            bars = axes.barh(positions, values, height=height, label=label)
            for bar, kind in zip(bars, kinds, strict=True):
                row = by_case.get((kind, keys))
                if row is not None and row.ratio_to_raw is not None:
                    axes.annotate(
                        f" {row.ratio_to_raw:.2f}x",
                        (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                        va="center",
                        fontsize=7,
                    )
        axes.set_yticks([index + height / 2 for index in range(len(kinds))], kinds, fontsize=8)
        axes.invert_yaxis()
        workers = throughput[0].workers
        axes.set_xlabel(f"acquire + release per second, {workers} processes (x raw.timeout)")
        axes.set_title("Throughput", fontsize=10)
        axes.grid(True, axis="x", alpha=0.3)
        axes.legend(fontsize=8, loc="lower right")
    figure.suptitle(textwrap.fill(title, 70 * len(panels)), fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    pyplot.close(figure)


def write_handoff_chart(results: list[HandoffResult], path: Path, title: str) -> None:
    """The handoff panel alone."""
    write_chart(results, [], path, title)
