"""Lease locks through a real PgBouncer in transaction pooling (issue 13, item 5).

A lease needs no session state: each statement is its own transaction, so any server
connection the pooler hands out will do. Many processes incrementing one counter under a
lease lose no update; holding a lease pins no pooled connection; and since a LISTEN
through a transaction pooler would sit on a server connection other clients then get,
waiters on an Engine declared behind one poll instead, and still get the lease.
"""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import TupleRow
from sqlalchemy import Engine, create_engine, event, text

from advisory_locks import lease_lock
from advisory_locks._bindings.sqlalchemy_lease import lease_site
from advisory_locks.sqlalchemy import create_lease_table
from tests.faults.conftest import inject
from tests.faults.pgbouncer import SERVER_CONNECTIONS, TRANSACTION_POOL, PgBouncer
from tests.helpers import wait_for
from tests.lease.workers import increment_through_pooler

pytestmark = pytest.mark.faults

Admin = psycopg.Connection[TupleRow]
SPAWN = multiprocessing.get_context("spawn")
PROCESSES = 8
INCREMENTS = 10
JOIN_SECONDS = 240.0
TRANSACTION_POOLER = {"advisory_locks_pooler": "transaction"}


@pytest.fixture
def pooled(pgbouncer: PgBouncer, postgres_url: Any) -> Iterator[Callable[..., Engine]]:
    """Engines through PgBouncer's transaction pool, declared as such (the lease table is
    created directly on the server first)."""
    direct = create_engine(postgres_url)
    create_lease_table(direct)
    direct.dispose()
    engines: list[Engine] = []

    def make(**options: Any) -> Engine:
        inject("PgBouncer transaction pooling")
        options.setdefault("connect_args", {"prepare_threshold": None})
        options.setdefault("execution_options", TRANSACTION_POOLER)
        engine = create_engine(pgbouncer.url(TRANSACTION_POOL), **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.dispose()


@pytest.fixture
def counter_table(pg_admin: Admin) -> Iterator[str]:
    name = f"advisory_locks_counter_{uuid.uuid4().hex}"
    identifier = sql.Identifier(name)
    pg_admin.execute(sql.SQL("CREATE TABLE {} (value integer NOT NULL)").format(identifier))
    pg_admin.execute(sql.SQL("INSERT INTO {} (value) VALUES (0)").format(identifier))
    yield name
    pg_admin.execute(sql.SQL("DROP TABLE {}").format(identifier))


def test_processes_through_a_transaction_pooler_lose_no_update_under_a_lease(
    pgbouncer: PgBouncer, pooled: Callable[..., Engine], counter_table: str, pg_admin: Admin
) -> None:
    pooled()  # creates the table
    url = pgbouncer.url(TRANSACTION_POOL).render_as_string(hide_password=False)
    name = f"pgbouncer-lease:{uuid.uuid4()}"
    start = SPAWN.Event()
    report = SPAWN.Queue()
    workers = [
        SPAWN.Process(
            target=increment_through_pooler,
            args=(url, name, counter_table, INCREMENTS, start, report),
        )
        for _ in range(PROCESSES)
    ]
    for worker in workers:
        worker.start()
    start.set()
    results = [report.get(timeout=JOIN_SECONDS) for _ in workers]
    for worker in workers:
        worker.join(JOIN_SECONDS)
    assert [worker.exitcode for worker in workers] == [0] * PROCESSES
    row = pg_admin.execute(sql.SQL("SELECT value FROM {}").format(sql.Identifier(counter_table)))
    assert row.fetchone() == (PROCESSES * INCREMENTS,)
    tokens = sorted(token for held, _pids, _listened in results for token in held)
    assert tokens == list(range(tokens[0], tokens[0] + PROCESSES * INCREMENTS))
    # No process LISTENed (its waiters polled), and the pooler really multiplexed.
    assert [listened for _held, _pids, listened in results] == [False] * PROCESSES
    server_pids = {pid for _held, pids, _listened in results for pid in pids}
    assert 1 <= len(server_pids) <= SERVER_CONNECTIONS


def _renewed_at(admin: Admin, name: str) -> datetime:
    row = admin.execute(
        "SELECT renewed_at FROM advisory_locks_lease WHERE name = %s", (name,)
    ).fetchone()
    assert row is not None
    value: datetime = row[0]
    return value


def test_holding_a_lease_through_a_transaction_pooler_pins_no_pooled_connection(
    pooled: Callable[..., Engine], pg_admin: Admin
) -> None:
    # One pooled connection, no overflow: if the lease kept it, the app could not query.
    engine = pooled(pool_size=1, max_overflow=0, pool_timeout=5)
    name = f"pgbouncer-lease:{uuid.uuid4()}"
    with lease_lock(engine, name, ttl=3, renew_every=0.5, timeout=0) as lease:
        for _ in range(3):
            seen = _renewed_at(pg_admin, name)
            wait_for(
                lambda seen=seen: _renewed_at(pg_admin, name) > seen,  # type: ignore[misc]
                "the renewer renewed it",
            )
            assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
            with engine.connect() as connection:
                assert connection.scalar(text("SELECT 1")) == 1
        lease.ensure_held()
        with engine.begin() as connection:
            lease.fence(connection)
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_a_waiter_through_a_transaction_pooler_polls_and_gets_the_released_lease(
    pooled: Callable[..., Engine],
) -> None:
    holder_engine = pooled()
    waiter_engine = pooled()
    assert lease_site(waiter_engine).release_listener() is None  # no LISTEN there
    attempts: list[int] = []
    event.listen(waiter_engine, "checkin", lambda *_: attempts.append(1))
    name = f"pgbouncer-lease:{uuid.uuid4()}"
    holder = lease_lock(holder_engine, name, ttl=60, timeout=0)
    assert holder.acquire()
    granted: list[int | None] = []

    def wait() -> None:
        with lease_lock(waiter_engine, name, ttl=60, timeout=120) as lease:
            granted.append(lease.token)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    # Each attempt borrows a pooled connection and gives it back: once one came back,
    # the waiter has found the lease held and sleeps until it polls again.
    wait_for(lambda: bool(attempts), "the waiter made its first attempt")
    holder.release()
    waiter.join(JOIN_SECONDS)
    assert not waiter.is_alive()
    assert granted == [(holder.token or 0) + 1]
    # The failed attempt, the one that took it, and the release at the block's end.
    assert len(attempts) >= 3
    assert lease_site(waiter_engine)._listener is None
