"""Interleaved timing: every case runs in every round, in alternating small blocks.

A laptop's clock speed, a neighbour's cron job or a vacuum on the server drift over
seconds; running every case in every round spreads that drift over all cases alike, and a
ratio taken within one round cancels most of what is left.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from time import perf_counter_ns, thread_time_ns
from typing import Protocol

__all__ = [
    "Case",
    "CaseSamples",
    "Stopwatch",
    "Timer",
    "interleave",
    "percentile",
    "with_references",
]


class Stopwatch(Protocol):
    """Brackets the part of an operation that counts (time, or round trips)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class Timer:
    """A stopwatch that records wall and this thread's CPU nanoseconds per start/stop.

    CPU time is what the client itself spent (Python, driver, syscalls). Unlike wall
    time it does not depend on how fast the scheduler wakes a process that waits on its
    socket, which on a small VM varies several-fold from one minute to the next.
    """

    __slots__ = ("_cpu_started", "_started", "cpu_samples", "samples")

    def __init__(self) -> None:
        self.samples: list[int] = []
        self.cpu_samples: list[int] = []
        self._started = self._cpu_started = 0

    def start(self) -> None:
        # The CPU clock is a syscall (~0.5 us); read it outside the wall-clock bracket.
        self._cpu_started = thread_time_ns()
        self._started = perf_counter_ns()

    def stop(self) -> None:
        stopped = perf_counter_ns()
        self.cpu_samples.append(thread_time_ns() - self._cpu_started)
        self.samples.append(stopped - self._started)


def _nothing() -> None:
    pass


@dataclass
class Case:
    """One operation to time, e.g. "acquire with a timeout, then release".

    ``operation`` performs the operation once, bracketing the part that counts with the
    stopwatch it is given, so a case can keep its own preparation (opening the caller's
    transaction, say) out of both the time and the round-trip count.
    """

    name: str
    group: str
    description: str
    operation: Callable[[Stopwatch], None]
    # The raw-driver case this one should match, for a like-for-like ratio.
    twin: str | None = None
    # The floor of this case's bind (a ``floor.*`` case): the least any library must do
    # on that bind for the same operation, so that ours / floor is what the library adds.
    bind_floor: str | None = None
    # Untimed hooks around each round (e.g. taking an outer lock for a re-entrancy case).
    before_round: Callable[[], None] = _nothing
    after_round: Callable[[], None] = _nothing
    # File descriptors of the TCP sockets the operation talks over (for round trips).
    sockets: Callable[[], list[int]] = list


@dataclass
class CaseSamples:
    """Nanosecond samples of one case, kept per round."""

    case: Case
    rounds: list[list[int]] = field(default_factory=list)
    cpu_rounds: list[list[int]] = field(default_factory=list)

    @property
    def all(self) -> list[int]:
        return [sample for samples in self.rounds for sample in samples]

    @property
    def all_cpu(self) -> list[int]:
        return [sample for samples in self.cpu_rounds for sample in samples]

    def round_medians(self) -> list[float]:
        return [statistics.median(samples) for samples in self.rounds]

    def cpu_round_medians(self) -> list[float]:
        return [statistics.median(samples) for samples in self.cpu_rounds]


def interleave(
    cases: Sequence[Case],
    *,
    rounds: int,
    iterations: int,
    warmup: int,
    block: int = 25,
    pin: Callable[[], None] = _nothing,
    progress: Callable[[str], None] = lambda message: None,
) -> dict[str, CaseSamples]:
    """Time every case ``iterations`` times per round, for ``rounds`` rounds.

    Within a round the cases take turns in blocks of ``block`` operations (A A A B B B
    C C C A A A ...): the cost of a round trip on a shared VM changes several-fold from
    one second to the next, so a case and its twin must be timed within milliseconds of
    each other for their ratio to mean anything. ``pin`` runs before every round (it
    pins any backend a pool opened since).
    """
    results = {case.name: CaseSamples(case) for case in cases}
    for case in cases:
        case.before_round()
        warming = Timer()
        for _ in range(warmup):
            case.operation(warming)
        case.after_round()
    blocks = max(1, -(-iterations // block))
    for number in range(rounds):
        pin()
        # Rotating the order keeps any case from always running right after another
        # (which can warm or chill the server's caches for it).
        shift = number % len(cases)
        ordered = [*cases[shift:], *cases[:shift]]
        timers = {case.name: Timer() for case in ordered}
        started: list[Case] = []
        try:
            for case in ordered:
                case.before_round()
                started.append(case)
            for index in range(blocks):
                count = min(block, iterations - index * block)
                for case in ordered:
                    operation, timer = case.operation, timers[case.name]
                    for _ in range(count):
                        operation(timer)
        finally:
            for case in reversed(started):
                case.after_round()
        for case in ordered:
            results[case.name].rounds.append(timers[case.name].samples)
            results[case.name].cpu_rounds.append(timers[case.name].cpu_samples)
        progress(f"round {number + 1}/{rounds} done")
    return results


def percentile(samples: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile (0..1) by linear interpolation between ranks."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    position = fraction * (len(ordered) - 1)
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


class _Referring(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def twin(self) -> str | None: ...

    @property
    def bind_floor(self) -> str | None: ...


def with_references(cases: Iterable[_Referring], chosen: set[str]) -> set[str]:
    """``chosen`` and the cases its ratios need: each chosen case's bind floor, then the
    raw twin of each (a bind floor has one too)."""
    cases = list(cases)
    chosen = chosen | {case.bind_floor for case in cases if case.name in chosen and case.bind_floor}
    return chosen | {case.twin for case in cases if case.name in chosen and case.twin}
