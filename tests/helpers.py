"""Small helpers the lock specification tests share: what the server holds, and waiting for it.

Other test sessions may use the same database at the same time, so tests look only at the
keys they took (every test uses fresh names from :func:`unique_name`) or at the backends of
their own engine, never at "every advisory lock on the server".
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session

from advisory_locks.events import LockEvent
from advisory_locks.keys import LockName, derive_key
from advisory_locks.sqlalchemy import SyncBind
from tests.databases import AdvisoryLockRow, advisory_locks_held

__all__ = [
    "AdvisoryLockRow",
    "EventRecorder",
    "advisory_locks_held",
    "advisory_statements",
    "backend_alive",
    "engine_backends_with_advisory_locks",
    "holder_pids",
    "lock_rows",
    "record_statements",
    "unique_name",
    "wait_for",
    "waiter_pids",
]

WAIT_SECONDS = 10.0


def unique_name(label: str = "lock") -> str:
    """A lock name no other test (or concurrent test run) uses."""
    return f"advisory-locks-test:{label}:{uuid.uuid4()}"


def lock_rows(
    admin: psycopg.Connection[TupleRow], name: LockName, **key_options: Any
) -> list[AdvisoryLockRow]:
    """pg_locks rows, granted or awaited, for the key this library derives from ``name``."""
    classid, objid, objsubid = derive_key(name, **key_options).pg_locks_ids()
    return [
        row
        for row in advisory_locks_held(admin)
        if (row.classid, row.objid, row.objsubid) == (classid, objid, objsubid)
    ]


def holder_pids(admin: psycopg.Connection[TupleRow], name: LockName) -> list[int]:
    """Backends holding ``name`` (one entry per backend; session locks that stack show once)."""
    return [row.pid for row in lock_rows(admin, name) if row.granted]


def waiter_pids(admin: psycopg.Connection[TupleRow], name: LockName) -> list[int]:
    """Backends the server has queued for ``name``."""
    return [row.pid for row in lock_rows(admin, name) if not row.granted]


def backend_alive(admin: psycopg.Connection[TupleRow], pid: int) -> bool:
    row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
    assert row is not None
    return bool(row[0])


def engine_backends_with_advisory_locks(
    admin: psycopg.Connection[TupleRow], application_name: str
) -> list[tuple[int, int, int, int, str, bool]]:
    """Advisory pg_locks rows of every live backend whose application_name is given."""
    rows = admin.execute(
        """
        SELECT l.pid, l.classid::int8, l.objid::int8, l.objsubid::int4, l.mode, l.granted
        FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND a.application_name = %s
        """,
        [application_name],
    ).fetchall()
    return [tuple(row) for row in rows]


def wait_for(condition: Callable[[], bool], what: str, *, timeout: float = WAIT_SECONDS) -> None:
    """Poll an observable condition (usually pg_locks) until it holds; fail after ``timeout``.

    Used to learn that another thread or process reached a server-side state (waiting for a
    lock, backend gone), which no Python-side event can tell us.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.01)


