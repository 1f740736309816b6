"""Locks on a psycopg 3 connection in pipeline mode (``with conn.pipeline():``).

A lock statement needs its answer before the code it guards runs, and a wait that fails
inside a pipeline aborts the statements queued with it; so every lock statement on such a
connection (acquire, release, ensure_held) is refused with ``LockUsageError`` before
anything is sent. A refused release leaves the lock held, by the server and by the lock
object, to be released once the pipeline has ended. The same rule holds on every bind that
reaches a psycopg 3 connection: raw (blocking and asyncio), SQLAlchemy's Connection and
Session (blocking and asyncio); Django's is in tests/django/test_django_locks.py.
pg_locks, read over a separate admin connection, is the witness.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session

from advisory_locks import LockUsageError, advisory_lock, advisory_lock_set
from tests.helpers import holder_pids, unique_name
from tests.test_raw_postgres import libpq_url

pytestmark = pytest.mark.timeout(60)

Admin = psycopg.Connection[TupleRow]

# The options that take different statements: try, wait without limit, wait with a limit
# (inside a transaction that is a script of several statements), and a transaction lock.
ACQUIRE_OPTIONS = [
    pytest.param({"timeout": 0}, id="try"),
    pytest.param({}, id="wait"),
    pytest.param({"timeout": 5.0}, id="timeout"),
    pytest.param({"timeout": 5.0, "transaction": True}, id="transaction"),
]


def acquire_cases(without: tuple[bool, str], within: tuple[bool, str]) -> list[Any]:
    """(flag, options) cases, each a (flag, id prefix) pair: where no transaction is open
    (``without``) every option but the transaction lock, which needs one; where one is
    (``within``) every option."""
    return [
        pytest.param(flag, *option.values, id=f"{label}-{option.id}")
        for (flag, label), options in (
            (without, [o for o in ACQUIRE_OPTIONS if "transaction" not in o.values[0]]),
            (within, ACQUIRE_OPTIONS),
        )
        for option in options
    ]


@pytest.fixture(params=[True, False], ids=["autocommit", "transactional"])
def raw(request: pytest.FixtureRequest, postgres_url: URL) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(libpq_url(postgres_url), autocommit=request.param) as connection:
        yield connection


@contextmanager
def sent(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> Iterator[list[str]]:
    """The protocol messages the client sends on ``conn`` inside the block (libpq's trace):
    the witness that a refused statement sent nothing, not even a Sync."""
    messages: list[str] = []
    with tempfile.TemporaryFile("w+") as trace:
        conn.pgconn.trace(trace.fileno())
        try:
            yield messages
        finally:
            conn.pgconn.untrace()
            trace.seek(0)
            messages.extend(line.split("\t")[3] for line in trace if line.split("\t")[1] == "F")


def refused_in_pipeline(
    conn: psycopg.Connection[Any], bind: Any, admin: Admin, **options: Any
) -> None:
    """Try a lock inside a pipeline on ``conn``, idle and with a statement of the
    application's queued: refused with nothing sent, nothing held, and the pipeline's own
    statement, the connection's mode and its transaction as without the lock."""
    name = unique_name()
    autocommit = conn.autocommit
    with conn.pipeline():
        with sent(conn) as messages, pytest.raises(LockUsageError, match="pipeline mode"):
            advisory_lock(bind, name, **options).acquire()
        assert messages == []
    with conn.pipeline():
        queued = conn.execute("SELECT 41 + 1")
        with sent(conn) as messages, pytest.raises(LockUsageError, match="pipeline mode"):
            advisory_lock(bind, name, **options).acquire()
        assert messages == []
    assert queued.fetchone() == (42,)
    assert holder_pids(admin, name) == []
    # The connection's own statement alone decided whether a transaction is open.
    expected = TransactionStatus.IDLE if autocommit else TransactionStatus.INTRANS
    assert (conn.autocommit, conn.pgconn.transaction_status) == (autocommit, expected)


@pytest.mark.parametrize(
    ("autocommit", "options"), acquire_cases((True, "autocommit"), (False, "transactional"))
)
def test_raw_acquire_in_a_pipeline_is_refused_before_anything_is_sent(
    postgres_url: URL, pg_admin: Admin, autocommit: bool, options: dict[str, Any]
) -> None:
    # (A transaction lock is taken in a transaction: not on an autocommit connection.)
    with psycopg.connect(libpq_url(postgres_url), autocommit=autocommit) as raw:
        # A connection's first lock asks the server what it is: refused before that too.
        refused_in_pipeline(raw, raw, pg_admin, **options)
        with advisory_lock(raw, unique_name()):
            pass
        refused_in_pipeline(raw, raw, pg_admin, **options)


def test_raw_lock_refused_in_a_pipeline_keeps_the_rows_queued_before_it(
    postgres_url: URL, pg_admin: Admin
) -> None:
    # Before the refusal, this acquire returned True while the other connection held the
    # lock: its wait ran as a script that a pipeline cannot send, whose error psycopg
    # raised only when the pipeline ended, after aborting what was queued with it.
    name = unique_name()
    with (
        psycopg.connect(libpq_url(postgres_url), autocommit=True) as raw,
        psycopg.connect(libpq_url(postgres_url), autocommit=True) as other,
    ):
        raw.execute("CREATE TEMPORARY TABLE queued (n int)")
        with advisory_lock(raw, unique_name()):  # past the connection's first lock
            pass
        with advisory_lock(other, name), raw.pipeline():
            raw.execute("INSERT INTO queued VALUES (1)")
            with pytest.raises(LockUsageError, match="pipeline mode"):
                advisory_lock(raw, name, timeout=0.5).acquire()
            assert holder_pids(pg_admin, name) == [other.info.backend_pid]
        assert raw.execute("SELECT count(*) FROM queued").fetchone() == (1,)


def test_raw_release_in_a_pipeline_is_refused_and_the_lock_stays_held(
    raw: psycopg.Connection[Any], pg_admin: Admin
) -> None:
    name = unique_name()
    lock = advisory_lock(raw, name)
    lock.acquire()
    pid = raw.info.backend_pid
    with raw.pipeline():
        with sent(raw) as messages:
            with pytest.raises(LockUsageError, match="pipeline mode"):
                lock.release()
            with pytest.raises(LockUsageError, match="pipeline mode"):
                lock.ensure_held()
        assert messages == []
        assert lock.held
    assert holder_pids(pg_admin, name) == [pid]
    lock.ensure_held()
    lock.release()
    assert not lock.held
    assert holder_pids(pg_admin, name) == []


def test_raw_pipeline_inside_a_lock_block_runs_under_the_lock(
    raw: psycopg.Connection[Any], pg_admin: Admin
) -> None:
    name = unique_name()
    with advisory_lock(raw, name):
        with raw.pipeline():
            first, second = raw.execute("SELECT 1"), raw.execute("SELECT 2")
        assert (first.fetchone(), second.fetchone()) == ((1,), (2,))
        assert holder_pids(pg_admin, name) == [raw.info.backend_pid]
    assert holder_pids(pg_admin, name) == []


def test_raw_lock_set_released_in_a_pipeline_stays_held(
    raw: psycopg.Connection[Any], pg_admin: Admin
) -> None:
    names = [unique_name(), unique_name()]
    locks = advisory_lock_set(raw, names)
    assert locks.acquire()
    with raw.pipeline(), pytest.raises(LockUsageError, match="pipeline mode"):
        locks.release()
    assert locks.held
    assert [holder_pids(pg_admin, name) for name in names] == [[raw.info.backend_pid]] * 2
    locks.release()
    assert not locks.held
    assert [holder_pids(pg_admin, name) for name in names] == [[], []]


@pytest.fixture(params=[True, False], ids=["autocommit", "transactional"])
async def araw(
    request: pytest.FixtureRequest, postgres_url: URL
) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    connection = await psycopg.AsyncConnection.connect(
        libpq_url(postgres_url), autocommit=request.param
    )
    yield connection
    await connection.close()


async def test_raw_async_lock_statements_in_a_pipeline_are_refused(
    araw: psycopg.AsyncConnection[Any], pg_admin: Admin
) -> None:
    name = unique_name()
    autocommit = araw.autocommit
    async with araw.pipeline():
        with sent(araw) as messages, pytest.raises(LockUsageError, match="pipeline mode"):
            await advisory_lock(araw, name, timeout=5.0).acquire()
        assert messages == []
    assert holder_pids(pg_admin, name) == []
    assert araw.autocommit is autocommit
    assert araw.pgconn.transaction_status == TransactionStatus.IDLE
    lock = advisory_lock(araw, name)
    await lock.acquire()
    async with araw.pipeline():
        with pytest.raises(LockUsageError, match="pipeline mode"):
            await lock.release()
        with pytest.raises(LockUsageError, match="pipeline mode"):
            await advisory_lock(araw, unique_name(), timeout=0).acquire()
    assert lock.held
    assert holder_pids(pg_admin, name) == [araw.info.backend_pid]
    await lock.release()
    assert holder_pids(pg_admin, name) == []


@pytest.mark.parametrize(
    ("in_transaction", "options"), acquire_cases((False, "outside"), (True, "begun"))
)
def test_sqlalchemy_connection_lock_in_a_pipeline_is_refused(
    pg_engine: Engine, pg_admin: Admin, options: dict[str, Any], in_transaction: bool
) -> None:
    # (A transaction lock outside a transaction: see the next test.)
    with pg_engine.connect() as connection:
        if in_transaction:
            connection.begin()
            connection.execute(text("SELECT 1"))
        driver = connection.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        # Past the connection's first lock (its server check), so that the refusals
        # below are of the lock statements themselves.
        with advisory_lock(connection, unique_name(), timeout=5.0):
            pass
        refused_in_pipeline(driver, connection, pg_admin, **options)
        # Still in the transaction it was in, with nothing of the lock in it.
        assert connection.in_transaction() is in_transaction


def test_sqlalchemy_transaction_lock_on_an_idle_connection_in_a_pipeline_begins_nothing(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    # Outside a transaction a transaction lock autobegins one, as any statement on a
    # Connection does; refused in a pipeline, it left the Connection in the transaction
    # it began for a statement it never sent.
    with pg_engine.connect() as connection:
        driver = connection.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        with connection.begin(), advisory_lock(connection, unique_name(), transaction=True):
            pass
        assert not connection.in_transaction()
        with driver.pipeline():
            with sent(driver) as messages, pytest.raises(LockUsageError, match="pipeline mode"):
                advisory_lock(connection, unique_name(), transaction=True).acquire()
            assert messages == []
        assert not connection.in_transaction()
        assert driver.pgconn.transaction_status == TransactionStatus.IDLE


def test_sqlalchemy_connection_release_in_a_pipeline_is_refused(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        driver = connection.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        lock = advisory_lock(connection, name)
        lock.acquire()
        with driver.pipeline():
            with sent(driver) as messages, pytest.raises(LockUsageError, match="pipeline mode"):
                lock.release()
            assert messages == []
        assert lock.held
        assert holder_pids(pg_admin, name) == [driver.info.backend_pid]
        lock.release()
        assert holder_pids(pg_admin, name) == []
        connection.execute(text("SELECT 1"))
        connection.commit()


def test_sqlalchemy_session_lock_and_release_in_a_pipeline_are_refused(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with Session(pg_engine) as session:
        session.execute(text("SELECT 1"))
        driver = session.connection().connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        with advisory_lock(session, unique_name(), timeout=5.0):
            pass
        refused_in_pipeline(driver, session, pg_admin, timeout=5.0)
        lock = advisory_lock(session, name)
        lock.acquire()
        with driver.pipeline(), pytest.raises(LockUsageError, match="pipeline mode"):
            lock.release()
        assert holder_pids(pg_admin, name) == [driver.info.backend_pid]
        lock.release()
        assert holder_pids(pg_admin, name) == []
        session.commit()


@pytest.fixture
async def async_engine(postgres_url: URL) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(postgres_url.set(drivername="postgresql+psycopg_async"))
    yield engine
    await engine.dispose()


async def test_sqlalchemy_async_connection_lock_in_a_pipeline_is_refused(
    async_engine: AsyncEngine, pg_admin: Admin
) -> None:
    name = unique_name()
    async with async_engine.connect() as connection:
        raw_connection = await connection.get_raw_connection()
        driver = raw_connection.driver_connection
        assert isinstance(driver, psycopg.AsyncConnection)
        async with driver.pipeline():
            with sent(driver) as messages, pytest.raises(LockUsageError, match="pipeline mode"):
                await advisory_lock(connection, name, timeout=5.0).acquire()
            assert messages == []
        assert holder_pids(pg_admin, name) == []
        lock = advisory_lock(connection, name)
        await lock.acquire()
        async with driver.pipeline():
            with pytest.raises(LockUsageError, match="pipeline mode"):
                await lock.release()
        assert holder_pids(pg_admin, name) == [driver.info.backend_pid]
        await lock.release()
        assert holder_pids(pg_admin, name) == []


def postpone_an_unlock(conn: psycopg.Connection[Any], bind: Any, name: str) -> None:
    """Take ``name`` and release it inside a failed transaction, which postpones the
    unlock until that transaction has ended (rolled back here, or by the caller)."""
    lock = advisory_lock(bind, name)
    lock.acquire()
    with pytest.raises(psycopg.errors.DivisionByZero):
        conn.execute("SELECT 1/0")
    lock.release()


def test_raw_unlocks_postponed_by_a_failed_transaction_survive_a_refusal(
    postgres_url: URL, pg_admin: Admin
) -> None:
    name = unique_name()
    with psycopg.connect(libpq_url(postgres_url)) as raw:
        postpone_an_unlock(raw, raw, name)
        raw.rollback()
        with raw.pipeline(), pytest.raises(LockUsageError, match="pipeline mode"):
            # The next lock would finish the postponed unlock first: refused, unsent.
            advisory_lock(raw, unique_name()).acquire()
        assert holder_pids(pg_admin, name) == [raw.info.backend_pid]
        with advisory_lock(raw, unique_name()):  # outside the pipeline it runs
            assert holder_pids(pg_admin, name) == []


def test_sqlalchemy_unlocks_postponed_by_a_failed_transaction_survive_a_refusal(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        driver = connection.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        postpone = advisory_lock(connection, name)
        postpone.acquire()
        connection.begin()
        with pytest.raises(DBAPIError):
            connection.execute(text("SELECT 1/0"))
        postpone.release()
        with driver.pipeline():
            # SQLAlchemy's rollback hook would unlock now: refused unsent, kept for later.
            connection.rollback()
        assert holder_pids(pg_admin, name) == [driver.info.backend_pid]
    # The pool's check-in unlocked it when the Connection went back.
    assert holder_pids(pg_admin, name) == []


def test_a_release_refused_for_another_thread_leaves_the_lock_its_holders(
    postgres_url: URL, pg_admin: Admin
) -> None:
    name = unique_name()
    with psycopg.connect(libpq_url(postgres_url), autocommit=True) as raw:
        lock = advisory_lock(raw, name)
        lock.acquire()
        refused: list[BaseException] = []

        def release_in_a_pipeline() -> None:
            with raw.pipeline():
                try:
                    lock.release()
                except LockUsageError as error:
                    refused.append(error)

        worker = threading.Thread(target=release_in_a_pipeline)
        worker.start()
        worker.join(10)
        assert len(refused) == 1
        # Still this thread's: taking it again counts in, as before the refused release.
        assert lock.acquire()
        lock.release()
        assert holder_pids(pg_admin, name) == [raw.info.backend_pid]
        lock.release()
        assert holder_pids(pg_admin, name) == []
