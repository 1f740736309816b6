"""Every package's bytecodes per acquire(timeout) + release, on real connections.

``python -m benchmarks.bytecodes CLIENT [CLIENT ...]`` takes the clients of the
benchmarks (``benchmarks.clients``: ``raw.timeout``, ``ours.connection.timeout``,
``floor.connection.contract``, ...), runs each against the server, and counts with
``sys.settrace`` the bytecodes it runs per operation: in all, by package (the library,
the benchmark's own code, psycopg, SQLAlchemy, Django), and by function, biggest first.
It also counts the part that lies on a handoff's critical path: the waiter's, from the
lock statement's ``execute()`` returning to ``acquire()`` returning (the driver's fetch
of the answer included), and the holder's, from the release call to the unlock's
``execute()``. Where ``python -m benchmarks.python_path --bytecodes`` stubs the driver
and counts the library alone, this compares a library case with its floors and its twin
on the same path, whatever package the work is in. A count, not a time: the same on
every machine for the same Python and packages.

The asyncio clients (``ours.asyncpg.timeout``, its twin ``raw.asyncpg.timeout``,
``floor.asyncpg.contract``, and the same on a pool) are counted as
``benchmarks.raw_drivers`` times them: from the start of the operation's coroutine to its
end, the event loop's work while it awaits included. Their handoff path is not split.

Not a test and not part of ``benchmarks.run``: it wraps psycopg's ``Cursor.execute`` and
``Connection.wait``, the library's ``LibpqStatements.value`` and the floors'
``Statements.run``.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg

from advisory_locks._core.libpq import LibpqStatements
from advisory_locks._core.steps import Statement
from benchmarks.clients import CLIENTS, make_client
from benchmarks.floors import Statements
from benchmarks.postgres import database_url

__all__ = ["main"]

_HERE = str(Path(__file__).resolve())
_ROOT = str(Path(__file__).resolve().parent.parent)


def _relative(filename: str) -> str | None:
    """A code object's file within site-packages or this repository (None: neither)."""
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1]
    if filename.startswith(_ROOT):
        return filename[len(_ROOT) + 1 :]
    return None


def _package(filename: str) -> str:
    """Which package a code object's file belongs to."""
    if filename.startswith("<"):
        return "library"  # dataclass-generated methods (the library's Holding)
    relative = _relative(filename)
    if relative is None:
        return "stdlib"
    return relative.split("/", 1)[0].replace("advisory_locks", "library")


def _where(frame: FrameType) -> str:
    code = frame.f_code
    relative = _relative(code.co_filename)
    return f"{relative or code.co_filename}:{code.co_firstlineno} {code.co_name}"


def count(kind: str, ops: int, top: int) -> None:
    phase: list[str | None] = [None]
    whole: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    path: collections.Counter[str] = collections.Counter()
    package_of: dict[str, str] = {}
    real_execute = psycopg.Cursor.execute
    real_value = LibpqStatements.value
    real_run = Statements.run
    real_wait = psycopg.Connection.wait
    # Whether the statement the library (or a floor) sends through libpq is an unlock
    # (None: none is in flight).
    in_flight: list[bool | None] = [None]
    asynchronous = False

    def execute(self: Any, query: Any, params: Any = None, **options: Any) -> Any:
        unlock = "unlock" in (query if isinstance(query, str) else repr(query))
        if unlock and phase[0] == "holder":
            phase[0] = None  # the holder's part ends as the unlock is sent
        result = real_execute(self, query, params, **options)
        if not unlock and phase[0] == "armed":
            phase[0] = "waiter"  # the waiter's part starts with the answer
        return result

    def value(self: LibpqStatements, statement: Statement, outside: bool = False) -> object:
        in_flight[0] = "unlock" in statement.sql
        try:
            return real_value(self, statement, outside)
        finally:
            in_flight[0] = None

    def run(self: Statements, sql: str, params: tuple[object, ...]) -> bytes | None:
        in_flight[0] = "unlock" in sql
        try:
            return real_run(self, sql, params)
        finally:
            in_flight[0] = None

    def wait(self: Any, gen: Any, *args: Any, **kwargs: Any) -> Any:
        # A statement sent through libpq is sent as wait() starts its round trip (after
        # the few bytecodes its generator runs first), and answered as wait() returns.
        unlock = in_flight[0]
        if unlock and phase[0] == "holder":
            phase[0] = None
        result = real_wait(self, gen, *args, **kwargs)
        if unlock is False and phase[0] == "armed":
            phase[0] = "waiter"
        return result

    def trace(frame: FrameType, event: str, argument: object) -> Any:
        if frame.f_code.co_filename == _HERE:
            return None
        where = _where(frame)
        if where not in package_of:
            package_of[where] = _package(frame.f_code.co_filename)
        calls[where] += 1
        frame.f_trace_opcodes = True

        def local(frame: FrameType, event: str, argument: object) -> Any:
            if event == "opcode":
                whole[where] += 1
                if phase[0] in ("waiter", "holder"):
                    path[phase[0]] += 1
            return local

        return local

    psycopg.Cursor.execute = execute  # type: ignore[method-assign]
    LibpqStatements.value = value  # type: ignore[method-assign]
    Statements.run = run  # type: ignore[method-assign]
    psycopg.Connection.wait = wait  # type: ignore[method-assign]
    try:
        with ExitStack() as stack:
            client = make_client(kind, f"bench.bytecodes.{kind}", database_url(), stack)
            for _ in range(20):  # connections opened, statements prepared
                client.take()()
            if client.operation is not None and client.loop is not None:
                asynchronous = True
                for _ in range(ops):
                    client.loop.run_until_complete(_traced(client.operation, trace))
            else:
                for _ in range(ops):
                    phase[0] = "armed"
                    sys.settrace(trace)
                    release = client.take()
                    phase[0] = "holder"
                    release()
                    sys.settrace(None)
                    phase[0] = None
    finally:
        sys.settrace(None)
        psycopg.Cursor.execute = real_execute  # type: ignore[method-assign]
        LibpqStatements.value = real_value  # type: ignore[method-assign]
        Statements.run = real_run  # type: ignore[method-assign]
        psycopg.Connection.wait = real_wait  # type: ignore[method-assign]
    packages: collections.Counter[str] = collections.Counter()
    for where, number in whole.items():
        packages[package_of[where]] += number
    print(
        f"{kind}: {sum(whole.values()) / ops:.0f} bytecodes, {sum(calls.values()) / ops:.0f} "
        "Python calls per acquire + release"
    )
    print(
        "  by package: "
        + ", ".join(f"{name} {number / ops:.0f}" for name, number in packages.most_common())
    )
    if not asynchronous:
        print(
            f"  handoff path: the waiter's {path['waiter'] / ops:.0f} after its answer, the "
            f"holder's {path['holder'] / ops:.0f} before its unlock"
        )
    for where, number in whole.most_common(top):
        print(f"  {number / ops:7.1f} {calls[where] / ops:4.1f}  {where}")


async def _traced(operation: Callable[[], Awaitable[None]], trace: Any) -> None:
    sys.settrace(trace)
    try:
        await operation()
    finally:
        sys.settrace(None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bytecodes")
    parser.add_argument("clients", nargs="+", choices=sorted(CLIENTS), metavar="CLIENT")
    parser.add_argument("--ops", type=int, default=200, help="operations counted per client")
    parser.add_argument("--top", type=int, default=30, help="functions listed per client")
    arguments = parser.parse_args(argv)
    for kind in arguments.clients:
        count(kind, arguments.ops, arguments.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