def record_statements(engine: Engine) -> list[str]:
    """Record every statement sent through the engine's psycopg cursors, ORM or not.

    Must be called before the engine makes its first connection. The library runs its
    SQL on the driver connection, below SQLAlchemy's execution events, so the recording
    happens in a psycopg cursor class.
    """
    statements: list[str] = []

    class RecordingCursor(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **options: Any) -> Any:
            text = query if isinstance(query, str) else repr(query)
            if params and isinstance(query, str):
                # Recorded as the server would read it, keys in place of the placeholders.
                text = psycopg.ClientCursor(self.connection).mogrify(query, params)
            statements.append(text)
            return super().execute(query, params, **options)

    @event.listens_for(engine, "connect")
    def _record(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.cursor_factory = RecordingCursor

    return statements


def advisory_statements(statements: list[str]) -> list[str]:
    """The statements among ``statements`` that touch advisory locks."""
    return [statement for statement in statements if "advisory" in statement]


@contextlib.contextmanager
def open_bind(kind: str, engine: Engine) -> Iterator[SyncBind]:
    """A bind of the named kind ("engine", "connection", "session"), closed afterwards."""
    if kind == "engine":
        yield engine
    elif kind == "connection":
        with engine.connect() as connection:
            yield connection
    else:
        with Session(engine) as session:
            yield session


def run_crossed(work: Callable[[str, str], None], *, join_seconds: float) -> None:
    """Run ``work(first, second)`` and ``work(second, first)`` in two threads at once,
    with two fresh names; fail if either raised or is still running after the join."""
    first, second = unique_name("first"), unique_name("second")
    errors: list[BaseException] = []

    def run(mine: str, theirs: str) -> None:
        try:
            work(mine, theirs)
        except BaseException as error:  # reported by the calling thread
            errors.append(error)

    threads = [
        threading.Thread(target=run, args=(first, second), daemon=True),
        threading.Thread(target=run, args=(second, first), daemon=True),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(join_seconds)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []


class BlockedWaiter:
    """A thread that takes ``name`` on its own connection of ``engine`` with no timeout.

    ``waiting`` is set just before it asks, ``granted`` once it holds the lock (which it
    then gives back); ``finished()`` joins it and fails if it hung or raised.
    """

    def __init__(self, engine: Engine, name: LockName) -> None:
        self.waiting, self.granted = threading.Event(), threading.Event()
        self.errors: list[BaseException] = []
        self._engine, self._name = engine, name
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from advisory_locks import advisory_lock

        try:
            with self._engine.connect() as connection:
                self.waiting.set()
                with advisory_lock(connection, self._name, timeout=None):
                    self.granted.set()
        except BaseException as error:  # reported by the calling thread
            self.errors.append(error)

    def start(self) -> None:
        self.thread.start()

    def finished(self, join_seconds: float) -> None:
        self.thread.join(join_seconds)
        assert not self.thread.is_alive()
        assert self.errors == []


class EventRecorder:
    """A lock event listener that keeps what it hears. Other tests' locks report too (in
    this process's other threads), so ask for one lock's events by name."""

    def __init__(self) -> None:
        self._events: list[LockEvent] = []
        self._mutex = threading.Lock()

    def __call__(self, event: LockEvent) -> None:
        with self._mutex:
            self._events.append(event)

    def about(self, name: LockName) -> list[LockEvent]:
        with self._mutex:
            return [event for event in self._events if event.name == name]

    def all(self) -> list[LockEvent]:
        with self._mutex:
            return list(self._events)

    def kinds(self, name: LockName) -> list[str]:
        return [event.kind for event in self.about(name)]

    def one(self, name: LockName, kind: str) -> LockEvent:
        (event,) = [event for event in self.about(name) if event.kind == kind]
        return event


def refuse_lock_statements_on_cursors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make psycopg's cursors fail any lock or unlock statement, so that a lock that works
    shows its statements went through libpq (``advisory_locks._core.libpq``)."""
    lock_statement = re.compile(r"pg_(try_)?advisory_")

    def refuse(real: Any) -> Any:
        def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            assert not lock_statement.search(str(query)), f"sent through a cursor: {query}"
            return real(self, query, *args, **kwargs)

        return execute

    monkeypatch.setattr(psycopg.Cursor, "execute", refuse(psycopg.Cursor.execute))
    monkeypatch.setattr(psycopg.AsyncCursor, "execute", refuse(psycopg.AsyncCursor.execute))


# psycopg's raw-query cursors ($1 placeholders) came with psycopg 3.2.
needs_raw_cursors = pytest.mark.skipif(
    not hasattr(psycopg, "RawCursor"), reason="psycopg < 3.2 has no raw-query cursors"
)


def assert_refused_by_an_exhausted_pool(error: BaseException, name: LockName, pool: Any) -> None:
    """What a lock on a psycopg_pool pool with no connection free raises, sync or async:
    the library's LockConnectionTimeout, also the pool's PoolTimeout, naming the lock and
    sizing the pool (``timeout=0.2``, ``max_size=1``), and the pool left as it was."""
    from psycopg_pool import PoolTimeout

    from advisory_locks import AdvisoryLockError, LockNotAcquired
    from advisory_locks.psycopg_pool import LockConnectionTimeout

    assert isinstance(error, LockConnectionTimeout)
    assert isinstance(error, PoolTimeout)  # psycopg_pool's own class, too
    assert isinstance(error, AdvisoryLockError)
    assert not isinstance(error, LockNotAcquired)  # the lock itself was never asked for
    assert type(error.__cause__) is PoolTimeout
    assert error.name == name
    assert f"advisory lock {name!r} needed a connection" in str(error)
    assert "timeout=0.2 s, max_size=1" in str(error)
    assert "make max_size at least" in str(error)
    # Nothing taken from the pool or given back to it.
    stats = pool.get_stats()
    assert (stats["pool_size"], stats["pool_available"], stats["connections_num"]) == (1, 1, 1)
    assert "returns_bad" not in stats


def assert_refused_by_an_asyncpg_pool(error: BaseException, name: LockName, message: str) -> None:
    """What a lock (advisory or lease) on an asyncpg pool that lends nothing (closed,
    closing, not initialized) raises: the library's LockPoolClosed, a LockUsageError that
    is also asyncpg's InterfaceError, from asyncpg's error, naming the lock; its message
    is ``message``."""
    import asyncpg

    from advisory_locks import LockUsageError
    from advisory_locks.asyncpg import LockPoolClosed

    assert isinstance(error, LockPoolClosed)
    assert isinstance(error, asyncpg.InterfaceError)  # asyncpg's own class, too
    assert isinstance(error, LockUsageError)
    assert type(error.__cause__) is asyncpg.InterfaceError
    assert error.name == name
    assert str(error) == message
