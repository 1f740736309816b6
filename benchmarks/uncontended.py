"""Uncontended acquire + release: the raw psycopg floor and the same through our API.

Every case takes a lock nobody else holds and gives it back, on its own connection and
key, so cases never wait on each other. Raw cases reuse one cursor: that is the fastest a
hand-written caller can go, so ratios against them are the strictest.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import psycopg
from psycopg.rows import TupleRow
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from advisory_locks.sqlalchemy import advisory_lock
from benchmarks.measure import Case, Stopwatch
from benchmarks.postgres import TrackedEngine, raw_connection

__all__ = ["FLOOR", "TIMEOUT_LOCK_SQL", "TWIN", "UNLOCK_SQL", "uncontended_cases"]

FLOOR = "raw.try_lock+unlock"
# The raw twin of every acquire(timeout) + release outside a transaction.
TWIN = "raw.timeout_lock+unlock"
# Keys for raw cases; far from anything the library's sha256 names produce by chance.
RAW_KEY_BASE = 7_246_000

TIMEOUT_SECONDS = 5
# The two statements our PostgreSQL backend sends for acquire(timeout) + release outside a
# transaction, word for word, so that the twin and the bind floors ask the server for
# exactly what the library does.
TIMEOUT_LOCK_SQL = (
    "SELECT pg_advisory_lock(%s) FROM (SELECT pg_catalog.set_config('lock_timeout', %s, true)) "
    "AS timeout"
)
UNLOCK_SQL = "SELECT pg_advisory_unlock(%s)"


def _timed(body: Callable[[], object]) -> Callable[[Stopwatch], None]:
    def operation(watch: Stopwatch) -> None:
        watch.start()
        body()
        watch.stop()

    return operation


def _socket_of(connection: psycopg.Connection[TupleRow]) -> Callable[[], list[int]]:
    return lambda: [connection.pgconn.socket]


def raw_cases(url: URL, stack: ExitStack) -> list[Case]:
    cases = []

    connection = raw_connection(url, stack)
    cursor = connection.cursor()

    def select_one() -> None:
        cursor.execute("SELECT 1")
        cursor.fetchone()

    cases.append(
        Case(
            "raw.select1",
            "reference",
            "one bare round trip (SELECT 1)",
            _timed(select_one),
            sockets=_socket_of(connection),
        )
    )

    def add(
        name: str,
        description: str,
        body: Callable[[psycopg.Cursor[TupleRow], int], None],
        *,
        autocommit: bool = True,
    ) -> None:
        connection = raw_connection(url, stack, autocommit=autocommit)
        cursor = connection.cursor()
        key = RAW_KEY_BASE + len(cases)
        cases.append(
            Case(
                name,
                "reference",
                description,
                _timed(lambda: body(cursor, key)),
                sockets=_socket_of(connection),
            )
        )

    def try_lock_unlock(cursor: psycopg.Cursor[TupleRow], key: int) -> None:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", (key,))
        cursor.fetchone()
        cursor.execute("SELECT pg_advisory_unlock(%s)", (key,))
        cursor.fetchone()

    def lock_unlock(cursor: psycopg.Cursor[TupleRow], key: int) -> None:
        cursor.execute("SELECT pg_advisory_lock(%s)", (key,))
        cursor.fetchone()
        cursor.execute("SELECT pg_advisory_unlock(%s)", (key,))
        cursor.fetchone()

    def timeout_lock_unlock(cursor: psycopg.Cursor[TupleRow], key: int) -> None:
        # One statement, one implicit transaction: set_config(..., true) is scoped to it,
        # and the statement is prepared after a few runs like the floor's.
        cursor.execute(TIMEOUT_LOCK_SQL, (key, str(TIMEOUT_SECONDS * 1000)))
        cursor.fetchone()
        cursor.execute(UNLOCK_SQL, (key,))
        cursor.fetchone()

    add(
        FLOOR,
        "pg_try_advisory_lock + pg_advisory_unlock: the floor (2 round trips)",
        try_lock_unlock,
    )
    add("raw.lock+unlock", "pg_advisory_lock (waits forever) + pg_advisory_unlock", lock_unlock)
    add(
        TWIN,
        f"pg_advisory_lock with lock_timeout={TIMEOUT_SECONDS} s set in the same statement "
        "+ pg_advisory_unlock",
        timeout_lock_unlock,
    )

    pooled = TrackedEngine(url, stack)
    pool_key = RAW_KEY_BASE + len(cases)

    def pooled_lock(watch: Stopwatch) -> None:
        # What any code that borrows a connection per operation pays: a pool checkout and
        # checkin around the floor's two statements (the driver stays in autocommit).
        watch.start()
        connection = pooled.engine.raw_connection()
        cursor = connection.cursor()
        cursor.execute("SELECT pg_try_advisory_lock(%s)", (pool_key,))
        cursor.fetchone()
        cursor.execute("SELECT pg_advisory_unlock(%s)", (pool_key,))
        cursor.fetchone()
        connection.close()
        watch.stop()

    first = pooled.engine.raw_connection()
    first.dbapi_connection.autocommit = True  # type: ignore[union-attr]  # stays so: cheapest
    first.close()
    cases.append(
        Case(
            "raw.pooled_try_lock+unlock",
            "reference",
            "the floor on a connection borrowed from a SQLAlchemy pool per operation",
            pooled_lock,
            sockets=pooled.sockets,
        )
    )

    transaction_connection = raw_connection(url, stack, autocommit=False)
    transaction_cursor = transaction_connection.cursor()
    key = RAW_KEY_BASE + len(cases)

    def transaction_lock(watch: Stopwatch) -> None:
        transaction_cursor.execute("SELECT 1")  # the caller's transaction is already open
        watch.start()
        transaction_cursor.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
        transaction_cursor.fetchone()
        watch.stop()
        transaction_connection.commit()

    cases.append(
        Case(
            "raw.xact_lock_in_transaction",
            "reference",
            "pg_advisory_xact_lock inside an open transaction (freed by its commit, untimed)",
            transaction_lock,
            sockets=_socket_of(transaction_connection),
        )
    )
    return cases


def library_cases(url: URL, stack: ExitStack) -> list[Case]:
    # Each bind's floor (benchmarks.floors, which builds on this module's statements) runs
    # right before the library case on that bind.
    from benchmarks import floors

    cases = []

    def engine_case(
        name: str, timeout: float | None, twin: str, bind_floor: str | None = None
    ) -> None:
        tracked = TrackedEngine(url, stack)
        engine = tracked.engine

        def body() -> None:
            with advisory_lock(engine, name, timeout=timeout):
                pass

        cases.append(
            Case(
                name,
                "sqlalchemy",
                f"advisory_lock(engine, timeout={timeout}): pool checkout + acquire + release "
                "+ checkin",
                _timed(body),
                twin=twin,
                bind_floor=bind_floor,
                sockets=tracked.sockets,
            )
        )

    engine_case("ours.engine", None, "raw.lock+unlock")
    engine_floor = floors.engine_floor(url, stack)
    cases.append(engine_floor)
    cases.append(floors.engine_contract_floor(url, stack))
    engine_case("ours.engine.timeout", TIMEOUT_SECONDS, TWIN, engine_floor.name)

    session_floor = floors.session_floor(url, stack)
    cases.append(session_floor)
    cases.append(floors.session_contract_floor(url, stack))

    tracked = TrackedEngine(url, stack)
    session = Session(tracked.engine)
    stack.callback(session.close)

    def session_lock() -> None:
        with advisory_lock(session, "ours.session.timeout", timeout=TIMEOUT_SECONDS):
            pass

    cases.append(
        Case(
            "ours.session.timeout",
            "sqlalchemy",
            "advisory_lock(session, timeout=5): the Session checks a lock connection out and "
            "returns it after its last lock",
            _timed(session_lock),
            twin=TWIN,
            bind_floor=session_floor.name,
            sockets=tracked.sockets,
        )
    )

    connection_floor = floors.connection_floor(url, stack)
    cases.append(connection_floor)
    cases.append(floors.connection_contract_floor(url, stack))
    tracked = TrackedEngine(url, stack)
    connection = tracked.engine.connect()
    stack.callback(connection.close)

    def connection_lock() -> None:
        with advisory_lock(connection, "ours.connection.timeout", timeout=TIMEOUT_SECONDS):
            pass

    cases.append(
        Case(
            "ours.connection.timeout",
            "sqlalchemy",
            "advisory_lock(connection, timeout=5) on a Connection outside a transaction",
            _timed(connection_lock),
            twin=TWIN,
            bind_floor=connection_floor.name,
            sockets=tracked.sockets,
        )
    )

    def transaction_case(name: str, timeout: float | None) -> None:
        tracked = TrackedEngine(url, stack)
        connection = tracked.engine.connect()
        stack.callback(connection.close)

        def transaction_lock(watch: Stopwatch) -> None:
            transaction = connection.begin()
            connection.exec_driver_sql("SELECT 1")  # the caller's transaction is open
            watch.start()
            with advisory_lock(connection, name, timeout=timeout, transaction=True):
                pass
            watch.stop()
            transaction.commit()

        cases.append(
            Case(
                name,
                "sqlalchemy",
                f"advisory_lock(connection, transaction=True, timeout={timeout}) inside an "
                "open transaction; release is free (commit untimed)",
                transaction_lock,
                twin="raw.xact_lock_in_transaction",
                sockets=tracked.sockets,
            )
        )

    transaction_case("ours.connection.xact", None)
    transaction_case("ours.connection.xact.timeout", TIMEOUT_SECONDS)

    tracked = TrackedEngine(url, stack)
    reentrant_session = Session(tracked.engine)
    stack.callback(reentrant_session.close)
    outer = advisory_lock(reentrant_session, "ours.session.reentrant", timeout=TIMEOUT_SECONDS)

    def take_outer() -> None:
        if not outer.acquire():
            raise RuntimeError("the outer lock of the re-entrancy case is held elsewhere")

    def reentrant_lock() -> None:
        with advisory_lock(reentrant_session, "ours.session.reentrant", timeout=TIMEOUT_SECONDS):
            pass

    cases.append(
        Case(
            "ours.session.reentrant",
            "sqlalchemy",
            "advisory_lock(session, timeout=5) for a name the Session already holds: "
            "should cost no round trip",
            _timed(reentrant_lock),
            before_round=take_outer,
            after_round=outer.release,
            sockets=tracked.sockets,
        )
    )
    return cases


def uncontended_cases(url: URL, stack: ExitStack) -> list[Case]:
    return [*raw_cases(url, stack), *library_cases(url, stack)]
