"""Entry point: ``python -m benchmarks.run [--rounds N] [--iterations N] [--json PATH]``.

Everything is measured in this one process run: the raw driver floor and our cases share
the machine's mood, and ratios are taken round by round.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import platform
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import psycopg
import sqlalchemy

from benchmarks.chart import write_chart
from benchmarks.django_cases import django_cases, pals_cases
from benchmarks.docs_page import DOCS_PAGE, write_docs_page
from benchmarks.handoff import HANDOFF_VARIANTS, run_handoffs
from benchmarks.handoff import descriptions as handoff_descriptions
from benchmarks.measure import Case, interleave, with_references
from benchmarks.pinning import Pinning, server_sockets
from benchmarks.postgres import URL_VARIABLE, database_url, server_version
from benchmarks.raw_drivers import raw_driver_cases
from benchmarks.report import (
    HandoffResult,
    Report,
    UncontendedResult,
    handoff_results,
    uncontended_results,
    write_json,
    write_table,
)
from benchmarks.round_trips import count_round_trips
from benchmarks.scale import ScaleResult, run_scale
from benchmarks.targets import render_targets
from benchmarks.throughput import ThroughputResult, run_throughput
from benchmarks.uncontended import FLOOR, uncontended_cases
from tests.private_postgres import PrivateServerUnavailable

GROUPS = ("uncontended", "handoff", "throughput", "scale")
DEFAULT_CHART = Path(tempfile.gettempdir()) / "advisory-locks-benchmarks.png"


def main(argv: list[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    url = database_url()

    def progress(message: str) -> None:
        if not arguments.quiet:
            print(f"... {message}", file=sys.stderr, flush=True)

    uncontended: list[UncontendedResult] = []
    handoff: list[HandoffResult] = []
    throughput: list[ThroughputResult] = []
    scale: ScaleResult | None = None
    notes: list[str] = []
    with ExitStack() as stack:
        cases = _select_cases(_all_cases(url, stack, notes), arguments.only)
        if cases:
            progress(f"counting round trips for {len(cases)} cases")
            port = url.port or 5432
            trips = {
                case.name: count_round_trips(
                    case, arguments.round_trip_ops, lambda: server_sockets(port)
                )
                for case in cases
            }
            progress(f"timing {len(cases)} cases, {arguments.rounds} rounds")
            pinning = Pinning(url) if not arguments.no_pin else None
            try:
                samples = interleave(
                    cases,
                    rounds=arguments.rounds,
                    iterations=arguments.iterations,
                    warmup=arguments.warmup,
                    block=arguments.block,
                    pin=pinning.pin if pinning is not None else lambda: None,
                    progress=progress,
                )
            finally:
                if pinning is not None:
                    pinning.unpin()
            notes.append(
                "uncontended: "
                + (pinning.describe() if pinning is not None else "not pinned (--no-pin)")
            )
            uncontended = uncontended_results(samples, FLOOR, trips)
    variants = [
        (name, kind)
        for index, (name, kind) in enumerate(HANDOFF_VARIANTS)
        if index == 0 or _runs(arguments.only, "handoff", name)
    ]
    if len(variants) > 1 or _runs(arguments.only, "handoff", variants[0][0]):
        progress(f"handoff: {len(variants)} variants, waiters in their own processes")
        with ExitStack() as stack:
            latencies, pinned = run_handoffs(
                variants,
                url,
                stack,
                rounds=arguments.rounds,
                trials=arguments.handoff_trials,
                slow_trials=arguments.polling_trials,
                pin=not arguments.no_pin,
                progress=progress,
            )
        notes.append(f"handoff: {pinned}")
        handoff = handoff_results(
            latencies, handoff_descriptions(), variants[0][0], arguments.rounds
        )
    if _runs(arguments.only, "throughput", "throughput"):
        progress(f"throughput: {arguments.workers} worker processes")
        throughput = run_throughput(
            url,
            workers=arguments.workers,
            seconds=arguments.throughput_seconds,
            rounds=arguments.throughput_rounds,
            slots=arguments.throughput_slots,
            pin=not arguments.no_pin,
            progress=progress,
        )
        notes.append(
            "throughput: "
            + (
                "not pinned (--no-pin)"
                if arguments.no_pin
                else "each worker and its backends pinned to one CPU (worker i to CPU i mod "
                f"{os.cpu_count() or 1})"
            )
        )
    if _runs(arguments.only, "scale", "scale"):
        try:
            scale = run_scale(progress)
        except PrivateServerUnavailable as error:
            notes.append(f"scale not measured: {error}")

    report = Report(
        environment=_environment(url),
        settings={
            "rounds": arguments.rounds,
            "iterations": arguments.iterations,
            "warmup": arguments.warmup,
            "block": arguments.block,
            "handoff_trials": arguments.handoff_trials,
            "polling_trials": arguments.polling_trials,
            "workers": arguments.workers,
            "throughput_seconds": arguments.throughput_seconds,
            "throughput_slots": arguments.throughput_slots,
            "throughput_rounds": arguments.throughput_rounds,
        },
        floor=FLOOR,
        uncontended=uncontended,
        handoff=handoff,
        throughput=throughput,
        scale=scale,
        notes=notes,
    )
    write_table(report, sys.stdout)
    if targets := render_targets(report):
        print("\nTargets (rounds on target: rounds whose ratio met it)")
        print("\n".join(targets))
    if handoff or throughput:
        title = ", ".join(f"{key} {value}" for key, value in report.environment.items())
        write_chart(handoff, throughput, arguments.chart, title)
        print(f"\nChart written to {arguments.chart}")
    if arguments.docs is not None:
        write_docs_page(report, arguments.docs, _shown(argv if argv is not None else sys.argv[1:]))
        print(f"{arguments.docs} regenerated")
    if arguments.json is not None:
        write_json(report, arguments.json)
        print(f"JSON written to {arguments.json}")
    return 0


def _all_cases(url: sqlalchemy.engine.URL, stack: ExitStack, notes: list[str]) -> list[Case]:
    cases = uncontended_cases(url, stack)
    for build in (raw_driver_cases, django_cases, pals_cases):
        try:
            cases += build(url, stack)
        except ImportError as error:
            # Peers are benchmark-only dependencies: say which one is missing.
            notes.append(f"{build.__name__} not measured: {error} (pip install -e '.[benchmark]')")
    return cases


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=(
            "Measure advisory-locks against the raw psycopg floor in one interleaved run. "
            f"Server: ${URL_VARIABLE}, else the local default."
        ),
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument(
        "--iterations", type=int, default=500, help="operations per case per round (default 500)"
    )
    parser.add_argument("--warmup", type=int, default=50, help="untimed operations per case first")
    parser.add_argument(
        "--block",
        type=int,
        default=25,
        help="operations a case runs before the next case's turn (default 25): a case and "
        "its twin alternate this often",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help=(
            "do not pin this process and its PostgreSQL backends to one CPU while timing, "
            "nor the handoff's holders and waiters to a CPU each, nor each throughput "
            "worker and its backends to a CPU"
        ),
    )
    parser.add_argument(
        "--docs",
        nargs="?",
        type=Path,
        const=DOCS_PAGE,
        help=f"regenerate the figures in the docs page from this run (default {DOCS_PAGE})",
    )
    parser.add_argument(
        "--handoff-trials",
        type=int,
        default=2000,
        help="handoffs per server-side variant (default 2000)",
    )
    parser.add_argument(
        "--polling-trials", type=int, default=30, help="handoffs for the client-polling reference"
    )
    parser.add_argument(
        "--round-trip-ops", type=int, default=100, help="operations per round-trip count"
    )
    parser.add_argument(
        "--workers", type=int, default=4, help="throughput worker processes (default 4)"
    )
    parser.add_argument(
        "--throughput-seconds",
        type=float,
        default=0.5,
        help="seconds of a case, and as many of the raw reference, per round (default 0.5)",
    )
    parser.add_argument(
        "--throughput-slots",
        type=int,
        default=10,
        help="turns a case and the reference take within a round, each (default 10)",
    )
    parser.add_argument(
        "--throughput-rounds", type=int, default=9, help="throughput rounds (default 9)"
    )
    parser.add_argument(
        "--chart",
        type=Path,
        default=DEFAULT_CHART,
        help=f"where the handoff and throughput PNG goes (default {DEFAULT_CHART})",
    )
    parser.add_argument("--json", type=Path, help="also write the full report as JSON here")
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only this group (uncontended, handoff, throughput, scale) or cases "
        "matching this glob (e.g. 'ours.engine*', 'floor.*'); repeatable. The references "
        "a ratio needs (the raw floor, twins, bind floors) always run.",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def _shown(argv: list[str]) -> list[str]:
    """The arguments that change what is measured (not where the output goes)."""
    shown, skip = [], False
    for position, argument in enumerate(argv):
        if skip:
            skip = False
        elif argument in ("--json", "--chart"):
            skip = True
        elif argument == "--docs":
            # --docs takes an optional path: the next argument, unless it is an option.
            following = argv[position + 1 : position + 2]
            skip = bool(following) and not following[0].startswith("-")
        elif not argument.startswith(("--json=", "--chart=", "--docs", "--quiet")):
            shown.append(argument)
    return shown


def _runs(patterns: list[str] | None, group: str, name: str) -> bool:
    """Whether ``--only`` selects this case (by its group, or by a glob on its name)."""
    if not patterns:
        return True
    return any(
        pattern == group or (pattern not in GROUPS and fnmatch.fnmatchcase(name, pattern))
        for pattern in patterns
    )


def _select_cases(cases: list[Case], patterns: list[str] | None) -> list[Case]:
    chosen = {case.name for case in cases if _runs(patterns, "uncontended", case.name)}
    if not chosen:
        return []
    # Ratios need the floor, and each chosen case's bind floor and raw twin.
    chosen = with_references(cases, chosen | {FLOOR, "raw.select1"})
    return [case for case in cases if case.name in chosen]


def _environment(url: sqlalchemy.engine.URL) -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "sqlalchemy": sqlalchemy.__version__,
        "postgresql": server_version(url),
        "host": url.host or "local socket",
        "platform": platform.platform(terse=True),
        "cpus": str(os.cpu_count()),
        "cpu model": _cpu_model(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
