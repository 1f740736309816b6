"""psycopg 3 with ``prepare_threshold=0`` (every statement prepared), directly and through
PgBouncer's session pooling, sync and asyncio.

A prepared statement holds one command, so any script of several statements the library
sends (a wait inside the caller's transaction runs in a savepoint, in one round trip)
must never be prepared. What holds: every lock mode (session or transaction, shared or
exclusive, timeout ``None``/``0``/``t``) works through every bind, granted and busy,
idle and inside the caller's transaction, and a busy wait leaves that transaction usable.

PgBouncer here is 1.18, which cannot carry prepared statements across server
connections in transaction pooling (PgBouncer >= 1.21 with ``max_prepared_statements``
can): through transaction pooling no application can use ``prepare_threshold=0`` at all,
so session pooling is the PgBouncer shape tested.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from advisory_locks import advisory_lock
from tests.databases import PostgresDriver
from tests.faults.conftest import inject
from tests.faults.pgbouncer import SESSION_POOL
from tests.helpers import holder_pids, unique_name

pytestmark = pytest.mark.faults

Admin = psycopg.Connection[TupleRow]
EVERY_STATEMENT_PREPARED = {"prepare_threshold": 0}
SESSION_POOLER = {"advisory_locks_pooler": "session"}
TIMEOUTS = [None, 0, 0.5]
MODES = [
    pytest.param(
        scope, shared, timeout, id=f"{scope}-{'shared' if shared else 'exclusive'}-{timeout}"
    )
    for scope, shared, timeout in itertools.product(
        ["session", "transaction"], [False, True], TIMEOUTS
    )
]


@pytest.fixture(params=["direct", "pgbouncer-session-pooling"])
def prepared(
    request: pytest.FixtureRequest, make_engine: Callable[..., Engine], postgres_url: URL
) -> Engine:
    """An engine whose psycopg connections prepare every statement."""
    inject("prepare_threshold=0")
    if request.param == "direct":
        return make_engine(postgres_url, connect_args=EVERY_STATEMENT_PREPARED)
    bouncer = request.getfixturevalue("pgbouncer")
    return make_engine(
        bouncer.url(SESSION_POOL),
        connect_args=EVERY_STATEMENT_PREPARED,
        execution_options=SESSION_POOLER,
    )


@contextlib.contextmanager
def bind_in_state(kind: str, engine: Engine, *, in_transaction: bool) -> Iterator[Any]:
    if kind == "engine":
        yield engine
        return
    opened: Any
    with engine.connect() if kind == "connection" else Session(engine) as opened:
        if in_transaction:
            opened.execute(text("SELECT 1"))
        yield opened
        # The caller's transaction is still usable after the lock's statements.
        assert opened.execute(text("SELECT 1")).scalar_one() == 1
        opened.commit()


def cases() -> list[Any]:
    params = []
    for kind, in_transaction in (
        ("engine", False),
        *itertools.product(["connection", "session"], [False, True]),
    ):
        for mode in MODES:
            scope, shared, timeout = mode.values
            if kind == "engine" and scope == "transaction":
                continue
            state = "in-transaction" if in_transaction else "idle"
            params.append(
                pytest.param(
                    kind, in_transaction, scope, shared, timeout, id=f"{kind}-{state}-{mode.id}"
                )
            )
    return params


@pytest.mark.parametrize(("kind", "in_transaction", "scope", "shared", "timeout"), cases())
def test_every_lock_mode_works_with_every_statement_prepared(
    kind: str,
    in_transaction: bool,
    scope: str,
    shared: bool,
    timeout: float | None,
    prepared: Engine,
    pg_admin: Admin,
) -> None:
    name = unique_name()
    transaction = scope == "transaction"
    with bind_in_state(kind, prepared, in_transaction=in_transaction) as bind:
        with advisory_lock(bind, name, shared=shared, timeout=timeout, transaction=transaction):
            assert len(holder_pids(pg_admin, name)) == 1
        if transaction:
            bind.commit()
        assert holder_pids(pg_admin, name) == []


@pytest.mark.parametrize(
    ("kind", "in_transaction", "scope", "shared", "timeout"),
    [case for case in cases() if case.values[4] is not None],
)
def test_busy_lock_is_refused_with_every_statement_prepared(
    kind: str,
    in_transaction: bool,
    scope: str,
    shared: bool,
    timeout: float | None,
    prepared: Engine,
    postgres_url: URL,
    make_engine: Callable[..., Engine],
) -> None:
    name = unique_name()
    holder = make_engine(postgres_url)
    with (
        advisory_lock(holder, name),
        bind_in_state(kind, prepared, in_transaction=in_transaction) as bind,
    ):
        lock = advisory_lock(
            bind, name, shared=shared, timeout=timeout, transaction=scope == "transaction"
        )
        assert lock.acquire() is False


# -- asyncio: SQLAlchemy's adapter of psycopg's AsyncConnection ------------------------------


@pytest.fixture
async def async_prepared(
    postgres_url_for: Callable[[PostgresDriver], URL],
) -> AsyncIterator[AsyncEngine]:
    inject("prepare_threshold=0")
    engine = create_async_engine(
        postgres_url_for("psycopg_async"), connect_args=EVERY_STATEMENT_PREPARED
    )
    yield engine
    await engine.dispose()


ASYNC_CASES = [
    pytest.param(kind, *mode.values, id=f"{kind}-{mode.id}")
    for kind in ("engine", "connection", "session")
    for mode in MODES
    if not (kind == "engine" and mode.values[0] == "transaction")
]


@pytest.mark.parametrize(("kind", "scope", "shared", "timeout"), ASYNC_CASES)
async def test_every_lock_mode_works_with_every_statement_prepared_on_asyncio(
    kind: str,
    scope: str,
    shared: bool,
    timeout: float | None,
    async_prepared: AsyncEngine,
    pg_admin: Admin,
) -> None:
    name = unique_name()
    if kind == "engine":
        async with advisory_lock(async_prepared, name, shared=shared, timeout=timeout):
            assert len(holder_pids(pg_admin, name)) == 1
        assert holder_pids(pg_admin, name) == []
        return
    opened = async_prepared.connect() if kind == "connection" else AsyncSession(async_prepared)
    async with opened as bind:
        await bind.execute(text("SELECT 1"))
        transaction = scope == "transaction"
        async with advisory_lock(
            bind, name, shared=shared, timeout=timeout, transaction=transaction
        ):
            assert len(holder_pids(pg_admin, name)) == 1
        assert (await bind.execute(text("SELECT 1"))).scalar_one() == 1
        await bind.commit()
    assert holder_pids(pg_admin, name) == []
