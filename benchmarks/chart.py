"""A PNG of the handoff latency distributions (needs matplotlib: the benchmark extra)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.report import HandoffResult

__all__ = ["write_handoff_chart"]


def write_handoff_chart(results: list[HandoffResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(9, 5.5), dpi=120)
    for result in results:
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
    axes.set_title(title, fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    pyplot.close(figure)
