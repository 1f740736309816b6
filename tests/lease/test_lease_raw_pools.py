"""Leases on psycopg_pool's pools (sync and async) and asyncpg's, on PostgreSQL (the
only database these pools speak to), where they lend or open connections.

A pool that lends a lease no connection: the library's error, as for an advisory lock on
that pool (tests/test_raw_postgres*.py), worded for a lease, naming it, and also the
pool's own class. A connection the lease opens itself (the renewer's, a release sent
anew) is made as the pool makes its own, whatever form the pool's settings take.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolClosed, PoolTimeout

from advisory_locks import AdvisoryLockError, LockUsageError, lease_lock
from advisory_locks.asyncpg import LockPoolClosed as AsyncpgPoolClosed
from advisory_locks.psycopg_pool import LockConnectionTimeout, LockPoolClosed
from tests.helpers import assert_refused_by_an_asyncpg_pool, wait_for
from tests.lease.conftest import LeaseDatabase
from tests.lease.test_lease_locks import unique

pytestmark = pytest.mark.parametrize("lease_db", ["postgresql"], indirect=True)

# How long the exhausted pools below wait for a connection before they give up.
POOL_TIMEOUT_SECONDS = 0.2


def dsn_of(lease_db: LeaseDatabase) -> str:
    return lease_db.url.set(drivername="postgresql").render_as_string(hide_password=False)


def assert_refused_for_want_of_a_connection(error: BaseException, name: str) -> None:
    assert isinstance(error, LockConnectionTimeout)
    assert isinstance(error, PoolTimeout)  # psycopg_pool's own class, too
    assert isinstance(error, AdvisoryLockError)
    assert type(error.__cause__) is PoolTimeout
    assert error.name == name
    message = str(error)
    assert message.startswith("a lease lock needed a connection from the psycopg_pool pool")
    assert "timeout=0.2 s, max_size=1" in message
    assert "A held lease keeps no connection" in message


def assert_refused_by_a_closed_pool(error: BaseException, name: str) -> None:
    assert isinstance(error, LockPoolClosed)
    assert isinstance(error, PoolClosed)
    assert isinstance(error, LockUsageError)
    assert type(error.__cause__) is PoolClosed
    assert error.name == name
    assert str(error).startswith("a lease lock needs a connection from the psycopg_pool pool")


def test_a_lease_on_an_exhausted_or_closed_psycopg_pool_is_refused_with_the_librarys_errors(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    pool = ConnectionPool(
        dsn_of(lease_db), min_size=1, max_size=1, timeout=POOL_TIMEOUT_SECONDS, open=True
    )
    try:
        lease = lease_lock(pool, name, ttl=30, timeout=0)
        with pool.connection(), pytest.raises(LockConnectionTimeout) as exhausted:
            lease.acquire()
        assert_refused_for_want_of_a_connection(exhausted.value, name)
        assert not lease.held
        assert lease_db.row(lease.lease_name) is None
        with lease:  # a pool with room lends the same object a connection
            assert lease.held
    finally:
        pool.close()
    with pytest.raises(LockPoolClosed) as closed:
        lease.acquire()
    assert_refused_by_a_closed_pool(closed.value, name)


async def test_a_lease_on_an_exhausted_or_closed_async_psycopg_pool_is_refused_likewise(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    pool = AsyncConnectionPool(
        dsn_of(lease_db), min_size=1, max_size=1, timeout=POOL_TIMEOUT_SECONDS, open=False
    )
    await pool.open(wait=True)
    try:
        lease = lease_lock(pool, name, ttl=30, timeout=0)
        async with pool.connection():
            with pytest.raises(LockConnectionTimeout) as exhausted:
                await lease.acquire()
        assert_refused_for_want_of_a_connection(exhausted.value, name)
        assert not lease.held
        async with lease:
            assert lease.held
    finally:
        await pool.close()
    with pytest.raises(LockPoolClosed) as closed:
        await lease.acquire()
    assert_refused_by_a_closed_pool(closed.value, name)


async def test_a_lease_on_an_asyncpg_pool_not_awaited_yet_or_closed_is_lock_pool_closed(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    pool = asyncpg.create_pool(dsn_of(lease_db), min_size=1, max_size=1)  # not awaited
    lease = lease_lock(pool, name, ttl=30, timeout=0)
    with pytest.raises(AsyncpgPoolClosed) as not_initialized:
        await lease.acquire()
    assert_refused_by_an_asyncpg_pool(
        not_initialized.value,
        name,
        "a lease lock needs a connection from an asyncpg pool that is not initialized yet: "
        "pool is not initialized. Take locks on a pool once `await "
        "asyncpg.create_pool(...)` (or `await pool`) has returned.",
    )
    await pool
    try:
        async with lease:
            assert lease.held
    finally:
        await pool.close()
    with pytest.raises(AsyncpgPoolClosed) as closed:
        await lease.acquire()
    assert_refused_by_an_asyncpg_pool(
        closed.value,
        name,
        "a lease lock needs a connection from an asyncpg pool that is closed or closing: "
        "pool is closed. Take locks on a pool before its close().",
    )


def test_a_lease_released_while_its_psycopg_pool_lends_nothing_raises_the_refusal_once(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    with ConnectionPool(
        dsn_of(lease_db), min_size=1, max_size=1, timeout=POOL_TIMEOUT_SECONDS, open=True
    ) as pool:
        lease = lease_lock(pool, name, ttl=30)
        assert lease.acquire()
        with pool.connection():  # the pool's only connection
            started = time.monotonic()
            with pytest.raises(LockConnectionTimeout) as raised:
                lease.release()
            waited = time.monotonic() - started
        assert_refused_for_want_of_a_connection(raised.value, name)
        assert waited < POOL_TIMEOUT_SECONDS * 2  # asked once: no connection died
        assert not lease.lost.is_set()


def test_a_lease_released_after_a_restart_ended_every_connection_of_its_psycopg_pool(
    lease_db: LeaseDatabase,
) -> None:
    """psycopg_pool keeps its idle connections until they are used: all dead after a
    restart. The release, having met one, is sent on a connection opened for it."""
    name = unique()
    with ConnectionPool(dsn_of(lease_db), min_size=3, max_size=3, timeout=10, open=True) as pool:
        pool.wait()
        lease = lease_lock(pool, name, ttl=30)
        assert lease.acquire()
        checked_out = [pool.getconn() for _ in range(3)]
        session_ids = [connection.info.backend_pid for connection in checked_out]
        for connection in checked_out:
            pool.putconn(connection)
        for session_id in session_ids:
            lease_db.end_session(session_id)
        lease.release()
        row = lease_db.row(lease.lease_name)
        assert row is not None
        assert row.holder is None
        assert not lease.lost.is_set()


def test_a_lease_on_a_psycopg_pool_with_functions_for_settings_renews_as_the_pool_connects(
    lease_db: LeaseDatabase,
) -> None:
    """psycopg_pool 3.3 takes functions for ``conninfo`` and ``kwargs`` (credentials
    fetched per connection) and runs ``configure`` on each new connection: the
    renewer's connection is made the same way."""
    configured: list[int] = []

    def configure(connection: Any) -> None:
        configured.append(connection.info.backend_pid)
        connection.autocommit = False  # the application's mode, which the lease switches

    with ConnectionPool(
        lambda: dsn_of(lease_db),
        kwargs=lambda: {"connect_timeout": 10},
        configure=configure,
        min_size=1,
        max_size=1,
        open=True,
    ) as pool:
        pool.wait()
        lease = lease_lock(pool, unique(), ttl=3, renew_every=0.5, timeout=0)
        assert lease.acquire()
        renewed = lease_db.row(lease.lease_name).renewed_at  # type: ignore[union-attr]
        wait_for(
            lambda: lease_db.row(lease.lease_name).renewed_at != renewed,  # type: ignore[union-attr]
            "the renewer renewed the lease on a connection of its own",
        )
        assert len(configured) >= 2  # the pool's one connection, and the renewer's
        lease.release()
        assert not lease.lost.is_set()


