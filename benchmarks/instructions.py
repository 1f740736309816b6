"""Client CPU instructions per uncontended operation, counted by valgrind's callgrind.

``python -m benchmarks.instructions [--only PATTERN ...] [--ops N] [--json PATH]``

What it measures: the instructions the client process's own thread executes for one
operation of an uncontended case (the ``Case`` objects ``benchmarks.run`` times: the raw
twin, the bind floors, ours on every bind), inside the same stopwatch bracket that
``benchmarks.run`` reads its CPU time over. Ratios against the twin and the case's bind
floor follow, as in ``benchmarks.run``'s ``cpu x twin`` and ``cpu x bd`` columns.

Why: timing on a shared 2-core VM is noisy (another process, a cross-CPU wakeup, the
hypervisor), so a 5 % change in the library's CPU can hide in the spread of CPU times. An
instruction count does not depend on how busy the machine is: a child run again usually
counts the same instructions to the last one, so the figures show what the library's own
Python adds over the raw driver making the same calls. Now and then a whole child counts a
fixed amount more per operation (seen: 0.7 % of the twin's; a state the process is in from
its start, cause not pinned down), which the difference of two children can double: compare
figures from one run, and run again before trusting a change of 1-2 %. It is not time: an
instruction that misses the cache costs more than one that hits, and the count leaves out
what the kernel does in the syscalls the client makes (sending, polling, receiving). The
twin and our cases make the same syscalls for the same round trips, so that part is the
same on both sides and leaving it out only makes the ratios stricter. Hardware counters
(perf) would also count the kernel but are not available on this VM.

How: for each case a child process of this module runs under
``valgrind --tool=callgrind --collect-atstart=no``. It builds only the cases of that
case's builder (``uncontended.raw_cases``, ``library_cases``, ``raw_drivers``'
``psycopg_cases`` / ``asyncpg_cases``, ``django_cases``, ``pals_cases``), warms the case
up, then runs it ``N`` times; a second child runs it ``2N`` times. Each operation's
stopwatch is a valgrind client request that switches callgrind's counting on at
``start()`` and off at ``stop()`` (for the calling thread only: as ``benchmarks.run``
reads this thread's CPU time), so neither process start-up nor the warm-up nor any work a
case keeps outside its stopwatch (opening the caller's transaction, entering the asyncio
loop) is counted; callgrind prints the total (``Collected : I``) at exit. Per operation:
``(I_2N - I_N) / N``, which cancels anything counted once per process, minus the cost of
the bracket itself (two children that run an empty ``start(); stop()`` the same way).
Children run with ``PYTHONHASHSEED=0`` (a dict's layout changes how many probes a lookup
takes) and two at a time, never two of one builder at once: a builder picks its keys to
be distinct within one process, not across two.

The client request is the x86-64 machine code ``valgrind.h`` compiles
``CALLGRIND_TOGGLE_COLLECT`` to (28 bytes in an executable page, called through ctypes):
on a real CPU it does nothing, and it is why this module needs x86-64 Linux.
"""

from __future__ import annotations

import argparse
import ctypes
import fnmatch
import json
import mmap
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, cast

import psycopg
import sqlalchemy
from sqlalchemy.engine import URL

from benchmarks.django_cases import django_cases, pals_cases
from benchmarks.measure import Case, Stopwatch, with_references
from benchmarks.postgres import URL_VARIABLE, database_url, server_version
from benchmarks.raw_drivers import asyncpg_cases, psycopg_cases
from benchmarks.report import ratio_text
from benchmarks.uncontended import library_cases, raw_cases

__all__ = ["InstructionResult", "main"]

ROOT = Path(__file__).resolve().parent.parent
VALGRIND = shutil.which("valgrind") or "/usr/bin/valgrind"
# The acquire(timeout) + release of every bind; each brings its twin and bind floor along.
DEFAULT_ONLY = ("ours.*.timeout",)
# The pseudo-builder of the children that count the bracket alone.
BRACKET = "bracket"
COLLECTED = re.compile(rb"==\d+== Collected : (\d+)")


# The functions that build the cases, by name: a child builds only its case's.
BUILDERS: dict[str, Callable[[URL, ExitStack], list[Case]]] = {
    "raw": raw_cases,
    "sqlalchemy": library_cases,
    "psycopg": psycopg_cases,
    "asyncpg": asyncpg_cases,
    "django": django_cases,
    "pals": pals_cases,
}


