"""Turn samples into figures (medians, percentiles, ratios) and write them out.

Writers take a finished :class:`Report`, so another output (a chart, a docs page) is one
more function over the same object.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from benchmarks.measure import CaseSamples, percentile

if TYPE_CHECKING:
    from benchmarks.scale import ScaleResult
    from benchmarks.throughput import ThroughputResult

__all__ = [
    "HandoffResult",
    "Report",
    "UncontendedResult",
    "handoff_results",
    "ratio_text",
    "uncontended_results",
    "write_json",
    "write_table",
]


@dataclass
class UncontendedResult:
    name: str
    group: str
    description: str
    twin: str | None
    samples: int
    median_us: float
    p90_us: float
    p99_us: float
    # Median over rounds of (this case's round median / the other case's round median).
    ratio_to_floor: float
    ratio_to_twin: float | None
    round_ratios_to_floor: list[float]
    # This thread's CPU time per operation: the client's own cost, immune to how fast
    # the scheduler wakes processes waiting on a socket.
    cpu_median_us: float
    cpu_ratio_to_floor: float
    # Median over rounds of (this case's CPU median / its twin's), the twin timed in
    # alternate blocks with it: the figure the performance targets are set on.
    cpu_ratio_to_twin: float | None
    round_trips: float | None
    # This case's CPU median over its twin's, one figure per round (empty without a twin).
    cpu_round_ratios_to_twin: list[float] = field(default_factory=list)
    # The floor of this case's bind (floor.*), and this case against it the same ways as
    # against its twin: what the library adds over the least any library must do there.
    bind_floor: str | None = None
    ratio_to_bind_floor: float | None = None
    cpu_ratio_to_bind_floor: float | None = None


@dataclass
class HandoffResult:
    name: str
    description: str
    trials: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    ratio_p50_to_raw: float | None
    latencies_ms: list[float] = field(repr=False)
    # p50 over the reference's p50 within each round (the trials of a round are spread
    # over the same seconds as the reference's).
    round_ratios_p50_to_raw: list[float] = field(default_factory=list)


@dataclass
class Report:
    environment: dict[str, str]
    settings: dict[str, object]
    floor: str
    uncontended: list[UncontendedResult]
    handoff: list[HandoffResult]
    throughput: list[ThroughputResult] = field(default_factory=list)
    scale: ScaleResult | None = None
    notes: list[str] = field(default_factory=list)


def _round_ratios(case: CaseSamples, other: CaseSamples) -> list[float]:
    return [
        mine / theirs
        for mine, theirs in zip(case.round_medians(), other.round_medians(), strict=True)
    ]


def _cpu_round_ratios(case: CaseSamples, other: CaseSamples) -> list[float]:
    return [
        mine / theirs
        for mine, theirs in zip(case.cpu_round_medians(), other.cpu_round_medians(), strict=True)
    ]


def _paired(
    case: CaseSamples, samples: dict[str, CaseSamples], other: str | None
) -> tuple[float | None, float | None]:
    """Median over rounds of (case / other) in wall and in CPU time; None without other."""
    if other is None or other not in samples:
        return None, None
    return (
        statistics.median(_round_ratios(case, samples[other])),
        statistics.median(_cpu_round_ratios(case, samples[other])),
    )


def uncontended_results(
    samples: dict[str, CaseSamples], floor: str, round_trips: dict[str, float | None]
) -> list[UncontendedResult]:
    results = []
    for name, case_samples in samples.items():
        everything = case_samples.all
        to_floor = _round_ratios(case_samples, samples[floor])
        twin = case_samples.case.twin
        bind_floor = case_samples.case.bind_floor
        to_twin, cpu_to_twin = _paired(case_samples, samples, twin)
        to_bind_floor, cpu_to_bind_floor = _paired(case_samples, samples, bind_floor)
        cpu_rounds = _cpu_round_ratios(case_samples, samples[twin]) if twin in samples else []
        results.append(
            UncontendedResult(
                name=name,
                group=case_samples.case.group,
                description=case_samples.case.description,
                twin=twin,
                samples=len(everything),
                median_us=statistics.median(everything) / 1000,
                p90_us=percentile(everything, 0.9) / 1000,
                p99_us=percentile(everything, 0.99) / 1000,
                ratio_to_floor=statistics.median(to_floor),
                ratio_to_twin=to_twin,
                round_ratios_to_floor=to_floor,
                cpu_median_us=statistics.median(case_samples.all_cpu) / 1000,
                cpu_ratio_to_floor=(
                    statistics.median(case_samples.all_cpu)
                    / statistics.median(samples[floor].all_cpu)
                ),
                cpu_ratio_to_twin=cpu_to_twin,
                round_trips=round_trips.get(name),
                cpu_round_ratios_to_twin=cpu_rounds,
                bind_floor=bind_floor,
                ratio_to_bind_floor=to_bind_floor,
                cpu_ratio_to_bind_floor=cpu_to_bind_floor,
            )
        )
    return results


def split_rounds(values: list[float], rounds: int) -> list[list[float]]:
    """``values`` in trial order, cut into the rounds they were taken in: each round takes
    ``len(values) // rounds`` trials, the first ones one more for any remainder (as
    ``benchmarks.handoff.run_handoffs`` deals them out)."""
    size, extra = divmod(len(values), rounds)
    parts, start = [], 0
    for number in range(rounds):
        stop = start + size + (1 if number < extra else 0)
        parts.append(values[start:stop])
        start = stop
    return [part for part in parts if part]


def handoff_results(
    latencies: dict[str, list[float]],
    descriptions: dict[str, str],
    reference: str | None,
    rounds: int = 1,
) -> list[HandoffResult]:
    raw_p50 = statistics.median(latencies[reference]) if reference in latencies else None
    raw_rounds = (
        [statistics.median(part) for part in split_rounds(latencies[reference], rounds)]
        if reference in latencies
        else []
    )
    results = []
    for name, seconds in latencies.items():
        p50 = statistics.median(seconds)
        mine = [statistics.median(part) for part in split_rounds(seconds, rounds)]
        results.append(
            HandoffResult(
                name=name,
                description=descriptions[name],
                trials=len(seconds),
                p50_ms=p50 * 1000,
                p90_ms=percentile(seconds, 0.9) * 1000,
                p99_ms=percentile(seconds, 0.99) * 1000,
                ratio_p50_to_raw=None if raw_p50 is None else p50 / raw_p50,
                latencies_ms=[value * 1000 for value in seconds],
                round_ratios_p50_to_raw=(
                    [a / b for a, b in zip(mine, raw_rounds, strict=True)]
                    if len(mine) == len(raw_rounds)
                    else []
                ),
            )
        )
    return results


def ratio_text(value: float | None) -> str:
    """A ratio as the tables print it (``-`` where there is none)."""
    return "-" if value is None else f"{value:.2f}x"


def _trips(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def write_table(report: Report, stream: TextIO) -> None:
    environment = ", ".join(f"{key} {value}" for key, value in report.environment.items())
    settings = ", ".join(f"{key}={value}" for key, value in report.settings.items())
    print(f"# {environment}", file=stream)
    print(f"# {settings}", file=stream)
    if report.uncontended:
        print(file=stream)
        print(f"Uncontended acquire + release (floor: {report.floor})", file=stream)
        print(
            "x floor: against the floor; x twin: against the raw twin (a floor.* row's is "
            "what its bind costs); x bind: against the floor of the case's bind (what the "
            "library adds)",
            file=stream,
        )
        header = (
            f"{'case':38} {'median us':>10} {'p90 us':>9} {'x floor':>8} {'x twin':>7} "
            f"{'x bind':>7} {'cpu us':>7} {'cpu x fl':>8} {'cpu x tw':>8} {'cpu x bd':>8} "
            f"{'trips':>6}  twin / bind floor"
        )
        print(header, file=stream)
        print("-" * len(header), file=stream)
        for row in report.uncontended:
            pairs = " / ".join(name for name in (row.twin, row.bind_floor) if name)
            print(
                f"{row.name:38} {row.median_us:10.1f} {row.p90_us:9.1f} "
                f"{ratio_text(row.ratio_to_floor):>8} {ratio_text(row.ratio_to_twin):>7} "
                f"{ratio_text(row.ratio_to_bind_floor):>7} "
                f"{row.cpu_median_us:7.1f} {ratio_text(row.cpu_ratio_to_floor):>8} "
                f"{ratio_text(row.cpu_ratio_to_twin):>8} "
                f"{ratio_text(row.cpu_ratio_to_bind_floor):>8} "
                f"{_trips(row.round_trips):>6}  {pairs}",
                file=stream,
            )
    if report.handoff:
        print(file=stream)
        print("Handoff: holder's release call -> blocked waiter's acquire returns", file=stream)
        header = (
            f"{'case':32} {'trials':>6} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'p50 x raw':>10}"
        )
        print(header, file=stream)
        print("-" * len(header), file=stream)
        for result in report.handoff:
            print(
                f"{result.name:32} {result.trials:6d} {result.p50_ms:9.3f} "
                f"{result.p90_ms:9.3f} {result.p99_ms:9.3f} "
                f"{ratio_text(result.ratio_p50_to_raw):>10}",
                file=stream,
            )
    if report.throughput:
        _write_throughput(report, stream)
    if report.scale is not None:
        _write_scale(report, stream)
    for note in report.notes:
        print(f"note: {note}", file=stream)


def _write_throughput(report: Report, stream: TextIO) -> None:
    workers = report.throughput[0].workers
    print(file=stream)
    print(f"Throughput: {workers} worker processes, acquire + release per second", file=stream)
    header = f"{'case':40} {'ops/s':>9} {'x raw':>7}  per round"
    print(header, file=stream)
    print("-" * len(header), file=stream)
    for row in report.throughput:
        rounds = " ".join(f"{value:.0f}" for value in row.rounds[:6])
        rounds += " ..." if len(row.rounds) > 6 else ""
        print(
            f"{row.name:40} {row.ops_per_second:9.0f} {ratio_text(row.ratio_to_raw):>7}  {rounds}",
            file=stream,
        )


def _write_scale(report: Report, stream: TextIO) -> None:
    scale = report.scale
    assert scale is not None
    settings = ", ".join(f"{key}={value}" for key, value in scale.server_settings.items())
    print(file=stream)
    print(f"Scale (private server: {settings})", file=stream)
    print(
        f"  {scale.locks_held} distinct locks held on one connection: acquired in "
        f"{scale.acquire_all_seconds:.2f} s, released in {scale.release_all_seconds:.2f} s; "
        f"{scale.server_rows} rows in pg_locks",
        file=stream,
    )
    print(f"  client memory per held lock: {scale.client_bytes_per_lock:.0f} bytes", file=stream)
    print(
        f"  lock table full after {scale.limit_reached_at} locks; other locks intact: "
        f"{scale.limit_other_locks_intact}; error: {scale.limit_error}",
        file=stream,
    )
    print(
        f"  {scale.waiters} waiters on one key: all through in "
        f"{scale.waiters_all_done_seconds:.3f} s ({scale.waiters_mean_handoff_ms:.3f} ms per "
        f"handoff), at most {scale.waiters_max_inside} inside at once",
        file=stream,
    )


def write_json(report: Report, path: Path) -> None:
    path.write_text(json.dumps(asdict(report), indent=2) + "\n", encoding="utf-8")
