"""A holder process killed with SIGKILL: the server (or, for SQLite, the OS) frees its
locks for the waiters.

No ``finally`` runs in a killed process, so only the server can give the lock back; it
does when the dead process's socket closes. Children are spawned (they share nothing with
the test process but the server and the events passed to them).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import create_engine
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from advisory_locks import advisory_lock
from tests.contract.conftest import Target
from tests.faults.conftest import inject
from tests.helpers import backend_alive, holder_pids, unique_name, wait_for, waiter_pids

pytestmark = pytest.mark.faults

SPAWN = multiprocessing.get_context("spawn")
START_SECONDS = 60.0
# Generous: the waiter must get the lock, not within a measured time.
GRANT_SECONDS = 10.0

Admin = psycopg.Connection[TupleRow]


def hold(url: str, name: str, scope: str, holding: Event) -> None:
    """Take ``name`` (a session or transaction lock) and keep it until killed."""
    engine = create_engine(url)
    with Session(engine) as session:
        if scope == "transaction":
            session.begin()
        # Kept referenced: a Session's lock connection lives only as long as its locks.
        lock = advisory_lock(session, name, transaction=scope == "transaction")
        lock.acquire()
        holding.set()
        threading.Event().wait()  # until SIGKILL


@pytest.fixture
def children() -> Iterator[list[SpawnProcess]]:
    started: list[SpawnProcess] = []
    yield started
    for child in started:
        if child.is_alive():
            child.kill()
        child.join(START_SECONDS)


def start_holder(children: list[SpawnProcess], url: URL, name: str, scope: str) -> SpawnProcess:
    holding = SPAWN.Event()
    rendered = url.render_as_string(hide_password=False)
    holder = SPAWN.Process(target=hold, args=(rendered, name, scope, holding), daemon=True)
    children.append(holder)
    holder.start()
    assert holding.wait(START_SECONDS), "the holder process never took the lock"
    return holder


def kill(process: SpawnProcess) -> None:
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    inject("process killed")


def wait_in_threads(url: URL, name: str, count: int) -> tuple[list[threading.Thread], list[str]]:
    """Start ``count`` threads that each wait (no timeout) for ``name`` then release it."""
    engine = create_engine(url, pool_size=count)
    granted: list[str] = []
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            with engine.connect() as connection, advisory_lock(connection, name, timeout=None):
                granted.append(name)
        except BaseException as error:  # reported through the granted count
            errors.append(error)

    threads = [threading.Thread(target=wait, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, granted


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_killed_holder_frees_its_lock_for_every_queued_waiter(
    scope: str, children: list[SpawnProcess], postgres_url: URL, pg_admin: Admin
) -> None:
    name = unique_name()
    holder = start_holder(children, postgres_url, name, scope)
    threads, granted = wait_in_threads(postgres_url, name, 3)
    wait_for(lambda: len(waiter_pids(pg_admin, name)) == 3, "three waiters queue on the server")
    kill(holder)
    for thread in threads:
        thread.join(GRANT_SECONDS)
    assert not any(thread.is_alive() for thread in threads)
    assert granted == [name] * 3
    assert holder_pids(pg_admin, name) == []


def test_killed_waiter_does_not_keep_the_lock_from_the_waiter_behind_it(
    children: list[SpawnProcess], postgres_url: URL, pg_admin: Admin
) -> None:
    name = unique_name()
    first_holder = start_holder(children, postgres_url, name, "session")
    # A second process queues behind the first, then dies while waiting.
    # The event must outlive the child's start: its semaphore is gone once collected.
    never_set = SPAWN.Event()
    doomed_waiter = SPAWN.Process(
        target=hold,
        args=(postgres_url.render_as_string(hide_password=False), name, "session", never_set),
        daemon=True,
    )
    children.append(doomed_waiter)
    doomed_waiter.start()
    wait_for(
        lambda: len(waiter_pids(pg_admin, name)) == 1,
        "the doomed process queues",
        timeout=START_SECONDS,
    )
    (dead_waiter_backend,) = waiter_pids(pg_admin, name)
    threads, granted = wait_in_threads(postgres_url, name, 1)
    wait_for(lambda: len(waiter_pids(pg_admin, name)) == 2, "a live waiter queues behind it")
    kill(doomed_waiter)
    # PostgreSQL does not notice a vanished client while its backend waits for a lock
    # (unless client_connection_check_interval is set): the dead waiter stays queued,
    # is granted the lock, fails to send the answer and exits, which frees the lock.
    kill(first_holder)
    threads[0].join(GRANT_SECONDS)
    assert granted == [name]
    wait_for(lambda: not backend_alive(pg_admin, dead_waiter_backend), "the dead waiter exits")


def test_killed_holder_frees_its_lock_for_a_blocked_waiter_on_every_database_and_binding(
    target: Target,
) -> None:
    # PostgreSQL, MariaDB (the server ends the dead client's session and its GET_LOCK
    # locks) and SQLite (the OS drops a dead process's file locks), through SQLAlchemy
    # and Django: a waiter already blocked in the server or the OS gets the lock.
    name = unique_name("killed-blocked")
    with target.hold_in_process(name) as holder, target.client() as client:
        lock = client.lock(name, timeout=None)
        waiter = ThreadPoolExecutor(max_workers=1).submit(lock.acquire)
        wait_for(lambda: target.waiting(name), "the waiter is blocked", timeout=START_SECONDS)
        assert not waiter.done()
        holder.kill()
        inject(f"process killed ({target.database})")
        assert waiter.result(timeout=GRANT_SECONDS) is True
        lock.release()
