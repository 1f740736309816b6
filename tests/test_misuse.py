"""Misusing a lock object raises LockUsageError with a message that says what to do."""

from __future__ import annotations

import asyncio
import copy
import pickle
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from advisory_locks import (
    AdvisoryLockError,
    LockUsageError,
    advisory_lock,
    advisory_lock_set,
    lease_lock,
)
from advisory_locks.sqlalchemy import create_lease_table
from tests.helpers import holder_pids, unique_name
from tests.test_raw_postgres import Admin, libpq_url

pytestmark = pytest.mark.postgresql


def test_lock_usage_error_is_an_advisory_lock_error_and_a_runtime_error() -> None:
    assert issubclass(LockUsageError, AdvisoryLockError)
    assert issubclass(LockUsageError, RuntimeError)


def test_releasing_a_lock_never_acquired_says_to_acquire_it(pg_engine: Engine) -> None:
    with pytest.raises(LockUsageError, match="acquire"):
        advisory_lock(pg_engine, unique_name()).release()


def test_releasing_through_another_object_says_who_holds_it(pg_engine: Engine) -> None:
    # The Rails habit: release by name, with a fresh object.
    name = unique_name()
    with (
        advisory_lock(pg_engine, name),
        pytest.raises(LockUsageError, match="another lock object"),
    ):
        advisory_lock(pg_engine, name).release()


def test_taking_one_object_from_two_threads_is_refused(pg_engine: Engine) -> None:
    lock = advisory_lock(pg_engine, unique_name())
    errors: list[BaseException] = []
    with lock:
        thread = threading.Thread(target=lambda: _capture(lock.acquire, errors))
        thread.start()
        thread.join()
    assert len(errors) == 1
    assert isinstance(errors[0], LockUsageError)
    assert "another thread or task" in str(errors[0])


def test_a_lock_acquired_in_a_worker_thread_may_be_released_by_the_thread_that_waited(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    # An Engine lock's connection is its own checkout, used by no thread between calls:
    # acquired in a worker (asyncio.to_thread(lock.acquire), an executor), it is released
    # where the result was awaited. Only Django's locks, on their thread's connection,
    # refuse that (tests/django/test_django_locks.py).
    name = unique_name()
    lock = advisory_lock(pg_engine, name)
    with ThreadPoolExecutor(max_workers=1) as worker:
        assert worker.submit(lock.acquire).result(timeout=30)
    assert len(holder_pids(pg_admin, name)) == 1
    lock.release()
    assert holder_pids(pg_admin, name) == []


async def test_releasing_from_another_task_of_the_same_thread_is_allowed(
    postgres_url: URL, pg_admin: Admin
) -> None:
    # asyncio.wait_for() (before Python 3.12), gather() and task groups run an acquire in
    # a task of their own: the release in the caller's task is on the same thread, and
    # the connection's own lock orders the two.
    name = unique_name()
    async with await psycopg.AsyncConnection.connect(
        libpq_url(postgres_url), autocommit=True
    ) as raw:
        lock = advisory_lock(raw, name)
        assert await asyncio.create_task(lock.acquire())
        assert holder_pids(pg_admin, name) == [raw.info.backend_pid]
        await lock.release()
        assert holder_pids(pg_admin, name) == []


def test_another_thread_cannot_claim_an_object_whose_unlock_is_on_its_way(
    postgres_url: URL, pg_admin: Admin
) -> None:
    # A raw connection lends itself to every lock on it: had the object let go before its
    # unlock was sent, a second thread would count itself into the holding that unlock is
    # about to end, and be told it holds a lock the server no longer has.
    name = unique_name()
    unlock_sent = threading.Event()
    unlock_may_run = threading.Event()

    class HeldBackUnlocks(psycopg.Cursor[Any]):
        def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            if "unlock" in str(query):
                unlock_sent.set()
                unlock_may_run.wait(10)
            return super().execute(query, *args, **kwargs)

    with psycopg.connect(
        libpq_url(postgres_url), autocommit=True, cursor_factory=HeldBackUnlocks
    ) as raw:
        lock = advisory_lock(raw, name)
        errors: list[BaseException] = []

        def hold_and_release() -> None:
            lock.acquire()
            lock.release()

        holder = threading.Thread(target=lambda: _capture(hold_and_release, errors))
        holder.start()
        try:
            assert unlock_sent.wait(10)
            with pytest.raises(LockUsageError, match="another thread or task"):
                lock.acquire()
        finally:
            unlock_may_run.set()
            holder.join(10)
        assert errors == []
        assert holder_pids(pg_admin, name) == []
        # Released whole: this thread may take it now, with a request of its own.
        assert lock.acquire()
        assert holder_pids(pg_admin, name) == [raw.info.backend_pid]
        lock.release()
        assert holder_pids(pg_admin, name) == []


def test_ensure_held_on_a_lock_not_held_is_a_usage_error(pg_engine: Engine) -> None:
    with pytest.raises(LockUsageError):
        advisory_lock(pg_engine, unique_name()).ensure_held()


def _capture(function: object, errors: list[BaseException]) -> None:
    try:
        function()  # type: ignore[operator]
    except BaseException as error:
        errors.append(error)


@pytest.mark.parametrize(
    "copier", [copy.copy, copy.deepcopy, pickle.dumps], ids=["copy", "deepcopy", "pickle"]
)
def test_a_lock_object_cannot_be_copied_or_pickled(
    pg_engine: Engine, postgres_url: URL, pg_admin: Admin, copier: Callable[[Any], Any]
) -> None:
    # A copy of a held lock object would count itself a holder: its release would unlock
    # what the original still holds.
    name = unique_name()
    create_lease_table(pg_engine)  # if it is not there yet
    async_engine = create_async_engine(postgres_url.set(drivername="postgresql+psycopg_async"))
    objects: list[Any] = [
        advisory_lock(pg_engine, name),
        advisory_lock_set(pg_engine, [name, name + "-2"]),
        lease_lock(pg_engine, name),
        advisory_lock(async_engine, name),
    ]
    for lock in objects:
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            copier(lock)
    held = objects[0]
    with held:
        with pytest.raises(TypeError, match="Make another lock object"):
            copier(held)
        assert held.held
        assert len(holder_pids(pg_admin, name)) == 1
    assert holder_pids(pg_admin, name) == []
