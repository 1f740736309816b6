"""Scale: 10,000 locks held at once, the server's lock-table limit, 200 waiters on one key.

These run on a private PostgreSQL cluster (tests/private_postgres.py) started with enough
connections for 200 waiters: filling the shared server's lock table would make every
other client of it fail, and its max_connections may be below 200.
"""

from __future__ import annotations

import gc
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL

from advisory_locks import AdvisoryLock, AdvisoryLockError, advisory_lock
from tests.private_postgres import private_postgres

__all__ = ["ScaleResult", "run_scale"]

SERVER_SETTINGS = {"max_connections": 230, "max_locks_per_transaction": 64}
LOCKS = 10_000
WAITERS = 200
WAIT_SECONDS = 120
# Past the table's size (64 x (230 + background processes) slots): the limit is reached.
BEYOND_LIMIT = 40_000


@dataclass
class ScaleResult:
    server_settings: dict[str, object]
    locks_held: int
    acquire_all_seconds: float
    release_all_seconds: float
    server_rows: int
    client_bytes_per_lock: float
    limit_reached_at: int | None
    limit_error: str
    limit_other_locks_intact: bool
    waiters: int
    waiters_all_done_seconds: float
    waiters_max_inside: int
    waiters_mean_handoff_ms: float


def _advisory_rows(connection: object) -> int:
    count = connection.execute(  # type: ignore[attr-defined]
        text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted")
    ).scalar_one()
    return int(count)


def run_scale(progress: Callable[[str], None] = lambda message: None) -> ScaleResult:
    with private_postgres(SERVER_SETTINGS) as url:
        progress(f"scale: private server on port {url.port}")
        return _measure(url, progress)


def _measure(url: URL, progress: Callable[[str], None]) -> ScaleResult:
    engine = create_engine(url, pool_size=WAITERS + 5, max_overflow=0)
    try:
        with engine.connect() as admin, engine.connect() as connection:
            admin.execution_options(isolation_level="AUTOCOMMIT")
            # Names are built before tracing so the figure is the library's own memory.
            names = [f"scale:{number}" for number in range(LOCKS)]
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.take_snapshot()
            started = time.perf_counter()
            locks: list[AdvisoryLock] = []
            for name in names:
                lock = advisory_lock(connection, name, timeout=5)
                lock.acquire()
                locks.append(lock)
            acquired = time.perf_counter() - started
            after = tracemalloc.take_snapshot()
            tracemalloc.stop()
            grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
            server_rows = _advisory_rows(admin)
            progress(f"scale: {len(locks)} locks held, {server_rows} on the server")

            limit_at, limit_error = None, ""
            extra: list[AdvisoryLock] = []
            for number in range(BEYOND_LIMIT):
                lock = advisory_lock(connection, f"beyond:{number}", timeout=5)
                try:
                    lock.acquire()
                except AdvisoryLockError as error:
                    limit_at, limit_error = LOCKS + len(extra), str(error)
                    break
                extra.append(lock)
            intact = all(lock.held for lock in locks) and _advisory_rows(admin) == len(locks) + len(
                extra
            )
            progress(f"scale: lock table full after {limit_at} locks")
            for lock in reversed(extra):
                lock.release()
            started = time.perf_counter()
            for lock in reversed(locks):
                lock.release()
            released = time.perf_counter() - started
            intact = intact and _advisory_rows(admin) == 0

        waiters = _many_waiters(engine, progress)
    finally:
        engine.dispose()
    return ScaleResult(
        server_settings=dict(SERVER_SETTINGS),
        locks_held=len(names),
        acquire_all_seconds=acquired,
        release_all_seconds=released,
        server_rows=server_rows,
        client_bytes_per_lock=grown / len(names),
        limit_reached_at=limit_at,
        limit_error=limit_error,
        limit_other_locks_intact=intact,
        waiters=WAITERS,
        waiters_all_done_seconds=waiters[0],
        waiters_max_inside=waiters[1],
        waiters_mean_handoff_ms=waiters[2],
    )


def _many_waiters(engine: object, progress: Callable[[str], None]) -> tuple[float, int, float]:
    """200 threads, each on its own connection, queue for one lock; all get it in turn."""
    inside = 0
    most_inside = 0
    guard = threading.Lock()
    errors: list[BaseException] = []
    ready = threading.Barrier(WAITERS + 1)

    def waiter() -> None:
        nonlocal inside, most_inside
        try:
            with engine.connect() as connection:  # type: ignore[attr-defined]
                connection.exec_driver_sql("SELECT 1")
                connection.commit()
                ready.wait()
                with advisory_lock(connection, "scale:one-key", timeout=WAIT_SECONDS):
                    with guard:
                        inside += 1
                        most_inside = max(most_inside, inside)
                    with guard:
                        inside -= 1
        except BaseException as error:
            errors.append(error)

    with engine.connect() as holder:  # type: ignore[attr-defined]
        holder.execution_options(isolation_level="AUTOCOMMIT")
        held = advisory_lock(holder, "scale:one-key")
        held.acquire()
        threads = [threading.Thread(target=waiter, daemon=True) for _ in range(WAITERS)]
        for thread in threads:
            thread.start()
        ready.wait()
        ids = held.key_info.pg_locks_ids()
        deadline = time.monotonic() + 60
        while True:
            queued = holder.execute(
                text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                    "AND classid::int8 = :c AND objid::int8 = :o AND objsubid = :s"
                ),
                {"c": ids[0], "o": ids[1], "s": ids[2]},
            ).scalar_one()
            if queued == WAITERS or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        progress(f"scale: {queued} waiters queued on one key")
        started = time.perf_counter()
        held.release()
        for thread in threads:
            thread.join(WAIT_SECONDS)
        elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} waiters failed, first: {errors[0]!r}")
    return elapsed, most_inside, elapsed / WAITERS * 1000
