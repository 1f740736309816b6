"""The library's own Python per acquire(timeout) + release, with the driver stubbed.

``python -m benchmarks.python_path [--profile CASE]``: every case first runs for real
(so each connection's one-time server check is done), then the executors that send the
lock statements are replaced by a stub that answers at once ("granted", "released"),
and what is left is timed in this thread's CPU time: building the lock, its rules, the
binding's borrow and give-back, the pool where there is one. That is the part
of ``cpu x twin`` the library can cut; the driver's own work is the twin's too.
``--profile CASE`` adds a cProfile of the stubbed path (CPU clock) for one case;
``--bytecodes CASE`` counts, with ``sys.settrace``, the bytecodes and calls of the
library's own functions per operation on that stubbed path, biggest first (a count, so
the same on every machine for the same Python and packages). ``--handoff-path CASE``
counts, the same way, the part of those bytecodes that lies on a handoff's critical
path: the waiter's from its lock statement's answer to ``acquire()`` returning, and the
holder's from calling ``release()`` to sending the unlock statement.

Not a test and not part of ``benchmarks.run``: it patches private executor classes.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from types import FrameType
from typing import Any, NamedTuple

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from advisory_locks import advisory_lock
from advisory_locks._bindings import _raw
from advisory_locks._bindings.psycopg import PsycopgLockExecutor
from advisory_locks._core import executors
from advisory_locks._core.steps import VALUE, Statement
from benchmarks.clients import setup_django
from benchmarks.postgres import database_url, raw_connection

TIMEOUT_SECONDS = 5
# The library's own source, whose bytecodes --bytecodes and --handoff-path count.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY = (
    os.path.join(_PACKAGE, "advisory_locks"),
    os.path.join(_PACKAGE, "advisory_locks_django"),
)


def _stub(self: object, statement: Statement) -> object:
    return True if statement.kind == VALUE else None


class _Case(NamedTuple):
    operation: Callable[[], None]  # acquire(timeout) + release, with ``with``
    make_lock: Callable[[], Any]  # the lock that operation takes, not yet taken


def _cases(stack: ExitStack) -> dict[str, _Case]:
    url = database_url()
    engine = create_engine(url)
    stack.callback(engine.dispose)
    connection = engine.connect()
    stack.callback(connection.close)
    session = Session(engine)
    stack.callback(session.close)
    raw = raw_connection(url, stack)

    def case(bind: Any, name: str) -> _Case:
        def operation() -> None:
            with advisory_lock(bind, name, timeout=TIMEOUT_SECONDS):
                pass

        return _Case(operation, lambda: advisory_lock(bind, name, timeout=TIMEOUT_SECONDS))

    setup_django(url)
    from django.db import connection as django_connection

    from advisory_locks_django import advisory_lock as django_lock

    django_connection.ensure_connection()

    def django_case() -> None:
        with django_lock("bench.python_path.django", timeout=TIMEOUT_SECONDS):
            pass

    return {
        "psycopg": case(raw, "bench.python_path.psycopg"),
        "connection": case(connection, "bench.python_path.connection"),
        "engine": case(engine, "bench.python_path.engine"),
        "session": case(session, "bench.python_path.session"),
        "django": _Case(
            django_case,
            lambda: django_lock("bench.python_path.django", timeout=TIMEOUT_SECONDS),
        ),
    }


# The executors that send lock statements: replaced by _stub while the cases are timed
# (Django's is a DBAPIExecutor that only translates errors, so the first covers it).
def _executors() -> list[type]:
    return [executors.DBAPIExecutor, _raw.RaisingExecutor, PsycopgLockExecutor]


def _count_bytecodes(operation: Callable[[], None], ops: int) -> None:
    """Print the library's bytecodes and calls per operation, per function."""
    opcodes: collections.Counter[tuple[str, int, str]] = collections.Counter()
    calls: collections.Counter[tuple[str, int, str]] = collections.Counter()

    def trace(frame: FrameType, event: str, argument: object) -> Any:
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(_LIBRARY):
            return None
        where = (os.path.relpath(code.co_filename, _PACKAGE), code.co_firstlineno, code.co_name)
        calls[where] += 1
        frame.f_trace_opcodes = True

        def local(frame: FrameType, event: str, argument: object) -> Any:
            if event == "opcode":
                opcodes[where] += 1
            return local

        return local

    gc.collect()
    gc.freeze()  # no full collection over the warmed-up heap in the middle of the count
    sys.settrace(trace)
    try:
        for _ in range(ops):
            operation()
    finally:
        sys.settrace(None)
        gc.unfreeze()
    print(
        f"library: {sum(opcodes.values()) / ops:.0f} bytecodes, "
        f"{sum(calls.values()) / ops:.0f} calls per acquire + release"
    )
    for where, count in opcodes.most_common():
        path, line, function = where
        print(f"{count / ops:8.1f} {calls[where] / ops:5.1f}  {path}:{line} {function}")


