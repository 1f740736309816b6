"""A lock granted in the instant its wait times out is never left behind.

PostgreSQL can grant a lock just as ``lock_timeout`` (or a statement_timeout, or a cancel)
fires: the statement still fails, but the backend keeps the lock it was granted
(LockErrorCleanup "remembers" it). A transaction lock goes with the failed transaction;
a session lock would stay held by a connection that the caller was told did not get it,
and go back to the pool with it. These tests hammer that window.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from sqlalchemy import Engine

from advisory_locks import advisory_lock
from advisory_locks._core.executors import DBAPIExecutor
from advisory_locks._core.steps import VALUE, Statement, on, run_steps
from advisory_locks._dialects.postgresql import PostgresBackend
from advisory_locks.keys import derive_key
from tests.faults.conftest import inject, report
from tests.helpers import unique_name

pytestmark = [pytest.mark.faults, pytest.mark.slow]

ROUNDS = 2000
THREADS = 3
JOIN_SECONDS = 300.0


def test_timed_out_session_lock_wait_never_leaves_the_lock_held(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(pool_size=THREADS)
    name = unique_name()
    key = derive_key(name)
    backend = PostgresBackend()
    start = threading.Barrier(THREADS, timeout=JOIN_SECONDS)
    left_held: list[int] = []
    timeouts = [0]
    errors: list[BaseException] = []

    def contend(index: int) -> None:
        try:
            with engine.connect() as connection:
                raw = connection.connection
                executor = DBAPIExecutor(raw.dbapi_connection)
                start.wait()
                for round_number in range(ROUNDS):
                    # 1-4 ms: short enough that many waits end as the other side releases.
                    lock = advisory_lock(connection, name, timeout=0.001 * (1 + round_number % 4))
                    if lock.acquire():
                        lock.ensure_held()  # hold it for a round trip
                        lock.release()
                        continue
                    timeouts[0] += 1
                    held = run_steps(on(executor, backend.is_held({}, key, shared=False)))
                    if held:
                        left_held.append(round_number)
                        executor.execute(
                            Statement(VALUE, "SELECT pg_advisory_unlock(%s)", key.ints)
                        )
                    # The raw check opened a transaction the Connection does not know of.
                    raw.dbapi_connection.commit()  # type: ignore[union-attr]
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=contend, args=(i,), daemon=True) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_SECONDS)
    inject("lock_timeout racing a release")
    report(f"timeout race: {timeouts[0]} timed-out waits, {len(left_held)} left the lock held")
    assert errors == []
    assert timeouts[0] > 0, "no wait timed out: the race window was never exercised"
    assert left_held == []
