"""The performance targets (DESIGN.md, "Performance"), judged on one run.

For each target and bind: the bind floor (the least any library must do there), the
contract floor and ours, each with how many of the run's rounds met the target. The
contract floor (``benchmarks.floors``, ``floor.*.contract``) is a lock, written by hand,
that keeps every guarantee DESIGN.md requires of a lock on that bind (re-entrancy per
connection, one holder per lock object, forked children, poolers, the errors, Django's
signals, ``current_advisory_locks``, the pool guard), each the cheapest way a library
could on the benchmark's path, and nothing DESIGN.md does not require. The verdict:
**met** when ours meets it; **open** when the contract floor meets it and ours does not,
so a lock keeping the contract can (the contract floor is one); **unreachable** when the
contract floor misses it too, so no lock keeping the contract can meet it on this
machine; **missed (no contract floor)** where the benchmarks have no contract floor for
the bind. A verdict is *undecided* unless every round it rests on (ours, and the
contract floor's for open and unreachable) fell on the verdict's side.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from benchmarks.report import Report

__all__ = ["TARGETS", "Judged", "Target", "judge", "render_targets"]

# A figure: the run's median ratio and its per-round ratios, or None when not measured.
Figure = tuple[float, list[float]] | None


@dataclass(frozen=True)
class Target:
    what: str
    limit: float
    # True: the ratio must stay at or below the limit (CPU, latency); False: at or above
    # it (throughput).
    at_most: bool
    # bind -> (bind floor, contract floor, ours): case names in the part the target is
    # measured by. None: the benchmarks have no such floor for that bind.
    binds: Mapping[str, tuple[str | None, str | None, str]]
    # How a case's figure is read off the report.
    read: Callable[[Report, str], Figure]

    def meets(self, value: float) -> bool:
        return value <= self.limit if self.at_most else value >= self.limit


def _cpu(report: Report, name: str) -> Figure:
    for row in report.uncontended:
        if row.name == name and row.cpu_ratio_to_twin is not None:
            return row.cpu_ratio_to_twin, row.cpu_round_ratios_to_twin
    return None


def _handoff(report: Report, name: str) -> Figure:
    for result in report.handoff:
        if result.name == name and result.ratio_p50_to_raw is not None:
            return result.ratio_p50_to_raw, result.round_ratios_p50_to_raw
    return None


def _throughput(keys: str) -> Callable[[Report, str], Figure]:
    def read(report: Report, name: str) -> Figure:
        for row in report.throughput:
            if row.kind == name and row.keys == keys and row.ratio_to_raw is not None:
                return row.ratio_to_raw, row.round_ratios
        return None

    return read


# A raw-driver bind measured against a twin of its own in the throughput run: ours and
# the twin each against the run's reference in every round, so a round's ratio to the
# twin is the quotient of the two.
_THROUGHPUT_TWINS = {
    "ours.psycopg_pool.timeout": "raw.psycopg_pool.timeout",
    "ours.asyncpg.timeout": "raw.asyncpg.timeout",
    "floor.asyncpg.contract": "raw.asyncpg.timeout",
    "ours.asyncpg_pool.timeout": "raw.asyncpg_pool.timeout",
    "floor.asyncpg_pool.contract": "raw.asyncpg_pool.timeout",
}


def _throughput_to_twin(keys: str) -> Callable[[Report, str], Figure]:
    read = _throughput(keys)

    def against_twin(report: Report, name: str) -> Figure:
        twin = _THROUGHPUT_TWINS.get(name)
        if twin is None:
            return read(report, name)
        ours, theirs = read(report, name), read(report, twin)
        if ours is None or theirs is None or len(ours[1]) != len(theirs[1]):
            return None
        rounds = [mine / twins for mine, twins in zip(ours[1], theirs[1], strict=True)]
        return statistics.median(rounds), rounds

    return against_twin


def _binds(
    floor: str, contract: str, ours: Callable[[str], str]
) -> dict[str, tuple[str, str, str]]:
    return {
        label: (floor.format(bind), contract.format(bind), ours(bind))
        for label, bind in (
            ("`Engine`", "engine"),
            ("`Session`", "session"),
            ("`Connection`", "connection"),
            ("Django", "django"),
        )
    }


_UNCONTENDED = _binds("floor.{}.timeout", "floor.{}.contract", lambda bind: f"ours.{bind}.timeout")
_RAW_THROUGHPUT = {
    "psycopg `Connection`": (None, "floor.psycopg.contract", "ours.psycopg.timeout"),
    # Each against its own twin: the pool, the asyncpg connection or pool by hand.
    "`psycopg_pool`": (None, None, "ours.psycopg_pool.timeout"),
    "asyncpg `Connection`": (None, "floor.asyncpg.contract", "ours.asyncpg.timeout"),
    "asyncpg `Pool`": (None, "floor.asyncpg_pool.contract", "ours.asyncpg_pool.timeout"),
}

TARGETS = [
    Target("client CPU <= 1.3x", 1.3, True, dict(_UNCONTENDED), _cpu),
    Target(
        "client CPU <= 1.1x (raw driver)",
        1.1,
        True,
        {
            "psycopg `Connection`": (None, "floor.psycopg.contract", "ours.psycopg.timeout"),
            # Each against its own raw twin (the same driver or pool by hand).
            "`psycopg_pool`": (None, None, "ours.psycopg_pool.timeout"),
            "asyncpg `Connection`": (None, "floor.asyncpg.contract", "ours.asyncpg.timeout"),
            "asyncpg `Pool`": (None, "floor.asyncpg_pool.contract", "ours.asyncpg_pool.timeout"),
        },
        _cpu,
    ),
    Target("throughput, one key, >= 0.85x", 0.85, False, dict(_UNCONTENDED), _throughput("one")),
    Target(
        "throughput, distinct keys, >= 0.85x",
        0.85,
        False,
        dict(_UNCONTENDED),
        _throughput("many"),
    ),
    # "<= 1.1x the twin in throughput": the twin gets at most 1.1 times our operations.
    Target(
        "throughput, one key, >= 0.909x (raw driver)",
        1 / 1.1,
        False,
        _RAW_THROUGHPUT,
        _throughput_to_twin("one"),
    ),
    Target(
        "throughput, distinct keys, >= 0.909x (raw driver)",
        1 / 1.1,
        False,
        _RAW_THROUGHPUT,
        _throughput_to_twin("many"),
    ),
    Target(
        "handoff p50 <= 1.1x",
        1.1,
        True,
        _binds(
            "floor.{}.handoff.timeout",
            "floor.{}.contract.handoff",
            # The Engine's variant was the first, and kept its name.
            lambda bind: (
                "ours.handoff.timeout" if bind == "engine" else f"ours.{bind}.handoff.timeout"
            ),
        ),
        _handoff,
    ),
]


@dataclass(frozen=True)
class Judged:
    target: Target
    bind: str
    floor: Figure
    contract: Figure
    ours: Figure

    def _rounds(self, figure: Figure) -> str:
        if figure is None or not figure[1]:
            return ""
        met = sum(self.target.meets(value) for value in figure[1])
        return f"{met}/{len(figure[1])}"

    def _all_on(self, figure: Figure, meeting: bool) -> bool:
        """Whether every round of ``figure`` fell on the side ``meeting`` says (the
        run's figure itself may be pooled, as a handoff's p50 is, not a round's median)."""
        if figure is None:
            return True
        return all(self.target.meets(value) is meeting for value in figure[1])

    @property
    def verdict(self) -> str:
        if self.ours is None:
            return "not measured"
        met = self.target.meets(self.ours[0])
        if self.contract is None:
            # A bind without a contract floor in the run: nothing says whether a lock
            # keeping the contract could meet it there.
            verdict = "met" if met else "missed (no contract floor)"
            decided = self._all_on(self.ours, met)
        elif met:
            verdict = "met"
            decided = self._all_on(self.ours, True)
        elif self.target.meets(self.contract[0]):
            verdict = "open"
            decided = self._all_on(self.ours, False) and self._all_on(self.contract, True)
        else:
            verdict = "unreachable"
            decided = self._all_on(self.ours, False) and self._all_on(self.contract, False)
        return verdict if decided else verdict + ", undecided"

    def cells(self) -> list[str]:
        return [
            _figure(self.floor),
            _figure(self.contract),
            self._rounds(self.contract),
            _figure(self.ours),
            self._rounds(self.ours),
            self.verdict,
        ]


def _figure(figure: Figure) -> str:
    # Three decimals: a verdict on 1.303 against 1.3 must not read as 1.30x.
    return "-" if figure is None else f"{figure[0]:.3f}x"


def judge(report: Report) -> list[Judged]:
    """Every target on every bind whose library case the run measured."""
    judged = []
    for target in TARGETS:
        for bind, (floor, contract, ours) in target.binds.items():
            row = Judged(
                target,
                bind,
                None if floor is None else target.read(report, floor),
                None if contract is None else target.read(report, contract),
                target.read(report, ours),
            )
            if row.ours is not None:
                judged.append(row)
    return judged


def render_targets(report: Report) -> list[str]:
    """The targets as a Markdown table (no lines when the run measured none of them)."""
    judged = judge(report)
    if not judged:
        return []
    lines = [
        "| target | bind | bind floor | contract floor | its rounds on target | ours "
        "| its rounds on target | verdict |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    previous = None
    for row in judged:
        what = row.target.what if row.target is not previous else ""
        previous = row.target
        lines.append("| " + " | ".join([what, row.bind, *row.cells()]) + " |")
    return lines
