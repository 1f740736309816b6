"""Locks through a real PgBouncer, in transaction and in session pooling.

Transaction pooling hands each transaction whatever server connection is free, so a
session lock would stay behind on a server connection other clients then use: the
library refuses session locks there, pointing to ``transaction=True``. Transaction locks
live and die with a transaction, which the pooler never splits, so they exclude. Session
pooling pins a client to one server connection: declared, it works like a direct one.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import TupleRow
from sqlalchemy import Engine, text

from advisory_locks import (
    LockTimeout,
    UnsupportedFeature,
    advisory_lock,
    advisory_lock_set,
)
from tests.faults.conftest import inject
from tests.faults.pgbouncer import (
    SERVER_CONNECTIONS,
    SESSION_POOL,
    TRANSACTION_POOL,
    PgBouncer,
    required_by,
)
from tests.helpers import (
    advisory_statements,
    holder_pids,
    open_bind,
    record_statements,
    unique_name,
)

pytestmark = pytest.mark.faults

Admin = psycopg.Connection[TupleRow]
BINDS = ["engine", "connection", "session"]
CLIENTS = 50
INCREMENTS_PER_CLIENT = 10
JOIN_SECONDS = 120.0
SESSION_POOLER = {"advisory_locks_pooler": "session"}


@pytest.fixture
def through(pgbouncer: PgBouncer, make_engine: Callable[..., Engine]) -> Callable[..., Engine]:
    """An engine that reaches the server through one of PgBouncer's pools."""

    def make(pool: str, **options: Any) -> Engine:
        inject(f"PgBouncer {pool.removeprefix('advisory_locks_')} pooling")
        # psycopg prepares statements it runs often; PgBouncer before 1.21 cannot carry
        # them across server connections in transaction pooling.
        options.setdefault("connect_args", {"prepare_threshold": None})
        return make_engine(pgbouncer.url(pool), **options)

    return make


@pytest.fixture
def counter_table(pg_admin: Admin) -> Iterator[str]:
    name = f"advisory_locks_counter_{uuid.uuid4().hex}"
    identifier = sql.Identifier(name)
    pg_admin.execute(sql.SQL("CREATE TABLE {} (value integer NOT NULL)").format(identifier))
    pg_admin.execute(sql.SQL("INSERT INTO {} (value) VALUES (0)").format(identifier))
    yield name
    pg_admin.execute(sql.SQL("DROP TABLE {}").format(identifier))


# -- transaction pooling -------------------------------------------------------------------


@pytest.mark.parametrize("kind", BINDS)
def test_session_lock_through_a_transaction_pooler_is_refused_pointing_to_transaction_true(
    kind: str, through: Callable[..., Engine], pg_admin: Admin
) -> None:
    name = unique_name()
    with (
        open_bind(kind, through(TRANSACTION_POOL)) as bind,
        pytest.raises(UnsupportedFeature, match="transaction=True"),
    ):
        advisory_lock(bind, name).acquire()
    assert holder_pids(pg_admin, name) == []


def test_session_lock_refused_through_a_transaction_pooler_sends_no_lock_sql(
    through: Callable[..., Engine],
) -> None:
    engine = through(TRANSACTION_POOL)
    statements = record_statements(engine)
    with engine.connect() as connection, pytest.raises(UnsupportedFeature):
        advisory_lock(connection, unique_name()).acquire()
    assert advisory_statements(statements) == []


def test_declared_transaction_pooler_refuses_session_locks_before_any_sql(
    make_engine: Callable[..., Engine],
) -> None:
    # Declared, even a direct engine refuses: the declaration is for the deployment.
    engine = make_engine(execution_options={"advisory_locks_pooler": "transaction"})
    statements = record_statements(engine)
    with engine.connect() as connection, pytest.raises(UnsupportedFeature, match="declares"):
        advisory_lock(connection, unique_name()).acquire()
    assert statements == []


