"""Soak: thousands of random lock operations across threads on one small pool.

Acquire/release, timeouts, exceptions inside blocks, commit and rollback inside blocks,
nesting, transaction locks, savepoints, lock sets, on Engine, Connection and Session
binds. Afterwards no connection of the pool holds an advisory lock, and a counter that
every thread incremented under the lock lost no update.

PostgreSQL runs the full mix; MariaDB and SQLite, which refuse transaction locks, run
the rest of it with a fifth of the operations (``SMALL_OPERATIONS``), to keep CI short.
Afterwards MariaDB's ``IS_USED_LOCK()`` names no holder for any name used, and every
SQLite lock file can be locked exclusively.

Seeded and sized by environment variables, so a long local run is one command away::

    ADVISORY_LOCKS_SOAK_OPERATIONS=100000 ADVISORY_LOCKS_SOAK_SEED=7 \
        pytest tests/faults/test_soak.py
"""

from __future__ import annotations

import os
import random
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.orm import Session

from advisory_locks import LockNotAcquired, advisory_lock, advisory_lock_set
from tests.faults.conftest import finish_soak
from tests.faults.servers import FaultDatabase
from tests.helpers import engine_backends_with_advisory_locks, open_bind, unique_name

pytestmark = [pytest.mark.faults, pytest.mark.slow]

Admin = psycopg.Connection[TupleRow]
OPERATIONS = int(os.environ.get("ADVISORY_LOCKS_SOAK_OPERATIONS", "10000"))
SMALL_OPERATIONS = OPERATIONS // 5  # MariaDB and SQLite
SEED = int(os.environ.get("ADVISORY_LOCKS_SOAK_SEED", "20261121"))
THREADS = 6
# Each operation uses at most two pooled connections, so with more than THREADS slots
# some thread can always get one: the pool itself cannot deadlock.
POOL_SIZE, MAX_OVERFLOW = 4, 4
TIMEOUTS = [0, 0.01, 0.2]
JOIN_SECONDS = 600.0


class Boom(Exception):
    """Raised inside lock blocks on purpose."""


class RandomMix:
    """A seeded mix of operations and the tally of their outcomes (every soak's loop)."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.increments = 0
        self.mutex = threading.Lock()

    def record(self, outcome: str, increments: int = 0) -> None:
        with self.mutex:
            self.outcomes[outcome] += 1
            self.increments += increments

    def operations(self) -> list[Callable[[random.Random], str]]:
        """The operations to pick from; each returns the outcome to record, or ""."""
        raise NotImplementedError

    def run_share(self, index: int, threads: int, planned: int) -> None:
        """Thread ``index``'s part of ``planned`` operations over ``threads``, seeded."""
        share = planned // threads + (index < planned % threads)
        self.run(random.Random(SEED * 1000 + index), share)

    def run(self, rng: random.Random, count: int) -> None:
        operations = self.operations()
        for _ in range(count):
            operation = rng.choice(operations)
            try:
                outcome = operation(rng)
            except Boom:
                self.record(f"exception in {operation.__name__} block")
            except LockNotAcquired:
                self.record(f"{operation.__name__} busy or timed out")
            else:
                if outcome:
                    self.record(outcome)