async def test_a_lease_on_an_async_psycopg_pool_with_coroutines_for_settings_renews_likewise(
    lease_db: LeaseDatabase,
) -> None:
    configured: list[int] = []

    async def conninfo() -> str:
        return dsn_of(lease_db)

    async def configure(connection: Any) -> None:
        configured.append(connection.info.backend_pid)
        await connection.set_autocommit(False)  # the application's mode

    pool = AsyncConnectionPool(conninfo, configure=configure, min_size=1, max_size=1, open=False)
    await pool.open(wait=True)
    try:
        lease = lease_lock(pool, unique(), ttl=3, renew_every=0.5, timeout=0)
        assert await lease.acquire()
        renewed = lease_db.row(lease.lease_name).renewed_at  # type: ignore[union-attr]
        deadline = time.monotonic() + 20
        while lease_db.row(lease.lease_name).renewed_at == renewed:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the renewer never renewed the lease"
            await asyncio.sleep(0.05)
        assert len(configured) >= 2
        await lease.release()
        assert not lease.lost.is_set()
    finally:
        await pool.close()


def test_a_lease_statement_interrupted_while_its_pool_connection_is_put_back_leaks_nothing(
    lease_db: LeaseDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interruption while the lease puts a pooled connection's mode back: it goes on
    up, and the pool has a connection to lend all the same, not one left in the lease's
    mode."""
    from advisory_locks._bindings import raw_lease

    def interrupted(connection: Any, previous: Any) -> None:
        raise KeyboardInterrupt

    with ConnectionPool(dsn_of(lease_db), min_size=1, max_size=1, timeout=10, open=True) as pool:
        pool.wait()
        lease = lease_lock(pool, unique(), ttl=30, timeout=0)
        monkeypatch.setattr(raw_lease, "restore_driver_autocommit", interrupted)
        with pytest.raises(KeyboardInterrupt):
            lease.acquire()
        monkeypatch.undo()
        with pool.connection(timeout=10) as connection:
            assert not connection.autocommit
