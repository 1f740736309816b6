"""Locks between operating-system processes, each with its own engine and connections.

Children are started with the ``spawn`` method, so they share nothing with the test
process but the database server and the multiprocessing events passed to them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import uuid
from collections.abc import Iterator
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Barrier, Event

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import TupleRow
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL

from advisory_locks import advisory_lock
from tests.helpers import BlockedWaiter, unique_name, wait_for, waiter_pids

SPAWN = multiprocessing.get_context("spawn")
# A spawned child imports SQLAlchemy and the library before it can do anything.
START_SECONDS = 60.0
JOIN_SECONDS = 60.0

Admin = psycopg.Connection[TupleRow]


# -- code that runs in the child processes -------------------------------------------------


def hold_lock(url: str, name: str, holding: Event, may_release: Event) -> None:
    """Take ``name``, say so, and keep it until told to release (or until killed)."""
    engine = create_engine(url)
    with engine.connect() as connection, advisory_lock(connection, name):
        holding.set()
        may_release.wait()
    engine.dispose()


def increment_counter(url: str, name: str, table: str, times: int, start: Barrier) -> None:
    """Read the counter, then write it back plus one, in separate transactions, under the lock.

    Without the lock, two processes reading the same value would lose an increment.
    """
    engine = create_engine(url)
    select = text(f'SELECT value FROM "{table}"')
    update = text(f'UPDATE "{table}" SET value = :value')
    start.wait()
    with engine.connect() as connection:
        for _ in range(times):
            with advisory_lock(connection, name):
                value = connection.scalar(select)
                connection.commit()
                connection.execute(update, {"value": value + 1})
                connection.commit()
    engine.dispose()


# -- the tests -----------------------------------------------------------------------------


def url_for_children(url: URL) -> str:
    return url.render_as_string(hide_password=False)


@pytest.fixture
def children() -> Iterator[list[SpawnProcess]]:
    """Child processes of a test; any left running are killed afterwards."""
    started: list[SpawnProcess] = []
    yield started
    for child in started:
        if child.is_alive():
            child.kill()
        child.join(JOIN_SECONDS)


@pytest.fixture
def counter_table(pg_admin: Admin) -> Iterator[str]:
    name = f"advisory_locks_counter_{uuid.uuid4().hex}"
    identifier = sql.Identifier(name)
    pg_admin.execute(sql.SQL("CREATE TABLE {} (value integer NOT NULL)").format(identifier))
    pg_admin.execute(sql.SQL("INSERT INTO {} (value) VALUES (0)").format(identifier))
    yield name
    pg_admin.execute(sql.SQL("DROP TABLE {}").format(identifier))


def start_holder(children: list[SpawnProcess], url: URL, name: str) -> tuple[SpawnProcess, Event]:
    holding, may_release = SPAWN.Event(), SPAWN.Event()
    holder = SPAWN.Process(
        target=hold_lock, args=(url_for_children(url), name, holding, may_release), daemon=True
    )
    children.append(holder)
    holder.start()
    assert holding.wait(START_SECONDS), "the holder process never took the lock"
    return holder, may_release


def test_lock_held_by_another_process_is_not_granted(
    children: list[SpawnProcess], postgres_url: URL, pg_engine: Engine
) -> None:
    name = unique_name()
    start_holder(children, postgres_url, name)
    with pg_engine.connect() as connection:
        assert advisory_lock(connection, name, timeout=0).acquire() is False


def test_lock_released_by_another_process_is_granted(
    children: list[SpawnProcess], postgres_url: URL, pg_engine: Engine
) -> None:
    name = unique_name()
    holder, may_release = start_holder(children, postgres_url, name)
    may_release.set()
    holder.join(JOIN_SECONDS)
    assert holder.exitcode == 0
    with pg_engine.connect() as connection, advisory_lock(connection, name, timeout=0) as lock:
        assert lock.held


def test_killed_holder_process_frees_its_lock_for_a_blocked_waiter(
    children: list[SpawnProcess], postgres_url: URL, pg_admin: Admin
) -> None:
    name = unique_name()
    holder, _ = start_holder(children, postgres_url, name)
    waiter_engine = create_engine(postgres_url)
    waiter = BlockedWaiter(waiter_engine, name)
    try:
        waiter.start()
        assert waiter.waiting.wait(START_SECONDS)
        wait_for(lambda: len(waiter_pids(pg_admin, name)) == 1, "the waiter queues on the server")
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGKILL)
        # Generous: this asserts that the waiter gets the lock, not how fast.
        waiter.finished(10)
        assert waiter.granted.is_set()
        # The kernel closes a dying process's sockets before it becomes reapable, so the
        # waiter can be granted the lock an instant before the holder's exit is visible.
        holder.join(START_SECONDS)
        assert holder.exitcode == -signal.SIGKILL
    finally:
        waiter_engine.dispose()


def test_processes_incrementing_a_counter_under_the_lock_lose_no_update(
    children: list[SpawnProcess], postgres_url: URL, counter_table: str, pg_admin: Admin
) -> None:
    processes, times = 4, 25
    name = unique_name()
    start = SPAWN.Barrier(processes)
    for _ in range(processes):
        child = SPAWN.Process(
            target=increment_counter,
            args=(url_for_children(postgres_url), name, counter_table, times, start),
            daemon=True,
        )
        children.append(child)
        child.start()
    for child in children:
        child.join(JOIN_SECONDS)
    assert [child.exitcode for child in children] == [0] * processes
    query = sql.SQL("SELECT value FROM {}").format(sql.Identifier(counter_table))
    row = pg_admin.execute(query).fetchone()
    assert row is not None
    assert row[0] == processes * times
