"""The Session classes: ``session.advisory_lock(...)`` through sessionmaker, the mixin,
and a Session bound to a caller's Connection (the test-fixture pattern)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from advisory_locks import AdvisoryLock, AsyncAdvisoryLock, current_advisory_locks
from advisory_locks.keys import LockName, derive_key
from advisory_locks.sqlalchemy import (
    AdvisoryLockSession,
    AdvisoryLockSessionMixin,
    AsyncAdvisoryLockSession,
)
from tests.databases import AdvisoryLockRow, PostgresDriver, advisory_locks_held


class ShopSession(AdvisoryLockSessionMixin, Session):
    """A user's own Session subclass, as an application would declare it."""

    def backend_pid(self) -> int:
        return int(self.execute(text("SELECT pg_backend_pid()")).scalar_one())


@pytest.fixture
def name() -> str:
    return f"test_session_classes-{uuid.uuid4()}"


@pytest.fixture
async def async_engine(
    postgres_url_for: Callable[[PostgresDriver], URL],
) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(postgres_url_for("asyncpg"))
    yield engine
    await engine.dispose()


@pytest.fixture
def outer_connection(pg_engine: Engine) -> Iterator[Connection]:
    """A connection in a transaction that the test rolls back, as test suites do."""
    with pg_engine.connect() as connection:
        connection.begin()
        yield connection
        connection.rollback()


def rows_for(admin: psycopg.Connection[TupleRow], name: LockName) -> list[AdvisoryLockRow]:
    classid, objid, objsubid = derive_key(name).pg_locks_ids()
    return [
        row
        for row in advisory_locks_held(admin)
        if (row.classid, row.objid, row.objsubid) == (classid, objid, objsubid)
    ]


def test_sessionmaker_with_advisory_lock_session_gives_sessions_an_advisory_lock_method(
    pg_engine: Engine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    make_session = sessionmaker(pg_engine, class_=AdvisoryLockSession)
    with make_session() as session:
        with session.advisory_lock(name):
            inside = rows_for(pg_admin, name)
        assert len(inside) == 1
        assert rows_for(pg_admin, name) == []


def test_mixin_adds_advisory_lock_to_a_users_own_session_class(
    pg_engine: Engine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    make_session = sessionmaker(pg_engine, class_=ShopSession)
    with make_session() as session:
        with session.advisory_lock(name, timeout=0):
            inside = rows_for(pg_admin, name)
        assert len(inside) == 1
        assert rows_for(pg_admin, name) == []


def test_mixin_session_passes_the_lock_options_through(
    pg_engine: Engine, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    with ShopSession(pg_engine) as session:
        lock = session.advisory_lock(name, shared=True, transaction=True)
        assert lock.acquire()
        pid = session.backend_pid()
        held = rows_for(pg_admin, name)
        session.commit()
        assert [(row.pid, row.mode) for row in held] == [(pid, "ShareLock")]
        assert rows_for(pg_admin, name) == []


def test_sync_session_advisory_lock_returns_an_advisory_lock(pg_engine: Engine, name: str) -> None:
    with AdvisoryLockSession(pg_engine) as session:
        assert isinstance(session.advisory_lock(name), AdvisoryLock)


async def test_async_session_advisory_lock_returns_an_async_advisory_lock(
    async_engine: AsyncEngine, name: str
) -> None:
    make_session = async_sessionmaker(async_engine, class_=AsyncAdvisoryLockSession)
    async with make_session() as session:
        assert isinstance(session.advisory_lock(name), AsyncAdvisoryLock)


async def test_async_sessions_sync_session_is_an_advisory_lock_session(
    async_engine: AsyncEngine, name: str
) -> None:
    # Code running in run_sync() sees the sync Session; it gets the method too.
    make_session = async_sessionmaker(async_engine, class_=AsyncAdvisoryLockSession)
    async with make_session() as session:
        assert isinstance(session.sync_session, AdvisoryLockSession)
        assert isinstance(session.sync_session.advisory_lock(name), AdvisoryLock)


def test_session_joined_to_an_external_transaction_locks_on_that_connection(
    outer_connection: Connection, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    pid = int(outer_connection.execute(text("SELECT pg_backend_pid()")).scalar_one())
    session = AdvisoryLockSession(bind=outer_connection, join_transaction_mode="create_savepoint")
    with session.advisory_lock(name):
        inside = rows_for(pg_admin, name)
    session.close()
    assert [(row.pid, row.granted) for row in inside] == [(pid, True)]
    assert rows_for(pg_admin, name) == []


def test_current_advisory_locks_of_a_joined_session_names_its_lock_before_any_statement(
    outer_connection: Connection, name: str
) -> None:
    session = AdvisoryLockSession(bind=outer_connection, join_transaction_mode="create_savepoint")
    with session.advisory_lock(name):
        assert current_advisory_locks(session) == [name]
    session.close()


def test_session_lock_on_a_joined_session_survives_its_commit_and_rollback(
    outer_connection: Connection, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    session = AdvisoryLockSession(bind=outer_connection, join_transaction_mode="create_savepoint")
    with session.advisory_lock(name):
        session.execute(text("SELECT 1"))
        session.commit()
        session.execute(text("SELECT 1"))
        session.rollback()
        inside = rows_for(pg_admin, name)
    session.close()
    assert len(inside) == 1
    assert rows_for(pg_admin, name) == []


def test_transaction_lock_on_a_joined_session_ends_with_the_sessions_savepoint(
    outer_connection: Connection, pg_admin: psycopg.Connection[TupleRow], name: str
) -> None:
    session = AdvisoryLockSession(bind=outer_connection, join_transaction_mode="create_savepoint")
    lock = session.advisory_lock(name, transaction=True)
    assert lock.acquire()
    held = rows_for(pg_admin, name)
    # The Session's "transaction" is a savepoint in the outer one; rolling it back is
    # where PostgreSQL releases a transaction lock taken inside it.
    session.rollback()
    assert len(held) == 1
    assert rows_for(pg_admin, name) == []
    assert not lock.held
    session.close()