def _count_handoff_path(make_lock: Callable[[], Any], ops: int) -> None:
    """Print the library's bytecodes on a handoff's critical path, per operation: from the
    stubbed lock statement's answer to ``acquire()`` returning (what a waiter runs after
    its grant), and from calling ``release()`` to the unlock statement (what the holder
    runs before the waiter can be granted)."""
    phase: list[str | None] = [None]
    opcodes: collections.Counter[str] = collections.Counter()

    def stub(self: object, statement: Statement) -> object:
        if "unlock" in statement.sql:
            phase[0] = None  # the holder's part ends as the unlock is sent
            return True
        phase[0] = "waiter"  # the waiter's part starts with the lock statement's answer
        return True if statement.kind == VALUE else None

    def trace(frame: FrameType, event: str, argument: object) -> Any:
        if event != "call" or not frame.f_code.co_filename.startswith(_LIBRARY):
            return None
        frame.f_trace_opcodes = True

        def local(frame: FrameType, event: str, argument: object) -> Any:
            if event == "opcode" and phase[0] is not None:
                opcodes[phase[0]] += 1
            return local

        return local

    for executor in _executors():
        setattr(executor, "execute", stub)  # noqa: B010 - a method replaced for counting
    gc.collect()
    gc.freeze()
    try:
        for _ in range(ops):
            lock = make_lock()
            sys.settrace(trace)
            lock.acquire()
            phase[0] = "holder"
            lock.release()
            sys.settrace(None)
            phase[0] = None
    finally:
        sys.settrace(None)
        gc.unfreeze()
    print(
        f"handoff path: the waiter's {opcodes['waiter'] / ops:.0f} bytecodes after its "
        f"grant, the holder's {opcodes['holder'] / ops:.0f} before its unlock"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.python_path")
    parser.add_argument("--blocks", type=int, default=40, help="blocks of 100 operations")
    parser.add_argument("--profile", metavar="CASE", help="also profile this case")
    parser.add_argument(
        "--bytecodes", metavar="CASE", help="also count the library's bytecodes for this case"
    )
    parser.add_argument(
        "--handoff-path",
        metavar="CASE",
        help="also count the library's bytecodes on a handoff's critical path for this case",
    )
    arguments = parser.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {(os.cpu_count() or 1) - 1})
    with ExitStack() as stack:
        cases = _cases(stack)
        for operation, _ in cases.values():
            for _ in range(50):
                operation()  # for real: pools filled, servers checked
        real = {executor: executor.__dict__["execute"] for executor in _executors()}
        for executor in real:
            setattr(executor, "execute", _stub)  # noqa: B010 - a method replaced for timing
        try:
            for name, (operation, _) in cases.items():
                for _ in range(300):
                    operation()
                blocks = []
                for _ in range(arguments.blocks):
                    started = time.thread_time_ns()
                    for _ in range(100):
                        operation()
                    blocks.append((time.thread_time_ns() - started) / 100_000)
                print(f"{name:12} {statistics.median(blocks):6.1f} us per acquire + release")
            if arguments.bytecodes:
                _count_bytecodes(cases[arguments.bytecodes].operation, 500)
            if arguments.handoff_path:
                _count_handoff_path(cases[arguments.handoff_path].make_lock, 500)
            if arguments.profile:
                operation = cases[arguments.profile].operation
                profile = cProfile.Profile(time.thread_time)
                profile.enable()
                for _ in range(5000):
                    operation()
                profile.disable()
                pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats(40)
        finally:
            for executor, execute in real.items():
                setattr(executor, "execute", execute)  # noqa: B010
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