# --- the child: one case under callgrind -------------------------------------------------

# Valgrind's client request on x86-64, as valgrind.h's VALGRIND_DO_CLIENT_REQUEST_EXPR
# compiles it, as a function of one argument (the request block's address, in rdi):
# the block's address goes to rax and the result a native CPU leaves (0) to rdx; four
# rotations of rdi by 3, 13, 61 and 51 bits (128 in all: rdi is unchanged) are the
# preamble valgrind looks for, and the `xchg rbx, rbx` after it says "client request";
# valgrind puts its answer in rdx, which is returned.
_CLIENT_REQUEST_CODE = bytes.fromhex(
    "4889f8"  # mov rax, rdi
    "31d2"  # xor edx, edx
    "48c1c703"  # rol rdi, 3
    "48c1c70d"  # rol rdi, 13
    "48c1c73d"  # rol rdi, 61
    "48c1c733"  # rol rdi, 51
    "4887db"  # xchg rbx, rbx
    "4889d0"  # mov rax, rdx
    "c3"  # ret
)
# callgrind.h: VG_USERREQ__TOGGLE_COLLECT = VG_USERREQ_TOOL_BASE('C', 'T') + 2.
_TOGGLE_COLLECT = (ord("C") << 24 | ord("T") << 16) + 2


class Bracket:
    """A stopwatch that has callgrind count this thread's instructions from start to stop.

    Counting starts off (``--collect-atstart=no``); each ``start()``/``stop()`` pair
    switches it on and off again. ``counting = False`` (the warm-up) makes both no-ops.
    """

    def __init__(self) -> None:
        self._page = mmap.mmap(
            -1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC
        )
        self._page.write(_CLIENT_REQUEST_CODE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._page))
        function = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p)(address)
        self._request = cast("Callable[[int], int]", function)
        self._block = (ctypes.c_uint64 * 6)(_TOGGLE_COLLECT, 0, 0, 0, 0, 0)
        self._block_address = ctypes.addressof(self._block)
        self.counting = False
        self.started = self.stopped = 0

    def start(self) -> None:
        if self.counting:
            self.started += 1
            self._request(self._block_address)

    def stop(self) -> None:
        if self.counting:
            self._request(self._block_address)
            self.stopped += 1


def _empty(watch: Stopwatch) -> None:
    watch.start()
    watch.stop()


def _child(builder: str, name: str, ops: int, warmup: int) -> int:
    bracket = Bracket()
    with ExitStack() as stack:
        if builder == BRACKET:
            case = Case(BRACKET, "reference", "start(); stop()", _empty)
        else:
            cases = BUILDERS[builder](database_url(), stack)
            case = next(case for case in cases if case.name == name)
        operation = case.operation
        case.before_round()
        for _ in range(warmup):
            operation(bracket)
        case.after_round()
        case.before_round()
        bracket.counting = True
        for _ in range(ops):
            operation(bracket)
        bracket.counting = False
        case.after_round()
    if bracket.started != ops or bracket.stopped != ops:
        print(
            f"{name}: {bracket.started} start() and {bracket.stopped} stop() for {ops} "
            "operations; a case must bracket each operation once",
            file=sys.stderr,
        )
        return 1
    return 0


# --- the parent: choose cases, run children, report --------------------------------------


@dataclass
class CaseInfo:
    name: str
    builder: str
    description: str
    twin: str | None
    bind_floor: str | None


@dataclass
class InstructionResult:
    name: str
    description: str
    instructions_per_op: float
    twin: str | None = None
    ratio_to_twin: float | None = None
    bind_floor: str | None = None
    ratio_to_bind_floor: float | None = None
    # (operations, instructions callgrind collected) of each child, bracket not subtracted.
    runs: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class Job:
    builder: str
    name: str
    ops: int


def _catalogue(url: URL, notes: list[str]) -> list[CaseInfo]:
    """Every uncontended case, built once in this process (not under valgrind)."""
    found = []
    with ExitStack() as stack:
        for builder, build in BUILDERS.items():
            try:
                cases = build(url, stack)
            except ImportError as error:
                notes.append(f"{builder} cases not measured: {error}")
                continue
            found += [
                CaseInfo(case.name, builder, case.description, case.twin, case.bind_floor)
                for case in cases
            ]
    return found