class Soak(RandomMix):
    def __init__(self, engine: Engine, table: str, *, transaction_locks: bool) -> None:
        super().__init__()
        self.engine = engine
        self.transaction_locks = transaction_locks
        self.names = [unique_name(f"soak-{index}") for index in range(6)]
        self.counter_name = unique_name("soak-counter")
        self.select = text(f"SELECT value FROM {table}")
        self.update = text(f"UPDATE {table} SET value = :value")
        self.counter_waits = 0  # increments that found the counter's lock taken

    # -- operations; each returns the outcome it recorded ---------------------------------

    def session_lock(self, rng: random.Random) -> str:
        kind = rng.choice(["engine", "connection", "session"])
        name = rng.choice(self.names)
        with (
            open_bind(kind, self.engine) as bind,
            advisory_lock(bind, name, timeout=rng.choice(TIMEOUTS)) as lock,
        ):
            if kind != "engine" and rng.random() < 0.3:
                nested = advisory_lock(bind, name, timeout=0)
                assert nested.acquire(), "a re-entrant acquire must be granted"
                lock.ensure_held()
                nested.release()
            if isinstance(bind, (Connection, Session)) and rng.random() < 0.4:
                bind.execute(text("SELECT 1"))
                bind.commit() if rng.random() < 0.5 else bind.rollback()
            if rng.random() < 0.2:
                raise Boom
        return f"session lock on {kind}"

    def transaction_lock(self, rng: random.Random) -> str:
        kind = rng.choice(["connection", "session"])
        outcome = f"transaction lock on {kind}"
        with open_bind(kind, self.engine) as bind:
            assert isinstance(bind, (Connection, Session))
            timeout = rng.choice(TIMEOUTS)
            if not advisory_lock(
                bind, rng.choice(self.names), transaction=True, timeout=timeout
            ).acquire():
                raise LockNotAcquired("busy")
            if rng.random() < 0.4:
                savepoint = bind.begin_nested()
                granted = advisory_lock(
                    bind, rng.choice(self.names), transaction=True, timeout=0
                ).acquire()
                savepoint.rollback() if rng.random() < 0.5 else savepoint.commit()
                outcome += f", savepoint ({'granted' if granted else 'busy'})"
            if rng.random() < 0.2:
                raise Boom
            bind.commit() if rng.random() < 0.5 else bind.rollback()
        return outcome

    def lock_set(self, rng: random.Random) -> str:
        kind = rng.choice(["engine", "connection", "session"])
        names = rng.sample(self.names, rng.randint(2, 3))
        with (
            open_bind(kind, self.engine) as bind,
            advisory_lock_set(bind, names, timeout=rng.choice(TIMEOUTS)) as locks,
        ):
            locks.ensure_held()
        return f"lock set on {kind}"

    def increment(self, rng: random.Random) -> str:
        if self.transaction_locks and rng.random() < 0.5:
            # Transaction lock: read and write in the transaction that holds it.
            with self.engine.connect() as connection, connection.begin():
                advisory_lock(connection, self.counter_name, transaction=True).acquire()
                value = connection.scalar(self.select)
                connection.execute(self.update, {"value": value + 1})
            self.record("counter incremented under a transaction lock", increments=1)
            return ""
        # Session lock: read and write in separate transactions; only the lock keeps
        # another thread from writing in between.
        with Session(self.engine) as session:
            lock = advisory_lock(session, self.counter_name, timeout=0)
            if not lock.acquire():
                # Counted, so a run shows the lock really kept writers apart.
                with self.mutex:
                    self.counter_waits += 1
                lock = advisory_lock(session, self.counter_name)
                lock.acquire()
            try:
                value = session.scalar(self.select)
                session.commit()
                session.execute(self.update, {"value": value + 1})
                session.commit()
            finally:
                lock.release()
        self.record("counter incremented under a session lock", increments=1)
        return ""

    def operations(self) -> list[Callable[[random.Random], str]]:
        operations = [self.session_lock, self.lock_set, self.increment]
        if self.transaction_locks:
            operations.append(self.transaction_lock)
        return operations


@pytest.fixture
def counter_table(database: FaultDatabase) -> Iterator[str]:
    name = f"advisory_locks_soak_{uuid.uuid4().hex}"  # a plain identifier everywhere
    engine = create_engine(database.url)
    with engine.begin() as connection:
        connection.execute(text(f"CREATE TABLE {name} (value integer NOT NULL)"))
        connection.execute(text(f"INSERT INTO {name} VALUES (0)"))
    yield name
    with engine.begin() as connection:
        connection.execute(text(f"DROP TABLE {name}"))
    engine.dispose()


def test_soak_leaves_no_lock_held_and_loses_no_update(
    make_engine: Callable[..., Engine],
    counter_table: str,
    database: FaultDatabase,
    request: pytest.FixtureRequest,
) -> None:
    on_postgres = database.name == "postgresql"
    application = f"advisory-locks-soak-{uuid.uuid4().hex[:12]}"
    engine = make_engine(
        database.url,
        pool_size=POOL_SIZE,
        max_overflow=MAX_OVERFLOW,
        pool_timeout=60,
        **({"connect_args": {"application_name": application}} if on_postgres else {}),
    )
    planned = OPERATIONS if on_postgres else SMALL_OPERATIONS
    soak = Soak(engine, counter_table, transaction_locks="transaction" not in database.refuses)
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS, timeout=60)

    def worker(index: int) -> None:
        try:
            start.wait()
            soak.run_share(index, THREADS, planned)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_SECONDS)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []

    # The pool's connections are still open: none of them may hold a lock.
    leaked: list[object] = list(database.leaked([*soak.names, soak.counter_name]))
    if on_postgres:
        admin: Admin = request.getfixturevalue("pg_admin")
        leaked += engine_backends_with_advisory_locks(admin, application)
    with engine.connect() as connection:
        counted = connection.scalar(soak.select)
    finish_soak(
        f"soak on {database.name} (seed {SEED}, {THREADS} threads, {soak.increments} "
        f"increments, {soak.counter_waits} waited for the counter's lock)",
        soak.outcomes,
        planned=planned,
        leaked=leaked,
        lost_updates=soak.increments - counted,
        waits=soak.counter_waits,
    )
