"""The core lock behaviours hold the same on every synchronous PostgreSQL driver.

Each test runs once per driver (psycopg 3 and psycopg2) against the real server; pg_locks,
read over a separate admin connection, is the witness of what the server holds.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from advisory_locks import LockLost, LockTimeout, advisory_lock
from advisory_locks.keys import LockName, derive_key
from tests.databases import AdvisoryLockRow, PostgresDriver, advisory_locks_held

SYNC_DRIVERS: list[PostgresDriver] = ["psycopg", "psycopg2"]


@pytest.fixture(params=SYNC_DRIVERS)
def engine(
    request: pytest.FixtureRequest, postgres_url_for: Callable[[PostgresDriver], URL]
) -> Iterator[Engine]:
    engine = create_engine(postgres_url_for(request.param))
    yield engine
    engine.dispose()


@pytest.fixture
def name() -> str:
    # Other test runs may share the server: a fresh name per test keeps pg_locks readable.
    return f"test_drivers-{uuid.uuid4()}"


@pytest.fixture
def holder(engine: Engine) -> Iterator[Connection]:
    """A second connection of the driver under test, to hold locks against the first."""
    with engine.connect() as connection:
        yield connection


def rows_for(admin: psycopg.Connection[TupleRow], name: LockName) -> list[AdvisoryLockRow]:
    classid, objid, objsubid = derive_key(name).pg_locks_ids()
    return [
        row
        for row in advisory_locks_held(admin)
        if (row.classid, row.objid, row.objsubid) == (classid, objid, objsubid)
    ]


def backend_pid(connection: Connection) -> int:
    return int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_lock_is_held_by_the_connection_inside_the_block_and_released_after(
    engine: Engine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    with engine.connect() as connection:
        pid = backend_pid(connection)
        with advisory_lock(connection, name):
            inside = rows_for(pg_admin, name)
        assert [(row.pid, row.granted) for row in inside] == [(pid, True)]
        assert rows_for(pg_admin, name) == []


def test_busy_lock_with_timeout_zero_is_not_acquired(
    engine: Engine, holder: Connection, name: str
) -> None:
    with advisory_lock(holder, name), engine.connect() as connection:
        lock = advisory_lock(connection, name, timeout=0)
        assert lock.acquire() is False
        assert not lock.held


def test_busy_lock_with_timeout_raises_lock_timeout_after_about_that_long(
    engine: Engine, holder: Connection, name: str
) -> None:
    timeout = 0.5
    with advisory_lock(holder, name), engine.connect() as connection:
        started = time.monotonic()
        with pytest.raises(LockTimeout), advisory_lock(connection, name, timeout=timeout):
            pass
        waited = time.monotonic() - started
    assert 0.8 * timeout <= waited <= timeout + 2


def test_transaction_lock_is_held_until_the_transaction_commits(
    engine: Engine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    with Session(engine) as session:
        with advisory_lock(session, name, transaction=True):
            pass
        held_after_block = rows_for(pg_admin, name)
        session.commit()
        assert len(held_after_block) == 1
        assert rows_for(pg_admin, name) == []


def test_transaction_lock_is_released_by_rollback(
    engine: Engine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    with engine.connect() as connection:
        lock = advisory_lock(connection, name, transaction=True)
        assert lock.acquire()
        held_before_rollback = rows_for(pg_admin, name)
        connection.rollback()
        assert len(held_before_rollback) == 1
        assert rows_for(pg_admin, name) == []


def test_timed_out_acquire_inside_a_transaction_leaves_it_usable(
    engine: Engine, holder: Connection, name: str
) -> None:
    with advisory_lock(holder, name), engine.connect() as connection:
        connection.execute(text("CREATE TEMPORARY TABLE work (n int)"))
        connection.execute(text("INSERT INTO work VALUES (1)"))
        with (
            pytest.raises(LockTimeout),
            advisory_lock(connection, name, timeout=0.2, transaction=True),
        ):
            pass
        connection.execute(text("INSERT INTO work VALUES (2)"))
        connection.commit()
        assert connection.execute(text("SELECT count(*) FROM work")).scalar_one() == 2


def test_timed_out_acquire_inside_a_transaction_restores_the_callers_lock_timeout(
    engine: Engine, holder: Connection, name: str
) -> None:
    with advisory_lock(holder, name), engine.connect() as connection:
        connection.execute(text("SET LOCAL lock_timeout = '7s'"))
        assert advisory_lock(connection, name, timeout=0.2, transaction=True).acquire() is False
        assert connection.execute(text("SHOW lock_timeout")).scalar_one() == "7s"


def test_release_after_the_backend_was_terminated_raises_lock_lost(
    engine: Engine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    with engine.connect() as connection:
        lock = advisory_lock(connection, name)
        assert lock.acquire()
        pg_admin.execute("SELECT pg_terminate_backend(%s)", [rows_for(pg_admin, name)[0].pid])
        with pytest.raises(LockLost):
            lock.release()
        assert connection.invalidated


def test_engine_lock_whose_backend_was_terminated_is_lost_and_its_connection_discarded(
    engine: Engine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    lock = advisory_lock(engine, name)
    assert lock.acquire()
    pg_admin.execute("SELECT pg_terminate_backend(%s)", [rows_for(pg_admin, name)[0].pid])
    with pytest.raises(LockLost):
        lock.release()
    # The pool must not hand out the dead connection: the next lock works at once.
    with advisory_lock(engine, name, timeout=0):
        assert len(rows_for(pg_admin, name)) == 1


def test_transaction_lock_retaken_after_its_savepoint_rolled_back_is_held_again(
    engine: Engine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    with engine.connect() as connection:
        savepoint = connection.begin_nested()
        assert advisory_lock(connection, name, transaction=True).acquire()
        savepoint.rollback()
        # The server released it with the savepoint; taking it again must reach the
        # server rather than count as re-entry into a lock that is gone.
        assert advisory_lock(connection, name, transaction=True).acquire()
        assert len(rows_for(pg_admin, name)) == 1