def _select(catalogue: list[CaseInfo], patterns: list[str]) -> list[CaseInfo]:
    """The cases matching a pattern (as ``benchmarks.run --only``), with their references."""
    chosen = {
        case.name
        for case in catalogue
        if any(
            pattern == "uncontended" or fnmatch.fnmatchcase(case.name, pattern)
            for pattern in patterns
        )
    }
    chosen = with_references(catalogue, chosen)
    return [case for case in catalogue if case.name in chosen]


def _child_command(job: Job, arguments: argparse.Namespace) -> list[str]:
    return [
        arguments.valgrind,
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        "--collect-atstart=no",
        sys.executable,
        "-m",
        "benchmarks.instructions",
        "--child",
        job.builder,
        job.name,
        "--ops",
        str(job.ops),
        "--warmup",
        str(arguments.warmup),
    ]


def _child_environment() -> dict[str, str]:
    environment = dict(os.environ, PYTHONHASHSEED="0")
    # This checkout's benchmarks and library, whatever the virtualenv has installed.
    path = environment.get("PYTHONPATH")
    environment["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    return environment


@dataclass
class _Running:
    job: Job
    child: subprocess.Popen[bytes]
    output: IO[bytes]  # the child's stdout and stderr (valgrind's summary among them)
    started: float


def _run_jobs(
    jobs: list[Job],
    arguments: argparse.Namespace,
    progress: Callable[[str], None],
) -> dict[Job, int]:
    """Run every job, ``--parallel`` at a time but one per builder; instructions by job."""
    pending = list(jobs)
    running: list[_Running] = []
    collected: dict[Job, int] = {}
    environment = _child_environment()
    with ExitStack() as stack:
        stack.callback(_kill, running)
        while pending or running:
            busy = {entry.job.builder for entry in running}
            for job in list(pending):
                if len(running) >= arguments.parallel:
                    break
                if job.builder in busy and job.builder != BRACKET:
                    continue
                pending.remove(job)
                busy.add(job.builder)
                output = stack.enter_context(tempfile.TemporaryFile())
                child = subprocess.Popen(
                    _child_command(job, arguments),
                    cwd=ROOT,
                    env=environment,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=output,
                )
                running.append(_Running(job, child, output, time.monotonic()))
            time.sleep(0.2)
            for entry in [entry for entry in running if entry.child.poll() is not None]:
                running.remove(entry)
                entry.output.seek(0)
                text = entry.output.read()
                entry.output.close()
                match = COLLECTED.search(text)
                job = entry.job
                if entry.child.returncode != 0 or match is None:
                    raise RuntimeError(
                        f"{job.name} x{job.ops} failed (exit {entry.child.returncode}):\n"
                        + text.decode(errors="replace")[-3000:]
                    )
                collected[job] = int(match.group(1))
                progress(
                    f"[{len(collected)}/{len(jobs)}] {job.name} x{job.ops}: "
                    f"{collected[job]:,} instructions ({time.monotonic() - entry.started:.0f} s)"
                )
    return collected


def _kill(running: list[_Running]) -> None:
    """Stop the children still running when the parent gives up (an error, ^C)."""
    for entry in running:
        entry.child.kill()
        entry.child.wait()


def _per_op(collected: dict[Job, int], builder: str, name: str, ops: int) -> float:
    once, twice = collected[Job(builder, name, ops)], collected[Job(builder, name, 2 * ops)]
    return (twice - once) / ops


def main(argv: list[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    if arguments.child:
        builder, name = arguments.child
        return _child(builder, name, arguments.ops, arguments.warmup)
    if platform.machine() != "x86_64" or not sys.platform.startswith("linux"):
        print("benchmarks.instructions needs valgrind on x86-64 Linux", file=sys.stderr)
        return 2

    def progress(message: str) -> None:
        if not arguments.quiet:
            print(f"... {message}", file=sys.stderr, flush=True)

    url = database_url()
    notes: list[str] = []
    cases = _select(_catalogue(url, notes), arguments.only or list(DEFAULT_ONLY))
    if not cases:
        print(f"no case matches {arguments.only}", file=sys.stderr)
        return 2
    ops = arguments.ops
    # The builder with the most cases first: its children run one at a time, so it
    # sets how long the whole run takes.
    per_builder = {case.builder: 0 for case in cases}
    for case in cases:
        per_builder[case.builder] += 1
    ordered = sorted(cases, key=lambda case: -per_builder[case.builder])
    jobs = [Job(BRACKET, BRACKET, ops), Job(BRACKET, BRACKET, 2 * ops)]
    jobs += [Job(case.builder, case.name, count) for count in (ops, 2 * ops) for case in ordered]
    progress(
        f"{len(cases)} cases, {len(jobs)} children under callgrind, {arguments.parallel} at a time"
    )
    collected = _run_jobs(jobs, arguments, progress)

    bracket = _per_op(collected, BRACKET, BRACKET, ops)
    figures = {
        case.name: _per_op(collected, case.builder, case.name, ops) - bracket for case in cases
    }
    results = []
    for case in cases:
        result = InstructionResult(
            case.name,
            case.description,
            figures[case.name],
            runs=[
                (count, collected[Job(case.builder, case.name, count)]) for count in (ops, 2 * ops)
            ],
        )
        if case.twin in figures:
            result.twin = case.twin
            result.ratio_to_twin = figures[case.name] / figures[case.twin]
        if case.bind_floor in figures:
            result.bind_floor = case.bind_floor
            result.ratio_to_bind_floor = figures[case.name] / figures[case.bind_floor]
        results.append(result)
    notes.append(
        f"each figure is (I[{2 * ops} ops] - I[{ops} ops]) / {ops} minus the bracket's own "
        f"{bracket:,.0f} instructions per operation"
    )
    environment = _environment(url, arguments.valgrind)
    settings = {
        "ops": ops,
        "warmup": arguments.warmup,
        "only": arguments.only or list(DEFAULT_ONLY),
    }
    _write_table(results, environment, settings, notes, sys.stdout)
    if arguments.json is not None:
        report = {
            "environment": environment,
            "settings": settings,
            "bracket_instructions_per_op": bracket,
            "cases": [asdict(result) for result in results],
            "notes": notes,
        }
        arguments.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"JSON written to {arguments.json}")
    return 0


def _write_table(
    results: list[InstructionResult],
    environment: dict[str, str],
    settings: dict[str, object],
    notes: list[str],
    stream: IO[str],
) -> None:
    print("# " + ", ".join(f"{key} {value}" for key, value in environment.items()), file=stream)
    print("# " + ", ".join(f"{key}={value}" for key, value in settings.items()), file=stream)
    print(file=stream)
    print("Client instructions per uncontended operation (callgrind, this thread)", file=stream)
    header = f"{'case':38} {'k instr':>9} {'x twin':>7} {'x bind':>7}  twin / bind floor"
    print(header, file=stream)
    print("-" * len(header), file=stream)
    for result in results:
        pairs = " / ".join(name for name in (result.twin, result.bind_floor) if name)
        line = (
            f"{result.name:38} {result.instructions_per_op / 1000:9.1f} "
            f"{ratio_text(result.ratio_to_twin):>7} "
            f"{ratio_text(result.ratio_to_bind_floor):>7}  {pairs}"
        )
        print(line.rstrip(), file=stream)
    for note in notes:
        print(f"note: {note}", file=stream)


def _environment(url: URL, valgrind: str) -> dict[str, str]:
    version = subprocess.run(
        [valgrind, "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return {
        "python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "sqlalchemy": sqlalchemy.__version__,
        "postgresql": server_version(url),
        "valgrind": version.removeprefix("valgrind-"),
        "platform": platform.platform(terse=True),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.instructions",
        description=(
            "Count the client's instructions per uncontended operation with callgrind, "
            f"against the raw twin and the bind floor. Server: ${URL_VARIABLE}, else the "
            "local default."
        ),
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="PATTERN",
        help="cases matching this glob (e.g. 'ours.engine*', 'floor.*'), or 'uncontended' "
        f"for all; repeatable (default {' '.join(DEFAULT_ONLY)}). A case's twin and bind "
        "floor always come along.",
    )
    parser.add_argument(
        "--ops",
        type=int,
        default=300,
        help="operations in the first child of a case; the second runs twice as many (default 300)",
    )
    parser.add_argument(
        "--warmup", type=int, default=50, help="uncounted operations first, in every child"
    )
    parser.add_argument(
        "--parallel", type=int, default=2, help="children running at once (default 2)"
    )
    parser.add_argument("--valgrind", default=VALGRIND, help=f"valgrind (default {VALGRIND})")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--child", nargs=2, metavar=("BUILDER", "CASE"), help=argparse.SUPPRESS)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