def test_unknown_pooler_declaration_raises_value_error(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(execution_options={"advisory_locks_pooler": "statement"})
    with engine.connect() as connection, pytest.raises(ValueError, match="advisory_locks_pooler"):
        advisory_lock(connection, unique_name()).acquire()


def test_transaction_lock_through_a_transaction_pooler_excludes_another_client(
    through: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine = through(TRANSACTION_POOL)
    name = unique_name()
    with engine.connect() as holder, holder.begin():
        advisory_lock(holder, name, transaction=True).acquire()
        with engine.connect() as rival, rival.begin():
            assert advisory_lock(rival, name, transaction=True, timeout=0).acquire() is False
    assert holder_pids(pg_admin, name) == []


def test_transaction_lock_wait_through_a_transaction_pooler_times_out_cleanly(
    through: Callable[..., Engine],
) -> None:
    engine = through(TRANSACTION_POOL)
    name = unique_name()
    with engine.connect() as holder, holder.begin():
        advisory_lock(holder, name, transaction=True).acquire()
        with engine.connect() as rival, rival.begin():
            with (
                pytest.raises(LockTimeout),
                advisory_lock(rival, name, transaction=True, timeout=0.2),
            ):
                pass
            # The wait ran in a savepoint: the rival's transaction is still usable.
            assert rival.scalar(text("SELECT 1")) == 1


def test_transaction_lock_set_through_a_transaction_pooler_holds_every_lock(
    through: Callable[..., Engine], pg_admin: Admin
) -> None:
    names = [unique_name(), unique_name()]
    with (
        through(TRANSACTION_POOL).connect() as connection,
        connection.begin(),
        advisory_lock_set(connection, names, transaction=True) as locks,
    ):
        locks.ensure_held()
        assert all(holder_pids(pg_admin, name) for name in names)


def test_fifty_clients_through_a_transaction_pooler_lose_no_update_under_transaction_locks(
    through: Callable[..., Engine], counter_table: str, pg_admin: Admin
) -> None:
    engine = through(TRANSACTION_POOL, pool_size=CLIENTS, max_overflow=0)
    name = unique_name()
    table = sql.Identifier(counter_table).as_string(pg_admin)
    start = threading.Barrier(CLIENTS, timeout=JOIN_SECONDS)
    server_pids: set[int] = set()
    errors: list[BaseException] = []

    def client() -> None:
        try:
            with engine.connect() as connection:
                start.wait()
                for _ in range(INCREMENTS_PER_CLIENT):
                    with connection.begin():
                        advisory_lock(connection, name, transaction=True).acquire()
                        value = connection.scalar(text(f"SELECT value FROM {table}"))
                        server_pids.add(connection.scalar(text("SELECT pg_backend_pid()")))
                        connection.execute(
                            text(f"UPDATE {table} SET value = :value"), {"value": value + 1}
                        )
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_SECONDS)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    row = pg_admin.execute(sql.SQL("SELECT value FROM {}").format(sql.Identifier(counter_table)))
    assert row.fetchone() == (CLIENTS * INCREMENTS_PER_CLIENT,)
    # The pooler really multiplexed: 50 clients ran on at most its pool of servers.
    assert 1 <= len(server_pids) <= SERVER_CONNECTIONS


# -- session pooling -----------------------------------------------------------------------


def test_session_lock_through_an_undeclared_session_pooler_is_refused_with_the_way_out(
    through: Callable[..., Engine],
) -> None:
    # The library cannot tell session pooling from transaction pooling on its own.
    with (
        through(SESSION_POOL).connect() as connection,
        pytest.raises(UnsupportedFeature, match="advisory_locks_pooler': 'session'"),
    ):
        advisory_lock(connection, unique_name()).acquire()


@pytest.mark.parametrize("kind", BINDS)
def test_session_locks_through_a_declared_session_pooler_exclude_like_direct_ones(
    kind: str, through: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine = through(SESSION_POOL, execution_options=SESSION_POOLER)
    name = unique_name()
    with open_bind(kind, engine) as bind, advisory_lock(bind, name) as lock:
        lock.ensure_held()
        assert len(holder_pids(pg_admin, name)) == 1
        with engine.connect() as rival:
            assert advisory_lock(rival, name, timeout=0).acquire() is False
    assert holder_pids(pg_admin, name) == []


def test_session_lock_through_a_declared_session_pooler_survives_commit(
    through: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine = through(SESSION_POOL, execution_options=SESSION_POOLER)
    name = unique_name()
    with engine.connect() as connection, advisory_lock(connection, name) as lock:
        (pid,) = holder_pids(pg_admin, name)
        connection.execute(text("SELECT 1"))
        connection.commit()
        lock.ensure_held()
        assert holder_pids(pg_admin, name) == [pid]


# -- when PgBouncer is required --------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "required"),
    [
        ({}, False),
        ({"CI": "true"}, True),
        ({"CI": "true", "ADVISORY_LOCKS_REQUIRE_PGBOUNCER": "0"}, False),
        ({"ADVISORY_LOCKS_REQUIRE_PGBOUNCER": "1"}, True),
    ],
)
def test_pgbouncer_is_required_in_ci_or_when_asked(environ: dict[str, str], required: bool) -> None:
    assert (required_by(environ) is not None) is required
