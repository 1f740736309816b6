"""Value statements sent through psycopg 3's libpq wrapper (``advisory_locks._core.libpq``)
rather than a cursor, on connections in autocommit: they answer and fail as a cursor
does, are prepared when psycopg would prepare them, survive their prepared statements
being deallocated, and leave everything else to the cursor.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import decimal
import signal
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from advisory_locks import LockTimeout, advisory_lock
from advisory_locks._core.libpq import NOT_SENT, LibpqStatements, libpq_statements
from advisory_locks._core.steps import VALUE, Statement
from tests.helpers import (
    holder_pids,
    refuse_lock_statements_on_cursors,
    unique_name,
    wait_for,
    waiter_pids,
)

Admin = psycopg.Connection[TupleRow]


@pytest.fixture
def dsn(postgres_url: URL) -> str:
    return postgres_url.set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def connection(dsn: str) -> Iterator[psycopg.Connection[TupleRow]]:
    with psycopg.connect(dsn, autocommit=True) as opened:
        yield opened


def ours(connection: psycopg.Connection[Any]) -> list[str]:
    """The library's statements prepared on ``connection``'s server session."""
    # Never prepared itself: psycopg < 3.2 does not see its own go with DEALLOCATE ALL.
    rows = connection.execute(
        "SELECT name FROM pg_prepared_statements WHERE name LIKE '\\_advisory\\_locks\\_%'",
        prepare=False,
    ).fetchall()
    return [row[0] for row in rows]


@pytest.mark.parametrize(
    ("sql", "params"),
    [
        ("SELECT pg_backend_pid()", ()),
        ("SELECT pg_advisory_unlock(%s)", (7_246_999,)),  # not held: False
        ("SELECT %s::int8 + 1", (2**40,)),
        ("SELECT %s::int4 * 2", (-40_000,)),
        ("SELECT %s = 'x'", ("x",)),
        ("SELECT %s || '%%'", ("ab",)),
        ("SELECT pg_sleep(0)", ()),
        ("SELECT NULL::int", ()),
        ("SELECT 1 WHERE false", ()),
        ("SELECT 1.5::numeric", ()),
        ("SELECT '2026-11-28 12:00:00+00'::timestamptz", ()),
        ("SELECT 'name'::name", ()),
    ],
)
def test_a_value_is_what_the_cursor_would_return(
    connection: psycopg.Connection[TupleRow], sql: str, params: tuple[object, ...]
) -> None:
    libpq = libpq_statements(connection.cursor(), {})
    assert libpq is not None
    value = libpq.value(Statement(VALUE, sql, params))
    assert value is not NOT_SENT
    row = connection.cursor().execute(sql, params).fetchone()
    expected = None if row is None else row[0]
    assert value == expected
    assert type(value) is type(expected)


def test_the_loaded_types_are_psycopgs(connection: psycopg.Connection[TupleRow]) -> None:
    libpq = LibpqStatements(connection)
    assert libpq.value(Statement(VALUE, "SELECT 1.5::numeric")) == decimal.Decimal("1.5")
    assert isinstance(libpq.value(Statement(VALUE, "SELECT now()")), datetime.datetime)
    assert libpq.value(Statement(VALUE, "SELECT %s::int8 > 0", (1,))) is True


@pytest.mark.parametrize(
    ("sql", "params"),
    [
        ("SELECT %s", (True,)),  # psycopg sends bool as bool
        ("SELECT %s", ("é",)),  # text in the connection's encoding
        ("SELECT %s::numeric", (2**63,)),  # beyond int8: psycopg's numeric
        ("SELECT %s", (None,)),
        ("SELECT %s", (1.5,)),
        ("SELECT %(key)s", {"key": 1}),  # named placeholders
        ("SELECT %b", (1,)),  # binary placeholders
    ],
)
def test_other_statements_are_left_to_the_cursor(
    connection: psycopg.Connection[TupleRow], sql: str, params: Any
) -> None:
    libpq = LibpqStatements(connection)
    assert libpq.value(Statement(VALUE, sql, params)) is NOT_SENT


def test_nothing_is_sent_in_a_transaction_or_outside_autocommit(dsn: str) -> None:
    statement = Statement(VALUE, "SELECT pg_backend_pid()")
    with psycopg.connect(dsn) as connection:
        libpq = LibpqStatements(connection)
        # psycopg would begin a transaction first: the cursor's to send.
        assert libpq.value(statement) is NOT_SENT
        connection.execute("SELECT 1")
        # Inside the transaction a deallocated prepared statement would fail it.
        assert libpq.value(statement) is NOT_SENT
        connection.rollback()
        connection.autocommit = True
        with connection.transaction():
            assert libpq.value(statement) is NOT_SENT
        assert libpq.value(statement) == connection.info.backend_pid


def test_a_cursor_class_of_the_applications_keeps_every_statement(
    connection: psycopg.Connection[TupleRow],
) -> None:
    # A cursor that logs or traces (OpenTelemetry's psycopg instrumentation sets one).
    class TracingCursor(psycopg.Cursor[Any]):
        pass

    assert libpq_statements(TracingCursor(connection), {}) is None
    assert libpq_statements(psycopg.ClientCursor(connection), {}) is None
    assert libpq_statements(psycopg.Cursor(connection), {}) is not None


def test_errors_are_the_cursors(connection: psycopg.Connection[TupleRow]) -> None:
    libpq = LibpqStatements(connection)
    with pytest.raises(psycopg.errors.DivisionByZero):
        libpq.value(Statement(VALUE, "SELECT 1 / %s", (0,)))
    with pytest.raises(psycopg.errors.UndefinedFunction):
        libpq.value(Statement(VALUE, "SELECT no_such_function(%s)", (1,)))
    with pytest.raises(psycopg.ProgrammingError):
        libpq.value(Statement(VALUE, "SET application_name = 'x'"))
    # The connection is usable after each.
    assert libpq.value(Statement(VALUE, "SELECT %s::int4", (7,))) == 7


@pytest.mark.parametrize(("threshold", "unprepared"), [(None, 8), (0, 0), (2, 2)])
def test_statements_are_prepared_when_psycopg_would(
    dsn: str, threshold: int | None, unprepared: int
) -> None:
    name = unique_name("libpq-prepared")
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=threshold) as connection:
        for _ in range(unprepared):
            with advisory_lock(connection, name, timeout=1):
                pass
        assert ours(connection) == []
        if threshold is None:
            return
        with advisory_lock(connection, name, timeout=1):
            pass
        # The lock and the unlock statements.
        assert len(ours(connection)) == 2


@pytest.mark.parametrize("reset", ["DEALLOCATE ALL", "DISCARD ALL"])
def test_a_deallocated_statement_is_sent_again(dsn: str, pg_admin: Admin, reset: str) -> None:
    name = unique_name("libpq-deallocated")
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as connection:
        pid = connection.info.backend_pid
        with advisory_lock(connection, name, timeout=1):
            pass
        assert ours(connection)
        connection.execute(reset)
        assert ours(connection) == []
        for _ in range(2):
            with advisory_lock(connection, name, timeout=1) as lock:
                assert lock.held
                assert holder_pids(pg_admin, name) == [pid]
            assert holder_pids(pg_admin, name) == []
        # Prepared again once sent again.
        assert len(ours(connection)) == 2


def test_a_deallocated_statement_is_sent_again_on_a_sqlalchemy_connection(
    postgres_url: URL, pg_admin: Admin
) -> None:
    name = unique_name("libpq-deallocated-sqlalchemy")
    engine = create_engine(postgres_url, connect_args={"prepare_threshold": 0})
    try:
        with engine.connect() as connection:
            with advisory_lock(connection, name, timeout=1):
                pass
            connection.exec_driver_sql("DEALLOCATE ALL")
            connection.commit()
            for _ in range(2):
                with advisory_lock(connection, name, timeout=1) as lock:
                    assert lock.held
                    assert len(holder_pids(pg_admin, name)) == 1
                assert holder_pids(pg_admin, name) == []
            driver = connection.connection.driver_connection
            assert driver is not None
            assert len(ours(driver)) == 2
    finally:
        engine.dispose()


def test_a_statement_prepared_by_an_earlier_connection_object_is_used(
    connection: psycopg.Connection[TupleRow],
) -> None:
    # As behind a session pooler that does not reset: the server session has the
    # statement, and the connection object knows nothing of it.
    connection.prepare_threshold = 0
    statement = Statement(VALUE, "SELECT %s::int8 * 3", (5,))
    assert LibpqStatements(connection).value(statement) == 15
    assert LibpqStatements(connection).value(statement) == 15
    assert len(ours(connection)) == 1


def test_a_timeout_on_the_libpq_path_is_a_lock_timeout(
    dsn: str, pg_admin: Admin, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_lock_statements_on_cursors(monkeypatch)
    name = unique_name("libpq-timeout")
    with (
        psycopg.connect(dsn, autocommit=True) as holder,
        psycopg.connect(dsn, autocommit=True) as waiter,
        advisory_lock(holder, name),
    ):
        with pytest.raises(LockTimeout), advisory_lock(waiter, name, timeout=0.2):
            pass
        assert holder_pids(pg_admin, name) == [holder.info.backend_pid]
        # The waiter's connection is idle and usable.
        assert waiter.execute("SELECT 1").fetchone() == (1,)


def test_an_interrupted_wait_ends_on_the_server(
    dsn: str, pg_admin: Admin, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_lock_statements_on_cursors(monkeypatch)
    name = unique_name("libpq-interrupted")
    with (
        psycopg.connect(dsn, autocommit=True) as holder,
        psycopg.connect(dsn, autocommit=True) as waiter,
        advisory_lock(holder, name),
    ):
        main = threading.get_ident()

        def interrupt() -> None:
            wait_for(lambda: waiter_pids(pg_admin, name) != [], "the waiter queued")
            signal.pthread_kill(main, signal.SIGINT)

        interrupter = threading.Thread(target=interrupt)
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt), advisory_lock(waiter, name, timeout=30):
                pass
        finally:
            interrupter.join()
        # Interrupted mid-statement, the connection is in an unknown state: the library
        # closes it (as on the cursor path), and its backend is never granted the lock.
        assert waiter.closed
        wait_for(lambda: waiter_pids(pg_admin, name) == [], "the wait ended on the server")
        assert holder_pids(pg_admin, name) == [holder.info.backend_pid]
    # The lock went with the holder, and the waiter was never granted it late.
    assert holder_pids(pg_admin, name) == []


async def ours_async(connection: psycopg.AsyncConnection[Any]) -> list[str]:
    cursor = await connection.execute(
        "SELECT name FROM pg_prepared_statements WHERE name LIKE '\\_advisory\\_locks\\_%'",
        prepare=False,
    )
    return [row[0] for row in await cursor.fetchall()]


async def test_async_locks_are_prepared_and_survive_deallocation(dsn: str, pg_admin: Admin) -> None:
    name = unique_name("libpq-async")
    async with await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, prepare_threshold=0
    ) as connection:
        pid = connection.info.backend_pid
        async with advisory_lock(connection, name, timeout=1):
            assert holder_pids(pg_admin, name) == [pid]
        assert len(await ours_async(connection)) == 2
        await connection.execute("DEALLOCATE ALL")
        for _ in range(2):
            async with advisory_lock(connection, name, timeout=1) as lock:
                assert lock.held
                assert holder_pids(pg_admin, name) == [pid]
            assert holder_pids(pg_admin, name) == []
        assert len(await ours_async(connection)) == 2


async def test_async_sqlalchemy_locks_survive_deallocation(
    postgres_url: URL, pg_admin: Admin
) -> None:
    name = unique_name("libpq-async-sqlalchemy")
    engine = create_async_engine(
        postgres_url.set(drivername="postgresql+psycopg_async"),
        connect_args={"prepare_threshold": 0},
    )
    try:
        async with engine.connect() as connection:
            async with advisory_lock(connection, name, timeout=1):
                assert len(holder_pids(pg_admin, name)) == 1
            await connection.exec_driver_sql("DEALLOCATE ALL")
            await connection.commit()
            for _ in range(2):
                async with advisory_lock(connection, name, timeout=1) as lock:
                    assert lock.held
                    assert len(holder_pids(pg_admin, name)) == 1
                assert holder_pids(pg_admin, name) == []
            driver = (await connection.get_raw_connection()).driver_connection
            assert driver is not None
            assert len(await ours_async(driver)) == 2
    finally:
        await engine.dispose()


async def test_a_cancelled_async_wait_ends_on_the_server(
    dsn: str, pg_admin: Admin, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_lock_statements_on_cursors(monkeypatch)
    name = unique_name("libpq-async-cancelled")
    async with (
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as holder,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as waiter,
        advisory_lock(holder, name),
    ):

        async def wait() -> None:
            async with advisory_lock(waiter, name, timeout=30):
                pass

        task = asyncio.create_task(wait())
        while not waiter_pids(pg_admin, name):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        wait_for(lambda: waiter_pids(pg_admin, name) == [], "the wait ended on the server")
        assert holder_pids(pg_admin, name) == [holder.info.backend_pid]
    assert holder_pids(pg_admin, name) == []


@pytest.mark.parametrize("name", [(3, 4), (-2_000_000_000, 7), (0, -1)])
def test_a_pair_of_ints_is_locked_through_libpq(
    connection: psycopg.Connection[TupleRow],
    pg_admin: Admin,
    name: tuple[int, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refuse_lock_statements_on_cursors(monkeypatch)
    # pg_advisory_lock(int4, int4) takes no int8: the parameters go as psycopg types them.
    with advisory_lock(connection, name, timeout=1) as lock:
        assert lock.held
        assert holder_pids(pg_admin, name) == [connection.info.backend_pid]
    assert holder_pids(pg_admin, name) == []
    assert ours(connection) == []  # sent without a cursor, not prepared (threshold 5)


@pytest.mark.parametrize("kind", ["engine", "session", "connection"])
def test_sqlalchemy_locks_go_through_libpq(
    postgres_url: URL, pg_admin: Admin, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_lock_statements_on_cursors(monkeypatch)
    name = unique_name("libpq-sqlalchemy")
    engine = create_engine(postgres_url)
    try:
        with contextlib.ExitStack() as stack:
            bind: Any = engine
            if kind == "connection":
                bind = stack.enter_context(engine.connect())
            elif kind == "session":
                bind = stack.enter_context(Session(engine))
            for _ in range(7):  # prepared after five
                with advisory_lock(bind, name, timeout=1) as lock:
                    assert lock.held
                    assert len(holder_pids(pg_admin, name)) == 1
                assert holder_pids(pg_admin, name) == []
    finally:
        engine.dispose()


def test_a_pipeline_opened_before_the_lock_is_taken_sends_nothing(
    connection: psycopg.Connection[TupleRow],
) -> None:
    # Asked under the connection's lock: another thread may have opened the pipeline
    # after the executor looked (in a pipeline, the transaction status still reads idle).
    libpq = LibpqStatements(connection)
    statement = Statement(VALUE, "SELECT %s::int4", (1,))
    with connection.pipeline():
        assert libpq.value(statement) is NOT_SENT
    assert libpq.value(statement) == 1


@pytest.mark.parametrize(
    ("sql", "params"),
    [("SELECT %s, %s", (1,)), ("SELECT %s", (1, 2)), ("SELECT 100 %", ())],
)
def test_a_statement_whose_placeholders_do_not_fit_is_left_to_the_cursor(
    connection: psycopg.Connection[TupleRow], sql: str, params: tuple[object, ...]
) -> None:
    libpq = LibpqStatements(connection)
    assert libpq.value(Statement(VALUE, sql, params)) is NOT_SENT
    with pytest.raises(psycopg.ProgrammingError):
        connection.cursor().execute(sql, params)


def test_a_threshold_turned_off_stops_using_what_was_prepared(
    connection: psycopg.Connection[TupleRow],
) -> None:
    # As psycopg does: prepare_threshold=None means nothing prepared is used.
    connection.prepare_threshold = 0
    libpq = LibpqStatements(connection)
    statement = Statement(VALUE, "SELECT %s::int4 + 1", (1,))
    assert libpq.value(statement) == 2
    assert len(ours(connection)) == 1
    connection.execute("DEALLOCATE ALL", prepare=False)
    connection.prepare_threshold = None
    # Sent unprepared: no "does not exist" round trip, nothing prepared again.
    assert libpq.value(statement) == 2
    assert ours(connection) == []


def test_outside_sends_on_an_idle_connection_without_beginning_a_transaction(dsn: str) -> None:
    statement = Statement(VALUE, "SELECT pg_backend_pid()")
    with psycopg.connect(dsn) as connection:
        libpq = LibpqStatements(connection)
        assert libpq.value(statement) is NOT_SENT
        assert libpq.value(statement, True) == connection.info.backend_pid
        # Run as its own statement: no transaction was begun, and the mode is untouched.
        assert connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert connection.autocommit is False
        connection.execute("SELECT 1")
        # A transaction lock must join the transaction: never sent outside it.
        assert libpq.value(statement, True) is NOT_SENT
        connection.rollback()


def _transaction_state(admin: Admin, pid: int) -> str:
    row = admin.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
    assert row is not None
    return str(row[0])


def _next_checkout_is_as_configured(engine: Engine, pid: int) -> None:
    """The application's next checkout of the lock's connection (backend ``pid``) finds
    autocommit off, as configured, and begins transactions as before."""
    with engine.connect() as connection:
        dbapi: Any = connection.connection.dbapi_connection
        assert dbapi.info.backend_pid == pid
        assert dbapi.autocommit is False
        connection.exec_driver_sql("SELECT 1")
        assert dbapi.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        connection.rollback()


_libpq_value = LibpqStatements.value


def _refusing_outside(self: LibpqStatements, statement: Statement, outside: bool = False) -> object:
    """``LibpqStatements.value`` that sends nothing when asked to send ``outside``."""
    return NOT_SENT if outside else _libpq_value(self, statement, outside)


@pytest.mark.parametrize("libpq_refuses", [False, True])
def test_an_engine_locks_checkout_runs_outside_a_transaction_and_keeps_its_mode(
    postgres_url: URL, pg_admin: Admin, monkeypatch: pytest.MonkeyPatch, libpq_refuses: bool
) -> None:
    # An engine lock's own checkout of an idle psycopg connection: its statements go
    # through libpq outside any transaction, without switching the connection to
    # autocommit; where libpq sends nothing, the checkout is switched for the cursor and
    # switched back at checkin. Either way no transaction is open while the lock is held,
    # and the application's next checkout finds the mode it configured.
    if libpq_refuses:
        monkeypatch.setattr(LibpqStatements, "value", _refusing_outside)
    else:
        refuse_lock_statements_on_cursors(monkeypatch)
    name = unique_name("libpq-engine-mode")
    engine = create_engine(postgres_url, pool_size=1, max_overflow=0)
    try:
        for _ in range(3):  # the first lock makes the connection's cursor
            with advisory_lock(engine, name, timeout=1) as lock:
                assert lock.held
                (pid,) = holder_pids(pg_admin, name)
                assert _transaction_state(pg_admin, pid) == "idle"
            assert holder_pids(pg_admin, name) == []
            _next_checkout_is_as_configured(engine, pid)
    finally:
        engine.dispose()


@pytest.mark.parametrize("libpq_refuses", [False, True])
def test_a_sessions_lock_connection_keeps_its_mode_and_joins_the_sessions_transaction(
    postgres_url: URL, pg_admin: Admin, monkeypatch: pytest.MonkeyPatch, libpq_refuses: bool
) -> None:
    # A Session's lock connection, its own checkout of an idle psycopg connection: with
    # no transaction of the Session open on it, the lock's statements go through libpq
    # outside any transaction and the connection stays in the mode the application
    # configured; where libpq sends nothing, it is switched until the Session begins a
    # transaction. Either way the Session's transactions on it are real transactions,
    # and a lock statement made while one is open joins it.
    name, other = unique_name("libpq-session-mode"), unique_name("libpq-session-mode")
    engine = create_engine(postgres_url, pool_size=1, max_overflow=0)
    try:
        with Session(engine) as session:
            for attempt in range(3):
                with monkeypatch.context() as patch:
                    if libpq_refuses:
                        patch.setattr(LibpqStatements, "value", _refusing_outside)
                    elif attempt:  # the first lock makes the connection's cursor
                        refuse_lock_statements_on_cursors(patch)
                    lock = advisory_lock(session, name, timeout=1)
                    lock.acquire()
                (pid,) = holder_pids(pg_admin, name)
                assert _transaction_state(pg_admin, pid) == "idle"
                pinned = session.get_bind()
                assert isinstance(pinned, Connection)
                dbapi: Any = pinned.connection.dbapi_connection
                assert dbapi.info.backend_pid == pid
                # Switched only where libpq sent nothing (before the connection's first
                # cursor, libpq is not ready to).
                assert dbapi.autocommit is (libpq_refuses or not attempt)
                # The Session's transaction, on the lock connection.
                session.execute(text("SELECT 1"))
                assert dbapi.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
                with advisory_lock(session, other, timeout=0) as joined:  # a try_ lock
                    assert joined.held
                    with advisory_lock(session, other + "-wait", timeout=1) as waited:
                        assert waited.held  # waited for within a savepoint
                        assert holder_pids(pg_admin, other + "-wait") == [pid]
                    assert holder_pids(pg_admin, other) == [pid]
                assert holder_pids(pg_admin, other) == []  # a session unlock: at once
                lock.release()
                assert holder_pids(pg_admin, name) == []
                assert _transaction_state(pg_admin, pid) == "idle in transaction"
                session.rollback()
            _next_checkout_is_as_configured(engine, pid)
    finally:
        engine.dispose()
