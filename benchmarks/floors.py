"""Bind floors: the least any correct library must do on a bind for acquire(timeout) + release.

The raw twin runs the two statements on a psycopg connection it owns, in autocommit, with
one cursor, as an application on the raw driver would. A library handed a SQLAlchemy
Engine, Connection or Session, or Django's connection, must also do what that bind
demands: check a connection out of the pool and back in, keep the statements out of a
transaction the pool or the application would roll back, leave the connection's mode as
the application configured it, find the thread's Django connection. Each floor here does
exactly that by hand, directly against SQLAlchemy, Django and psycopg, with the twin's
two statements sent the cheapest way psycopg allows, as the library sends its own
(``Statements``: through its libpq wrapper, no cursor), and nothing else: no lock object
per operation (a floor is built once per bind), no bookkeeping, no events. So ``floor /
twin`` is what the bind itself costs (no library on that bind can go below it; below 1
where the cursor costs more than the bind), and ``ours / floor`` is what the library adds
on top.

Each floor is a lock with ``acquire`` and ``release``, so the same code is timed
uncontended here and runs in the handoff and throughput clients (benchmarks.clients),
where a bind's floor shows what the handoff and throughput targets leave on that bind.

The floors cover the path the benchmark takes (no transaction open); where a transaction
is open a library would have to join it, which a floor refuses rather than imitates.

Contract floors (``floor.*.contract``, from ``_ContractFloorLock`` on): on each bind, the
least a lock that keeps every guarantee DESIGN.md requires of a lock there must do on the
benchmark's path, each rule written by hand the cheapest way a library could (their
docstrings say which rule each step serves, and what they leave out, and why no lock
needs it on this path). So a contract floor that misses a target shows that no lock
keeping the contract can meet it on this machine, and one that meets it shows that one
can (``benchmarks.targets``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, ClassVar, NoReturn, Protocol

import psycopg
from psycopg import generators
from psycopg.pq import ExecStatus, TransactionStatus
from sqlalchemy import event
from sqlalchemy.engine import URL, Engine
from sqlalchemy.engine import Connection as SAConnection
from sqlalchemy.orm import Session
from sqlalchemy.pool import PoolProxiedConnection

# The contract's errors (DESIGN, "Public API"): the floors raise what a lock keeping the
# contract must raise.
from advisory_locks.errors import (
    LockConnectionLost,
    LockDeadlock,
    LockLost,
    LockTimeout,
    LockUsageError,
    UnsupportedFeature,
)
from benchmarks.measure import Case, Stopwatch
from benchmarks.postgres import TrackedEngine
from benchmarks.uncontended import (
    RAW_KEY_BASE,
    TIMEOUT_LOCK_SQL,
    TIMEOUT_SECONDS,
    TWIN,
    UNLOCK_SQL,
)

__all__ = [
    "ASYNCPG_TIMEOUT_LOCK_SQL",
    "ASYNCPG_UNLOCK_SQL",
    "CONNECTION_CONTRACT",
    "DJANGO_CONTRACT",
    "ENGINE_CONTRACT",
    "POOLER_OPTION",
    "PSYCOPG_CONTRACT",
    "SERVER_PID_SQL",
    "SESSION_CONTRACT",
    "AsyncpgContractFloorLock",
    "AsyncpgPoolContractFloorLock",
    "ConnectionFloor",
    "DjangoFloor",
    "EngineFloor",
    "FloorLock",
    "SessionFloor",
    "connection_contract_floor",
    "connection_floor",
    "contract_floor_take",
    "declare_pooler",
    "django_contract_floor",
    "django_floor",
    "engine_contract_floor",
    "engine_floor",
    "guard_engine",
    "psycopg_contract_floor",
    "session_contract_floor",
    "session_floor",
]

FLOOR_KEY_BASE = RAW_KEY_BASE + 60
CURSOR_INFO_KEY = "benchmarks.floor_cursor"
IDLE = TransactionStatus.IDLE
COMMAND_OK = ExecStatus.COMMAND_OK
TUPLES_OK = ExecStatus.TUPLES_OK
TIMEOUT_MS = str(TIMEOUT_SECONDS * 1000)
CONNECTION_CONTRACT = "floor.connection.contract"
PSYCOPG_CONTRACT = "floor.psycopg.contract"
DJANGO_CONTRACT = "floor.django.contract"
ENGINE_CONTRACT = "floor.engine.contract"
SESSION_CONTRACT = "floor.session.contract"


class FloorLock(Protocol):
    """A floor as a lock: ``acquire`` waits in the server (up to its timeout), ``release``
    gives the lock back. The uncontended cases call one after the other; the handoff and
    throughput clients (benchmarks.clients) hold the lock in between, like ours."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...


# The server process a connection's statements run in (the contract floors' server
# check for poolers, once per connection: see _ContractFloorLock).
SERVER_PID_SQL = "SELECT pg_catalog.pg_backend_pid()"

# The twin's statements (and the server check's) with libpq's placeholders.
_COMMANDS = {
    sql: sql.replace("%s", "$1", 1).replace("%s", "$2", 1).encode()
    for sql in (TIMEOUT_LOCK_SQL, UNLOCK_SQL, SERVER_PID_SQL)
}


class Statements:
    """The cheapest way psycopg sends the twin's statements on one connection, as the
    library sends its own in autocommit (``advisory_locks._core.libpq``): through its
    libpq wrapper (``psycopg.pq``), driven by the connection's own ``wait()`` under its
    lock, each statement prepared at its first use (not with ``prepare=False``: Django's
    connections prepare nothing), the parameters sent as text for the server to type.
    No cursor: its query parsing, dumpers, prepared-statement cache and row maker are
    most of the twin's client CPU, and no library has to pay them.
    """

    __slots__ = ("_connection", "_execute", "_names", "_pgconn", "_prepare")

    def __init__(self, connection: Any, *, prepare: bool = True) -> None:
        self._connection = connection
        self._pgconn = connection.pgconn
        self._execute = generators.execute
        self._prepare = prepare
        self._names: dict[str, bytes] = {}

    def run(self, sql: str, params: tuple[object, ...]) -> bytes | None:
        """The statement's one value, as the server sent it."""
        connection, pgconn = self._connection, self._pgconn
        values = [b"%d" % param if type(param) is int else str(param).encode() for param in params]
        with connection.lock:
            name = self._names.get(sql)
            if name is None and self._prepare:
                name = self._names[sql] = f"benchmarks_floor_{len(self._names)}".encode()
                pgconn.send_prepare(name, _COMMANDS[sql])
                self._check(connection.wait(self._execute(pgconn))[-1], COMMAND_OK)
            if name is None:
                pgconn.send_query_params(_COMMANDS[sql], values)
            else:
                pgconn.send_query_prepared(name, values)
            result = connection.wait(self._execute(pgconn))[-1]
        self._check(result, TUPLES_OK)
        return result.get_value(0, 0)  # type: ignore[no-any-return]

    @staticmethod
    def _check(result: Any, expected: ExecStatus) -> None:
        if result.status != expected:
            # The error psycopg raises for this result (its class and SQLSTATE).
            raise psycopg.errors.error_from_result(result)


def _cursor(fairy: PoolProxiedConnection) -> Statements:
    """One ``Statements`` per pooled DB-API connection, kept in its ``info`` (which
    SQLAlchemy empties when the DB-API connection is replaced), like a library's cursor."""
    info = fairy.info
    statements = info.get(CURSOR_INFO_KEY)
    if statements is None:
        statements = info[CURSOR_INFO_KEY] = Statements(fairy.dbapi_connection)
    return statements


def _run(statements: Statements, sql: str, params: tuple[object, ...]) -> None:
    if statements.run(sql, params) == b"f":
        # pg_advisory_unlock answers False for a lock this session did not hold.
        raise RuntimeError(f"floor: {sql} answered False")


class EngineFloor:
    """On an Engine: a pool checkout, the lock statement; at release the unlock, the
    checkin with the pool's reset-on-return (nothing to roll back). A session lock must
    not run inside a transaction the pool then rolls back; sent through libpq
    (``Statements``) on the idle checkout, each statement is its own transaction
    whatever the driver's autocommit mode, so the mode is never switched."""

    __slots__ = ("_engine", "_held", "_lock_params", "_unlock_params")

    def __init__(self, engine: Engine, key: int, timeout_ms: str = TIMEOUT_MS) -> None:
        self._engine = engine
        self._lock_params = (key, timeout_ms)
        self._unlock_params = (key,)
        self._held: tuple[PoolProxiedConnection, Any] | None = None

    def acquire(self) -> None:
        fairy = self._engine.raw_connection()
        cursor = _cursor(fairy)
        _run(cursor, TIMEOUT_LOCK_SQL, self._lock_params)
        self._held = (fairy, cursor)

    def release(self) -> None:
        held = self._held
        assert held is not None
        fairy, cursor = held
        self._held = None
        _run(cursor, UNLOCK_SQL, self._unlock_params)
        fairy.close()


class ConnectionFloor:
    """On a SQLAlchemy Connection outside a transaction: the connection stays in the
    mode the application configured (autocommit off), so each statement asks the driver
    whether a transaction is open (it would have to join it); on an idle connection it
    is sent through libpq as its own transaction (see ``EngineFloor``)."""

    __slots__ = ("_connection", "_lock_params", "_unlock_params")

    def __init__(self, connection: SAConnection, key: int, timeout_ms: str = TIMEOUT_MS) -> None:
        self._connection = connection
        self._lock_params = (key, timeout_ms)
        self._unlock_params = (key,)

    def acquire(self) -> None:
        _idle_statement(self._connection.connection, TIMEOUT_LOCK_SQL, self._lock_params)

    def release(self) -> None:
        _idle_statement(self._connection.connection, UNLOCK_SQL, self._unlock_params)


def _idle_statement(fairy: PoolProxiedConnection, sql: str, params: tuple[object, ...]) -> None:
    """One statement on a Connection outside a transaction (both Connection floors): ask
    the driver whether a transaction is open, execute."""
    dbapi: Any = fairy.dbapi_connection
    if dbapi.pgconn.transaction_status != IDLE:
        raise RuntimeError("the Connection floors cover a Connection outside a transaction")
    _run(_cursor(fairy), sql, params)


class SessionFloor:
    """On a Session outside a transaction: the lock gets a connection of its own from the
    Session's engine pool and (the documented contract: one pooled connection per
    Session) the Session's transactions are routed to it while the lock is held, so it
    is a Connection set as ``session.bind``, which goes back to the Engine after the
    last lock; its statements sent as on an Engine."""

    __slots__ = ("_held", "_lock_params", "_session", "_unlock_params")

    def __init__(self, session: Session, key: int, timeout_ms: str = TIMEOUT_MS) -> None:
        self._session = session
        self._lock_params = (key, timeout_ms)
        self._unlock_params = (key,)
        self._held: tuple[Engine, SAConnection, Any] | None = None

    def acquire(self) -> None:
        session = self._session
        if session.get_transaction() is not None:
            raise RuntimeError("floor.session covers a Session outside a transaction")
        engine = session.get_bind()
        assert isinstance(engine, Engine)
        connection = engine.connect()
        session.bind = connection
        cursor = _cursor(connection.connection)
        _run(cursor, TIMEOUT_LOCK_SQL, self._lock_params)
        self._held = (engine, connection, cursor)

    def release(self) -> None:
        held = self._held
        assert held is not None
        engine, connection, cursor = held
        self._held = None
        _run(cursor, UNLOCK_SQL, self._unlock_params)
        self._session.bind = engine
        connection.close()  # checkin, with the pool's reset-on-return


class DjangoFloor:
    """On Django's connection: Django's connections are per thread, so find this
    thread's, connected (``get_autocommit()`` connects first if needed), and make sure
    no transaction is open (autocommit, outside ``atomic()``) that the lock would have
    to join; then the twin's statements on its psycopg connection (``Statements``),
    which the release uses again.

    Django opens its psycopg connections with ``prepare_threshold=None`` unless OPTIONS
    say otherwise (prepared statements break behind transaction poolers), so unlike the
    twin's, these statements are parsed and planned by the server every time, and the
    client builds a Parse message for each: part of what this bind costs, in wall time
    above all, which a library that leaves Django's configuration alone cannot avoid.
    """

    __slots__ = ("_connections", "_cursor", "_lock_params", "_raw", "_unlock_params")

    def __init__(self, key: int, timeout_ms: str = TIMEOUT_MS) -> None:
        from django.db import connections

        self._lock_params = (key, timeout_ms)
        self._unlock_params = (key,)
        self._raw: Any = None
        self._cursor: Any = None
        # Imported once: an import statement run per lock costs importlib's Python code
        # (_handle_fromlist, for a package), which a library importing at the top of its
        # module never runs.
        self._connections = connections

    def acquire(self) -> None:
        wrapper = self._connections["default"]  # django.db.DEFAULT_DB_ALIAS
        if not wrapper.get_autocommit() or wrapper.in_atomic_block:
            raise RuntimeError("floor.django covers Django's connection in autocommit")
        raw = wrapper.connection
        if self._raw is not raw:
            # Not through Django's cursor factory (psycopg's ClientCursor binds the
            # parameters on the client), which a library need not use.
            self._raw, self._cursor = raw, Statements(raw, prepare=False)
        _run(self._cursor, TIMEOUT_LOCK_SQL, self._lock_params)

    def release(self) -> None:
        _run(self._cursor, UNLOCK_SQL, self._unlock_params)


def _floor_case(
    name: str, description: str, floor: FloorLock, sockets: Callable[[], list[int]]
) -> Case:
    acquire, release = floor.acquire, floor.release

    def operation(watch: Stopwatch) -> None:
        watch.start()
        acquire()
        release()
        watch.stop()

    return Case(name, "floor", description, operation, twin=TWIN, sockets=sockets)


def engine_floor(url: URL, stack: ExitStack) -> Case:
    tracked = TrackedEngine(url, stack)
    return _floor_case(
        "floor.engine.timeout",
        "by hand on an Engine: raw_connection() checkout, the twin's two statements "
        "through libpq outside any transaction, checkin",
        EngineFloor(tracked.engine, FLOOR_KEY_BASE),
        tracked.sockets,
    )


def connection_floor(url: URL, stack: ExitStack) -> Case:
    tracked = TrackedEngine(url, stack)
    connection = tracked.engine.connect()
    stack.callback(connection.close)
    return _floor_case(
        "floor.connection.timeout",
        "by hand on a Connection outside a transaction: per statement, ask the driver "
        "whether a transaction is open, execute through libpq",
        ConnectionFloor(connection, FLOOR_KEY_BASE + 1),
        tracked.sockets,
    )


def session_floor(url: URL, stack: ExitStack) -> Case:
    tracked = TrackedEngine(url, stack)
    session = Session(tracked.engine)
    stack.callback(session.close)
    return _floor_case(
        "floor.session.timeout",
        "by hand on a Session: get_bind(), a Connection checked out and set as "
        "session.bind, the twin's two statements through libpq, the Engine back as "
        "session.bind, checkin",
        SessionFloor(session, FLOOR_KEY_BASE + 2),
        tracked.sockets,
    )


def django_floor(sockets: Callable[[], list[int]]) -> Case:
    """On Django's default connection (configured by the caller), in autocommit."""
    return _floor_case(
        "floor.django.timeout",
        "by hand on Django's connection: connections['default'], connected and in "
        "autocommit outside atomic(), the twin's two statements on its psycopg "
        "connection, unprepared (Django's prepare_threshold=None)",
        DjangoFloor(FLOOR_KEY_BASE + 3),
        sockets,
    )


class _ContractFloorLock:
    """The contract floor on a raw psycopg connection in autocommit (the twin's bind):
    the least a lock that keeps every guarantee DESIGN.md requires of a lock on it must
    do, written by hand for the one path the benchmark takes (a session lock with a
    timeout, on a connection that holds nothing). A lower bound for any library keeping
    the contract on this bind, not a competitor.

    On top of the twin's two statements, by the rule each step serves:

    - The API: a lock object for ``with``, the name checked and its key looked up (hashed
      once, then cached: a name's key is the same in every process), the timeout checked
      before any SQL.
    - Re-entrancy, counted per connection: the holders counted in a registry kept on the
      connection, made at its first lock.
    - A raw connection has no events: the connection read before each statement, closed
      or not, and whether a transaction is open (which decides if the statement may run
      as it is or must run switched to autocommit so that it begins none). At release,
      the count, the unlock's answer (False: the lock was lost) and the registry.
    - One holder per lock object: the object counts its own holds (the connection's count
      is shared by every holder on it, so the object's own says whether it holds the
      lock, and when it has let go: releasing an object that holds nothing is a usage
      error), and is claimed by the thread that takes it (``_claim``): another thread
      sharing the object is refused rather than counted in on the first one's holding.
    - Forked children: the registry records the process that made it (``_pid``),
      compared with this process before the holders are looked up (a child's copy is
      never a re-entry) and before the unlock: a child is refused a lock on its parent's
      connection, and a child's release of its parent's holding sends no unlock.
    - Poolers: the registry is made after the server was asked, at the connection's
      first lock, which server process the statements run in (``_server_opener``); a
      pooler or proxy in between stores the opener negated, so that the comparison
      above sends every lock on that connection to the slow path too. Each lock also
      tests whether any bind was declared behind a pooler (``declare_pooler``); only
      then is a declaration looked up (``_allowed``). A session lock is refused behind a
      declared transaction pooler, and behind an undeclared one.
    - Errors: each statement in a try block (free on the happy path), whose except
      clause gives the contract's errors (``_acquire_error``) and closes a connection
      whose wait was interrupted (``_broken``).

    ``current_advisory_locks(connection)`` reads the registry: nothing more per lock.

    Left out, and why no lock needs it on this path:

    - The look, in a forked child, at the socket of a connection the library meets for
      the first time (one ``fstat`` against the sockets found open at the fork), which
      tells that a connection the parent opened but never locked on is the parent's
      too: once per connection, no part of a lock's cost.
    - Lock events of the core's (the library's ``advisory_locks.events``): a monitoring
      feature DESIGN does not ask for (it names Django's signals only, see
      ``_DjangoContractFloorLock``); they would cost a test of a listener list at the
      grant and one at the release.
    - What other paths need: other kinds of names and timeouts, shared and transaction
      locks, a connection in a transaction (which a lock would join), psycopg's
      pipeline mode (which the library refuses; DESIGN does not mention it). The floor
      refuses what it does not cover.
    """

    __slots__ = ("_claim", "_connection", "_count", "_key", "_timeout_ms")

    _keys: ClassVar[dict[str, int]] = {}

    def __init__(self, connection: Any, name: str, timeout: float) -> None:
        if name.__class__ is not str or not name:
            raise TypeError("name")
        key = self._keys.get(name)
        if key is None:
            digest = hashlib.sha256(name.encode()).digest()
            key = self._keys[name] = int.from_bytes(digest[:8], "big", signed=True)
        if not 0 < timeout < 86_400:
            raise ValueError("timeout")
        self._connection = connection
        self._key = key
        self._timeout_ms = str(int(timeout * 1000))
        self._count = 0
        self._claim: dict[int, object] = {}

    def __enter__(self) -> _ContractFloorLock:
        me = _thread_id()
        if self._claim.setdefault(0, me) != me:  # see _claim
            raise _claimed()
        connection = self._connection
        registry = connection.__dict__.get(_REGISTRY)
        if registry is None:
            registry = _raw_registry(self, connection)
        holders, statements, opener = registry
        if opener != _pid or _DECLARED_POOLERS:  # see _pid and _server_opener
            # (before the holders: never a re-entry in a child, nor behind a pooler)
            _allowed(self, opener, _declared(connection))
        count = holders.get(self._key)
        if count:  # held on this connection, by this object or another: counted
            holders[self._key] = count + 1
            self._count += 1
            return self
        try:  # see _acquire_error
            if connection.closed:
                raise LockConnectionLost("the connection is closed")
            if connection.pgconn.transaction_status != IDLE or connection.autocommit:
                statements.run(TIMEOUT_LOCK_SQL, (self._key, self._timeout_ms))
            else:
                raise RuntimeError("the benchmark's connection is in autocommit")
        except BaseException as error:
            del self._claim[0]
            _close_if_interrupted(connection, error)
            _raise(_acquire_error(error), error)
        holders[self._key] = 1
        self._count = 1
        return self

    def release(self) -> None:
        """For the handoff and throughput clients, which hold the lock between calls."""
        self.__exit__(None, None, None)

    def __exit__(self, *exc_info: object) -> None:
        count = self._count
        if not count:
            raise _not_held()
        connection = self._connection
        holders, statements, opener = connection.__dict__[_REGISTRY]
        held = holders[self._key] - 1
        if held:
            holders[self._key] = held
            _count_out(self, count)
            return
        del holders[self._key]
        self._count = 0
        try:  # see _acquire_error
            if opener != _pid and opener != -_pid:  # see _pid: a child's copy
                return
            if connection.closed:
                raise LockLost("the lock's connection is closed")
            if connection.pgconn.transaction_status != IDLE or connection.autocommit:
                released = statements.run(UNLOCK_SQL, (self._key,))
            else:
                raise RuntimeError("the benchmark's connection is in autocommit")
        except BaseException as error:
            _close_if_interrupted(connection, error)
            _raise(_release_error(error), error)
        finally:
            del self._claim[0]  # see _claim: free once the unlock is sent
        if released != b"t":
            raise _not_released()


# One holder per lock object (DESIGN: re-entrancy is counted per connection, so a lock
# object shared by two threads or two asyncio tasks must not let the second count itself
# in on the first one's holding). Each lock object has a dict, ``_claim``, whose key 0
# names its holder while it holds the lock: a thread (``threading.get_ident()``), or on
# an asyncio bind the task. ``_claim.setdefault(0, me)`` claims the object and reads who
# has it in one step, race-free under the GIL: dict.setdefault on an int key is one C
# call that runs no Python code (no __hash__ or __eq__ of ours, no collection), so no
# other thread runs between its lookup and its store. Of two threads claiming a free
# object at once, the first stores its id and the second reads it and is refused. It is
# cheaper than a module-level threading.Lock around a test and a store (the library's
# ``_CLAIMS``): one C call instead of the lock's enter and exit and the attribute reads.
# The holder deletes the key when the object's last hold is released, after its unlock
# is sent (else another thread could claim the object and count itself into a holding
# that unlock is about to end), or when its acquire fails.
_thread_id = threading.get_ident
# asyncio.current_task(), without its Python frame (3.11: a function that does this):
# the running loop's current task, from asyncio's own table of them.
_current_tasks: dict[Any, Any] = asyncio.tasks._current_tasks  # type: ignore[attr-defined]
_running_loop = asyncio._get_running_loop


# Forked children (DESIGN, "Deployment shapes": a child never releases or corrupts a
# parent's lock, whatever it does with its inherited copy). Every contract floor
# records, per connection, the process that opened it (SQLAlchemy: a pool "connect"
# listener, in the pool entry's info; the raw drivers and Django, which have no such
# hook: the process that made the connection's registry, at its first lock), and
# compares it with this process before each lock statement and each unlock. This
# process's id is a global that a forked child refreshes: os.getpid() is a system call.
_pid = os.getpid()


def _forked_child() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forked_child)


# Poolers (DESIGN: PgBouncer transaction pooling: session locks are never safe; the
# library asks the server once per connection whether a pooler is in between, and
# refuses session locks behind a declared transaction pooler, or an undeclared one).
# A raw driver's bind is declared with declare_pooler(), as the library's
# advisory_locks.declare_pooler(); every lock tests whether any is declared at all.
_DECLARED_POOLERS: dict[int, tuple[object, str]] = {}
_POOLER_MODES = ("transaction", "session", "none")
# The library's execution option for an Engine or a Connection. A lock reads the
# options as the attribute that their get_execution_options() returns (SQLAlchemy 2.0
# and 2.1), as a library's compatibility module could, without the method's call.
POOLER_OPTION = "advisory_locks_pooler"


def declare_pooler(bind: object, pooler: str) -> None:
    """What sits between a raw driver's connection or pool and the server (the floors'
    ``advisory_locks.declare_pooler``); the bind is kept, so that its id stays its own."""
    if pooler not in _POOLER_MODES:
        raise ValueError(f"pooler must be one of {_POOLER_MODES}")
    _DECLARED_POOLERS[id(bind)] = bind, pooler


def _declared(*binds: object) -> str | None:
    for bind in binds:
        declared = _DECLARED_POOLERS.get(id(bind))
        if declared is not None and declared[0] is bind:
            return declared[1]
    return None


def _server_opener(connection_pid: int, server_pid: bytes | int | None) -> int:
    """The opener a connection's registry records, from the server check made at its
    first lock: this process's id when the statements run in the server process the
    driver connected to, else that id negated (a pooler or proxy in between), which a
    lock's comparison with ``_pid`` sends to the slow path (``_allowed``)."""
    return _pid if server_pid is not None and int(server_pid) == connection_pid else -_pid


def _allowed(lock: Any, opener: int, pooler: object) -> None:
    """The slow path of a lock's checks: raise (the object no longer claimed) unless a
    session lock may be taken on a connection whose registry records ``opener`` under the
    declaration ``pooler``."""
    try:
        if opener != _pid and opener != -_pid:
            raise _inherited()
        _pooler_allows(pooler, opener == -_pid)
    except BaseException:
        del lock._claim[0]
        raise


def _pooler_allows(pooler: object, behind_proxy: bool) -> None:
    if pooler is not None and pooler not in _POOLER_MODES:
        raise ValueError(f"the pooler declaration must be one of {_POOLER_MODES}")
    if pooler == "transaction":
        raise UnsupportedFeature(
            "session advisory locks are refused behind a declared transaction pooler"
        )
    if behind_proxy and pooler is None:
        raise UnsupportedFeature(
            "session advisory locks are refused: this connection reaches the server "
            "through a pooler or proxy that was not declared"
        )


def _raw_registry(lock: Any, connection: Any) -> tuple[dict[int, int], Statements, int]:
    """A raw psycopg connection's registry, made at its first lock, after the server
    check (see ``_server_opener``)."""
    statements = Statements(connection)
    try:  # see _acquire_error
        server_pid = statements.run(SERVER_PID_SQL, ())
    except BaseException as error:
        del lock._claim[0]
        _close_if_interrupted(connection, error)
        _raise(_acquire_error(error), error)
    registry: tuple[dict[int, int], Statements, int] = (
        {},
        statements,
        _server_opener(connection.pgconn.backend_pid, server_pid),
    )
    connection.__dict__[_REGISTRY] = registry
    return registry


# Errors (DESIGN, errors and "Deployment shapes": every error that means a connection
# is gone is LockLost when the lock was held and a typed error at acquire, never a raw
# driver error). Each statement of a lock runs in a try block, which costs nothing on
# the happy path (an exception table, Python 3.11); its except clause turns the driver's
# error into the contract's, and lets the bind's pool learn that a connection is gone.
_GONE = ("57P01", "57P02", "57P03")  # admin_shutdown, crash_shutdown, cannot_connect_now
_LOCK_NOT_AVAILABLE = "55P03"  # lock_timeout
_DEADLOCK_DETECTED = "40P01"


def _connection_gone(error: BaseException, closed: bool = False) -> bool:
    """Whether a driver's error means its connection is gone (``closed``: the driver
    says its connection is closed now)."""
    if not isinstance(error, Exception):
        return False  # interrupted (KeyboardInterrupt, a task cancelled): not an answer
    sqlstate = getattr(error, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        return sqlstate.startswith("08") or sqlstate in _GONE
    # A socket that closed under the driver: psycopg's OperationalError without a
    # SQLSTATE, asyncpg's InterfaceError on a closed connection, a ConnectionError.
    if isinstance(error, ConnectionError):
        return True
    if type(error) in (psycopg.OperationalError, psycopg.InterfaceError):
        return True
    return closed and type(error).__module__.startswith("asyncpg")


def _acquire_error(error: BaseException, closed: bool = False) -> BaseException:
    """What a failed lock statement means: busy for the whole timeout, a deadlock, or
    a connection gone (the contract's errors); else ``error`` itself."""
    sqlstate = getattr(error, "sqlstate", None)
    if sqlstate == _LOCK_NOT_AVAILABLE:
        return LockTimeout("the lock stayed busy for the whole timeout")
    if sqlstate == _DEADLOCK_DETECTED:
        return LockDeadlock("the server detected a deadlock")
    if _connection_gone(error, closed):
        return LockConnectionLost(f"the lock was not taken: its connection is gone ({error})")
    return error


def _release_error(error: BaseException, closed: bool = False) -> BaseException:
    """What a failed unlock means: the lock lost with its connection; else ``error``."""
    if _connection_gone(error, closed):
        return LockLost(f"the lock was lost: its connection is gone ({error})")
    return error


def _broken(error: BaseException) -> bool:
    """Whether a statement's ``error`` leaves its connection unusable for locks: gone, or
    interrupted mid-statement (KeyboardInterrupt, a task cancelled: DESIGN, "asyncio
    cancellation ... an abandoned wait is never granted later"). The server may still
    grant an abandoned wait, or may have run an interrupted unlock; only discarding the
    connection, which ends its session, makes sure that no one inherits such a lock."""
    return not isinstance(error, Exception) or _connection_gone(error)


def _close_if_interrupted(connection: Any, error: BaseException) -> None:
    """A raw psycopg connection whose statement was interrupted: closed (see ``_broken``;
    one found gone is closed by the driver already)."""
    if not isinstance(error, Exception):
        connection.close()


def _terminate_if_interrupted(connection: Any, error: BaseException) -> None:
    """An asyncpg connection whose statement was interrupted (a task cancelled): its
    socket cut at once (see ``_broken``), without waiting for a graceful close."""
    if not isinstance(error, Exception):
        connection.terminate()


def _invalidate_if_broken(connection: Any, error: BaseException) -> None:
    """A SQLAlchemy Connection's or checkout's DB-API connection found ``_broken``:
    invalidated, so that the pool discards it, as SQLAlchemy does when one of its own
    statements finds it gone."""
    if _broken(error) and not getattr(connection, "invalidated", False):
        with contextlib.suppress(Exception):  # closed already: nothing left to discard
            connection.invalidate(error if isinstance(error, Exception) else None)


def _raise(translated: BaseException, error: BaseException) -> NoReturn:
    if translated is error:
        raise error
    raise translated from error


def _not_released() -> LockLost:
    return LockLost("the server did not hold the lock at its release")


def _inherited() -> LockUsageError:
    return LockUsageError(
        "this connection was opened by the process this one was forked from: its locks "
        "are that process's; open the child's own connections after the fork"
    )


def _claimed() -> LockUsageError:
    return LockUsageError(
        "this lock object is held by another thread or task; make one lock object per use"
    )


def _not_held() -> LockUsageError:
    return LockUsageError("this lock object does not hold the lock")


def _count_out(lock: Any, count: int) -> None:
    """One of ``lock``'s ``count`` holds released, another holder on its connection
    still counting on the name: the object is free after its last."""
    lock._count = count - 1
    if count == 1:
        del lock._claim[0]


_REGISTRY = "_benchmarks_contract_floor"
# In a pooled connection's info: the process that opened it (_connected).
_OPENER = "_benchmarks_contract_floor_opener"


class _ConnectionContractFloorLock(_ContractFloorLock):
    """The contract floor on a SQLAlchemy Connection outside a transaction: the rules of
    ``_ContractFloorLock`` around ``ConnectionFloor``'s statements (the driver asked
    whether a transaction is open, each statement sent through libpq). What a lock needs
    of the connection is one registry entry in its ``info`` (``_pooled_registry``), made
    at its first lock, after the server check, and kept by the lock for its release. The
    process that opened the connection is recorded by a pool ``connect`` listener
    (``guard_engine``); the pooler declaration is the Connection's
    ``advisory_locks_pooler`` execution option; a connection found gone or interrupted
    is invalidated (SQLAlchemy's pool discards it). Left out: as for
    ``_ContractFloorLock`` (the socket look being, here, for a connection opened before
    the pool was hooked), and the care single-connection pools need (another path).
    """

    __slots__ = ("_registry",)

    _registry: _PooledRegistry

    def __enter__(self) -> _ConnectionContractFloorLock:
        me = _thread_id()
        if self._claim.setdefault(0, me) != me:  # see _claim
            raise _claimed()
        try:
            fairy = self._connection.connection  # a closed Connection raises here
            registry = fairy.info.get(_REGISTRY)
            if registry is None:
                registry = _pooled_registry(fairy, self._connection.engine.pool)
            holders, statements, pgconn, opener, _ = registry
            if opener != _pid or POOLER_OPTION in self._connection._execution_options:
                # See _pid and _server_opener (before the holders: never a re-entry in a
                # child, nor behind a pooler).
                if opener != _pid and opener != -_pid:
                    raise _inherited()
                _pooler_allows(
                    self._connection._execution_options.get(POOLER_OPTION),
                    opener == -_pid,
                )
            count = holders.get(self._key)
            if count:  # held on this connection, by this object or another: counted
                holders[self._key] = count + 1
                self._count += 1
                self._registry = registry
                return self
            if pgconn.transaction_status != IDLE:
                raise RuntimeError("the Connection floors cover a Connection outside a transaction")
            statements.run(TIMEOUT_LOCK_SQL, (self._key, self._timeout_ms))
        except BaseException as error:  # see _acquire_error
            del self._claim[0]
            _invalidate_if_broken(self._connection, error)
            _raise(_acquire_error(error), error)
        holders[self._key] = 1
        self._count = 1
        self._registry = registry
        return self

    def __exit__(self, *exc_info: object) -> None:
        count = self._count
        if not count:
            raise _not_held()
        holders, statements, pgconn, opener, _ = self._registry
        held = holders[self._key] - 1
        if held:
            holders[self._key] = held
            _count_out(self, count)
            return
        del holders[self._key]
        self._count = 0
        try:  # see _acquire_error
            if opener != _pid and opener != -_pid:  # see _pid: a child's copy
                return
            if pgconn.transaction_status != IDLE:
                raise RuntimeError("the Connection floors cover a Connection outside a transaction")
            released = statements.run(UNLOCK_SQL, (self._key,))
        except BaseException as error:
            _invalidate_if_broken(self._connection, error)
            _raise(_release_error(error), error)
        finally:
            del self._claim[0]  # see _claim: free once the unlock is sent
        if released != b"t":
            raise _not_released()


# A pooled connection's registry entry (_pooled_registry).
_PooledRegistry = tuple[dict[int, int], Statements, Any, int, Any]


def _pooled_registry(fairy: PoolProxiedConnection, pool: Any) -> _PooledRegistry:
    """A pooled DB-API connection's registry entry for the SQLAlchemy contract floors,
    made at its first lock and kept in its ``info`` (which SQLAlchemy empties when the
    DB-API connection is replaced): the holders counted on it, its statements, its
    libpq connection, asked whether a transaction is open, and the process that opened
    it, as ``_connected`` recorded it (a connection opened before the pool was hooked is
    taken for this process's: see ``_ContractFloorLock`` on forked children), stored
    negated when the server check, made here, finds a pooler or proxy in between (see
    ``_server_opener``), and its pool (see ``_LENT``)."""
    dbapi: Any = fairy.dbapi_connection
    opener = fairy.info.get(_OPENER, _pid)
    statements = _cursor(fairy)
    if opener == _pid:  # a forked child's copy is refused: nothing may be sent on it
        opener = _server_opener(dbapi.pgconn.backend_pid, statements.run(SERVER_PID_SQL, ()))
    registry: _PooledRegistry = ({}, statements, dbapi.pgconn, opener, pool)
    fairy.info[_REGISTRY] = registry
    return registry


# The twin's statements as asyncpg takes them ($n placeholders).
ASYNCPG_TIMEOUT_LOCK_SQL = (
    "SELECT pg_advisory_lock($1) FROM (SELECT pg_catalog.set_config('lock_timeout', $2, true)) "
    "AS timeout"
)
ASYNCPG_UNLOCK_SQL = "SELECT pg_advisory_unlock($1)"


class AsyncpgContractFloorLock(_ContractFloorLock):
    """The contract floor on an asyncpg connection outside a transaction: the bookkeeping
    of ``_ContractFloorLock``, in ``async with``, around the asyncpg twin's two
    statements (``fetchval``). The connection is read before each statement, closed or
    not and whether a transaction is open (where a lock with a timeout would have to
    wrap its wait in a savepoint; the benchmark's is never in one). The object is
    claimed for the asyncio task that takes it (see ``_claim``), or the thread outside
    a task: two tasks of one thread share the thread's id.

    An asyncpg connection has no ``__dict__``: the holders are kept by the connection's
    id, in an entry that a finalizer, made at the connection's first lock, removes when
    the connection goes (cheaper per lock than a ``WeakKeyDictionary``, which makes a
    weak reference at every lookup); it also records the opener (forks, poolers), as on
    psycopg. A task cancelled in the wait cuts the connection's socket (``_broken``).

    What asyncpg's pool asks of a library (its release runs ``pg_advisory_unlock_all()``,
    which the bookkeeping must learn of: the library reads the connection's release
    count) costs nothing here: a connection from ``asyncpg.connect()`` never goes back
    to a pool. A pool's connection, passed as the proxy ``pool.acquire()`` returns, is
    another kind of bind, which this floor does not cover. Left out otherwise as for
    ``_ContractFloorLock``.
    """

    __slots__ = ()

    # By the connection's id: its holders, and the process that opened it (see _pid).
    _holders: ClassVar[dict[int, tuple[dict[int, int], int]]] = {}

    async def __aenter__(self) -> AsyncpgContractFloorLock:
        me = _current_tasks.get(_running_loop()) or _thread_id()
        if self._claim.setdefault(0, me) != me:  # see _claim
            raise _claimed()
        connection = self._connection
        registry = self._holders.get(id(connection))
        if registry is None:
            try:  # see _acquire_error
                registry = await _asyncpg_registry(connection, self._holders)
            except BaseException as error:
                del self._claim[0]
                _terminate_if_interrupted(connection, error)
                _raise(_acquire_error(error, connection.is_closed()), error)
        holders, opener = registry
        if opener != _pid or _DECLARED_POOLERS:  # see _pid and _server_opener
            # (before the holders: never a re-entry in a child, nor behind a pooler)
            _allowed(self, opener, _declared(connection))
        count = holders.get(self._key)
        if count:  # held on this connection, by this object or another: counted
            holders[self._key] = count + 1
            self._count += 1
            return self
        try:  # see _acquire_error
            if connection.is_closed():
                raise LockConnectionLost("the connection is closed")
            if connection.is_in_transaction():
                raise RuntimeError(
                    "floor.asyncpg.contract covers a connection outside a transaction"
                )
            await connection.fetchval(ASYNCPG_TIMEOUT_LOCK_SQL, self._key, self._timeout_ms)
        except BaseException as error:
            del self._claim[0]
            _terminate_if_interrupted(connection, error)
            _raise(_acquire_error(error, connection.is_closed()), error)
        holders[self._key] = 1
        self._count = 1
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        count = self._count
        if not count:
            raise _not_held()
        connection = self._connection
        holders, opener = self._holders[id(connection)]
        held = holders[self._key] - 1
        if held:
            holders[self._key] = held
            _count_out(self, count)
            return
        del holders[self._key]
        self._count = 0
        try:  # see _acquire_error
            if opener != _pid and opener != -_pid:  # see _pid: a child's copy
                return
            if connection.is_closed():
                raise LockLost("the lock's connection is closed")
            released = await connection.fetchval(ASYNCPG_UNLOCK_SQL, self._key)
        except BaseException as error:
            _terminate_if_interrupted(connection, error)
            _raise(_release_error(error, connection.is_closed()), error)
        finally:
            del self._claim[0]  # see _claim: free once the unlock is sent
        if not released:
            raise _not_released()


async def _asyncpg_registry(
    connection: Any, registries: dict[int, Any], *pool: int
) -> tuple[Any, ...]:
    """An asyncpg connection's registry in ``registries``, made at its first lock, after
    the server check (see ``_server_opener``), with a finalizer that removes it when the
    connection goes: its holders, its opener, and the id of its ``pool`` if given."""
    server_pid = await connection.fetchval(SERVER_PID_SQL)
    registry = registries.get(id(connection))
    if registry is None:
        opener = _server_opener(connection.get_server_pid(), server_pid)
        registry = registries[id(connection)] = ({}, opener, *pool)
        weakref.finalize(connection, registries.pop, id(connection), None)
    return registry


# current_advisory_locks(bind) on an asyncpg pool (DESIGN: the names this library holds
# through that bind): the registry of each pool connection a lock holds, from its grant
# to its unlock, by the connection's id (the registry records its pool's id, which says
# whose it is). Not the connection or its proxy: a lock object dropped while it holds
# the lock keeps nothing else alive.
_POOL_LENT: dict[int, tuple[dict[int, int], int, int]] = {}


class AsyncpgPoolContractFloorLock(AsyncpgContractFloorLock):
    """The contract floor on an asyncpg pool: a connection acquired from the pool for the
    lock object (a re-entry of the object, by its task, counts on it) and released to
    the pool after the unlock, with ``AsyncpgContractFloorLock``'s bookkeeping on the
    connection the pool's proxy wraps (the proxy, one per acquire, takes no weak
    reference). Only this object's holds count on its connection while it has it, so
    that connection's count is the object's own. A pool's connections have registries
    of their own (``_registries``), which also record their pool, and a held lock's is
    filed for ``current_advisory_locks(pool)`` (``_POOL_LENT``) from its grant to its
    unlock. The pool's reset at the release (``pg_advisory_unlock_all()``) needs no
    bookkeeping here: the connection is the lock's own from its acquire to after its
    unlock. Left out: as for ``AsyncpgContractFloorLock``, and giving back the connection
    of a lock object dropped while held, which asyncpg's pool never takes back itself
    (the library closes it from a weak reference's callback, one per lock): DESIGN does
    not say what a dropped lock object must do, and this floor keeps nothing of it alive.
    """

    __slots__ = ("_pool", "_proxy")

    # By the connection's id: its holders, its opener (see _pid) and its pool's id.
    _registries: ClassVar[dict[int, tuple[dict[int, int], int, int]]] = {}

    def __init__(self, pool: Any, name: str, timeout: float) -> None:
        super().__init__(None, name, timeout)
        self._pool = pool
        self._proxy: Any = None

    async def __aenter__(self) -> AsyncpgPoolContractFloorLock:
        me = _current_tasks.get(_running_loop()) or _thread_id()
        if self._claim.setdefault(0, me) != me:  # see _claim
            raise _claimed()
        if self._proxy is not None:  # a re-entry of this object, on its connection
            holders, opener, _ = self._registries[id(self._connection)]
            if opener != _pid and opener != -_pid:  # see _pid: the parent's holding
                del self._claim[0]
                raise _inherited()
            holders[self._key] += 1
            return self
        proxy = None
        try:
            proxy = await self._pool.acquire()
            connection = proxy._con
            ident = id(connection)
            registry = self._registries.get(ident)
            if registry is None:
                registry = await _asyncpg_registry(connection, self._registries, id(self._pool))
            holders, opener, _ = registry
            if opener != _pid or _DECLARED_POOLERS:  # see _pid and _server_opener
                if opener != _pid and opener != -_pid:  # the parent's connection
                    # Closed without a word to the server (a socket of the child's own),
                    # so that the pool's reset at the release below never runs in the
                    # parent's session; the pool opens a new connection in its place.
                    connection.terminate()
                    raise _inherited()
                _pooler_allows(_declared(self._pool, proxy), opener == -_pid)
            if connection.is_closed():
                raise LockConnectionLost("the connection is closed")
            if connection.is_in_transaction():
                raise RuntimeError(
                    "floor.asyncpg_pool.contract covers a connection outside a transaction"
                )
            await connection.fetchval(ASYNCPG_TIMEOUT_LOCK_SQL, self._key, self._timeout_ms)
        except BaseException as error:  # see _acquire_error
            del self._claim[0]
            if proxy is None:  # the pool's own errors (opening a connection) pass through
                raise
            if proxy._con is not None:
                _terminate_if_interrupted(proxy._con, error)
            closed = proxy._con is None or proxy._con.is_closed()
            await self._pool.release(proxy)  # a closed connection is replaced
            _raise(_acquire_error(error, closed), error)
        holders[self._key] = 1
        _POOL_LENT[ident] = registry
        self._proxy, self._connection = proxy, connection
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        proxy = self._proxy
        if proxy is None:
            raise _not_held()
        connection = self._connection
        ident = id(connection)
        holders, opener, _ = self._registries[ident]
        held = holders[self._key] - 1
        if held:  # an outer hold of this object
            holders[self._key] = held
            return
        del holders[self._key]
        del _POOL_LENT[ident]
        self._proxy = None
        try:  # see _acquire_error
            if opener != _pid and opener != -_pid:  # see _pid: a child's copy
                connection.terminate()  # (as in __aenter__)
                return
            if connection.is_closed():
                raise LockLost("the lock's connection is closed")
            released = await connection.fetchval(ASYNCPG_UNLOCK_SQL, self._key)
        except BaseException as error:
            _terminate_if_interrupted(connection, error)
            _raise(_release_error(error, connection.is_closed()), error)
        finally:
            await self._pool.release(proxy)  # a closed connection is replaced
            del self._claim[0]  # see _claim: free once the unlock is sent
        if not released:
            raise _not_released()


class _DjangoContractFloorLock:
    """The contract floor on Django's connection: the bookkeeping of
    ``_ContractFloorLock`` around ``DjangoFloor``'s statements. The lock finds the
    thread's connection to the alias (connected, in autocommit outside ``atomic()``, as
    ``DjangoFloor`` checks), counts its holders in a registry kept on the connection
    wrapper for the DB-API connection it was made for (Django may replace that connection
    between two locks), and notes a lock granted inside a request, whose end must release
    it (``request_finished``; the thread-local flag read here is the library's own). At
    release it finds the holders through the wrapper it locked on, checks that the
    DB-API connection is still the one, and checks the unlock's answer. The rules of
    ``_ContractFloorLock`` apply, in Django's terms: the opener and the server check in
    the registry; the pooler declaration is ``ADVISORY_LOCKS["POOLERS"]``, read only
    when a flag says it may declare one (``_django_no_poolers``); a connection found
    gone is marked as Django's own cursor would mark it (``_django_error``). Django's
    lock signals: one test of their receivers at the grant and one at the unlock
    (``_SIGNAL_RECEIVERS``).

    Left out, beside ``_ContractFloorLock``'s list: ``atomic()`` for
    ``transaction=True`` (another path); the hook that unlocks what a connection still
    holds when Django closes it (it runs at the close, not per lock); settings read for
    defaults, the key scheme and the prefix, which cost a lock nothing in their cheapest
    form (the cached keys forgotten when ``setting_changed`` says they changed; the
    benchmark passes its timeout).
    """

    __slots__ = ("_alias", "_claim", "_count", "_key", "_timeout_ms", "_wrapper")

    def __init__(self, alias: str, name: str, timeout: float) -> None:
        # _ContractFloorLock.__init__'s checks and key lookup, written out: calling it
        # would add a call per lock to a floor that must be the least a lock can do.
        if name.__class__ is not str or not name:
            raise TypeError("name")
        keys = _ContractFloorLock._keys
        key = keys.get(name)
        if key is None:
            digest = hashlib.sha256(name.encode()).digest()
            key = keys[name] = int.from_bytes(digest[:8], "big", signed=True)
        if not 0 < timeout < 86_400:
            raise ValueError("timeout")
        self._alias = alias
        self._key = key
        self._timeout_ms = str(int(timeout * 1000))
        self._wrapper: Any = None
        self._count = 0
        self._claim: dict[int, object] = {}

    def __enter__(self) -> _DjangoContractFloorLock:
        connections = _connections
        if connections is None:  # Django's, imported at the first lock (see DjangoFloor)
            connections = _django_connections()
        me = _thread_id()
        if self._claim.setdefault(0, me) != me:  # see _claim
            raise _claimed()
        try:
            wrapper = connections[self._alias]
            if not wrapper.get_autocommit() or wrapper.in_atomic_block:
                raise RuntimeError("floor.django.contract covers Django's connection in autocommit")
            raw = wrapper.connection
            registry: Any = wrapper.__dict__.get(_REGISTRY)
            if registry is None or registry[0] is not raw:
                registry = _django_registry(wrapper, raw)
            _, holders, cursor, in_request, opener = registry
            if opener != _pid or not _django_no_poolers:  # see _pid and _server_opener
                # (before the holders: never a re-entry in a child, nor behind a pooler)
                if opener != _pid and opener != -_pid:
                    raise _inherited()
                _pooler_allows(_django_pooler(self._alias), opener == -_pid)
            self._wrapper = wrapper
            count = holders.get(self._key)
            if count:  # held on this connection, by this object or another: counted
                holders[self._key] = count + 1
                self._count += 1
                return self
            cursor.run(TIMEOUT_LOCK_SQL, (self._key, self._timeout_ms))
        except BaseException as error:  # see _acquire_error
            del self._claim[0]
            _django_error(connections[self._alias], error)
            if _SIGNAL_RECEIVERS:
                _signal("lock_failed", self._alias, self._key)
            _raise(_acquire_error(error), error)
        holders[self._key] = 1
        self._count = 1
        if _DJANGO_REQUEST.active:
            in_request.append(self._key)
        if _SIGNAL_RECEIVERS:
            _signal("lock_acquired", self._alias, self._key)
        return self

    def release(self) -> None:
        """For the handoff and throughput clients, which hold the lock between calls."""
        self.__exit__(None, None, None)

    def __exit__(self, *exc_info: object) -> None:
        count = self._count
        if not count:
            raise _not_held()
        wrapper = self._wrapper
        raw, holders, cursor, in_request, opener = wrapper.__dict__[_REGISTRY]
        if wrapper.connection is not raw:  # Django replaced it: the lock went with it
            self._count = 0
            del self._claim[0]
            raise LockLost("Django closed the lock's connection")
        held = holders[self._key] - 1
        if held:
            holders[self._key] = held
            _count_out(self, count)
            return
        del holders[self._key]
        self._count = 0
        if in_request:
            in_request.remove(self._key)
        try:  # see _acquire_error
            if opener != _pid and opener != -_pid:  # see _pid: a child's copy
                return
            released = cursor.run(UNLOCK_SQL, (self._key,))
        except BaseException as error:
            _django_error(wrapper, error)
            _raise(_release_error(error), error)
        finally:
            del self._claim[0]  # see _claim: free once the unlock is sent
        if _SIGNAL_RECEIVERS:
            _signal("lock_released", self._alias, self._key)
        if released != b"t":
            raise _not_released()


# Django's lock signals (DESIGN, Django: lock_acquired, lock_released, lock_failed). A
# floor of their own would cost the same as the library's on the benchmark's path: the
# receivers, in a list that stays empty while none is connected (the library keeps its
# core's listener list so: its Signal subclass subscribes a forwarder when a receiver
# connects), tested once at a grant and once at an unlock. (A re-entry, which the server
# never sees, sends none.)
_SIGNAL_RECEIVERS: list[Callable[[str, str, int], None]] = []


def _signal(kind: str, alias: str, key: int) -> None:
    for receiver in list(_SIGNAL_RECEIVERS):
        receiver(kind, alias, key)


_connections: Any = None


def _django_connections() -> Any:
    global _connections
    from django.db import connections

    _connections = connections
    return connections


def _django_error(wrapper: Any, error: BaseException) -> None:
    """A lock statement's error on Django's connection ``wrapper``: Django learns of it
    as of an error of its own cursor's (``errors_occurred``), so that it closes a
    connection found gone at the end of the request, as it would without the lock; one
    interrupted mid-statement is closed now (see ``_broken``)."""
    if not isinstance(error, Exception):
        wrapper.close()
    elif _connection_gone(error):
        wrapper.errors_occurred = True


def _django_registry(wrapper: Any, raw: Any) -> Any:
    """The registry of Django's DB-API connection ``raw``, made at its first lock there,
    after the server check (see ``_server_opener``): the connection, its holders, its
    statements, the keys locked during a request, and the opener."""
    cursor = Statements(raw, prepare=False)
    opener = _server_opener(raw.pgconn.backend_pid, cursor.run(SERVER_PID_SQL, ()))
    registry: tuple[Any, dict[int, int], Statements, list[int], int]
    registry = wrapper.__dict__[_REGISTRY] = raw, {}, cursor, [], opener
    return registry


# Django's pooler declarations (ADVISORY_LOCKS["POOLERS"], alias -> mode): True once
# they were read and declare none, until a setting_changed signal says they may have
# changed (Django reads its settings once; tests override them). Every lock tests it.
_django_no_poolers = False
_SESSION_UNSAFE_POOLERS = ("pgbouncer-transaction", "pgbouncer-statement")


def _django_pooler(alias: str) -> str | None:
    """The pooler declared for ``alias``, in declare_pooler's words (read when a lock
    finds ``_django_no_poolers`` False)."""
    global _django_no_poolers
    from django.conf import settings
    from django.core.signals import setting_changed

    setting_changed.connect(_django_settings_changed, dispatch_uid=__name__)
    poolers = getattr(settings, "ADVISORY_LOCKS", {}).get("POOLERS", {})
    _django_no_poolers = not poolers
    pooler = poolers.get(alias)
    if pooler is None:
        return None
    return "transaction" if pooler in _SESSION_UNSAFE_POOLERS else "session"


def _django_settings_changed(*, setting: str, **kwargs: Any) -> None:
    global _django_no_poolers
    if setting == "ADVISORY_LOCKS":
        _django_no_poolers = False


class _RequestFlag(threading.local):
    active = False


_DJANGO_REQUEST = _RequestFlag()


class _EngineContractFloorLock(_ContractFloorLock):
    """The contract floor on an Engine: ``EngineFloor``'s checkout (checked to be
    outside a transaction), statements and checkin, with the rules of
    ``_ContractFloorLock``: the holders counted in the checked-out connection's
    registry entry (``_pooled_registry``; the lock object keeps its checkout and that
    entry while held, and a re-entry of the object, by its thread, counts on it), the
    unlock's answer checked, and the pool guard: a listener on the pool's checkin
    (``guard_engine``) that unlocks what a connection going back still holds. The
    opener, recorded by a pool ``connect`` listener, and the Engine's
    ``advisory_locks_pooler`` execution option are read per lock; in a forked child a
    checkout of the parent's connection is cut from the pool and another taken
    (``_own_checkout``); a checkout found gone or interrupted is invalidated. A held
    lock's registry is filed for ``current_advisory_locks(engine)`` (``_LENT``), not its
    checkout, so that a lock object dropped while held still lets the pool take its
    connection back. Left out: as for ``_ContractFloorLock``."""

    __slots__ = ("_fairy", "_registry")

    _registry: _PooledRegistry

    def __init__(self, engine: Any, name: str, timeout: float) -> None:
        super().__init__(engine, name, timeout)
        self._fairy: Any = None

    def __enter__(self) -> _EngineContractFloorLock:
        me = _thread_id()
        if self._claim.setdefault(0, me) != me:  # see _claim
            raise _claimed()
        if self._fairy is not None:  # a re-entry of this object, on its checkout
            if self._registry[3] in (_pid, -_pid):  # (negated: see _server_opener)
                self._registry[0][self._key] += 1
                return self
            # A forked child's copy of the parent's holding (see _pid): the object takes
            # the lock anew, on a checkout of this process's.
            _cut(self._fairy)
            self._fairy = None
        fairy = None
        try:
            fairy = self._connection.raw_connection()
            registry = fairy.info.get(_REGISTRY)
            if registry is None:
                registry = _pooled_registry(fairy, self._connection.pool)
            holders, statements, pgconn, opener, _ = registry
            if opener != _pid or POOLER_OPTION in self._connection._execution_options:
                # See _pid and _server_opener.
                if opener != _pid and opener != -_pid:  # a checkout of the parent's
                    fairy, registry = _own_checkout(self._connection, fairy)
                    holders, statements, pgconn, opener, _ = registry
                _pooler_allows(
                    self._connection._execution_options.get(POOLER_OPTION),
                    opener == -_pid,
                )
            if pgconn.transaction_status != IDLE:
                raise RuntimeError("floor.engine.contract covers a checkout outside a transaction")
            statements.run(TIMEOUT_LOCK_SQL, (self._key, self._timeout_ms))
        except BaseException as error:  # see _acquire_error
            del self._claim[0]
            if fairy is not None:
                _invalidate_if_broken(fairy, error)
                fairy.close()
            _raise(_acquire_error(error), error)
        holders[self._key] = 1
        _LENT[statements] = registry
        self._fairy, self._registry = fairy, registry
        return self

    def __exit__(self, *exc_info: object) -> None:
        fairy = self._fairy
        if fairy is None:
            raise _not_held()
        holders, statements, _, opener, _ = self._registry
        held = holders[self._key] - 1
        if held:  # an outer hold of this object (only its holds count on its checkout)
            holders[self._key] = held
            return
        del holders[self._key]
        del _LENT[statements]
        self._fairy = None
        try:  # see _acquire_error
            if opener != _pid and opener != -_pid:  # see _pid: a child's copy
                _cut(fairy)
                fairy.close()
                return
            released = statements.run(UNLOCK_SQL, (self._key,))
        except BaseException as error:
            _invalidate_if_broken(fairy, error)
            fairy.close()
            _raise(_release_error(error), error)
        finally:
            del self._claim[0]  # see _claim: free once the unlock is sent
        fairy.close()
        if released != b"t":
            raise _not_released()


# current_advisory_locks(bind) on an Engine (DESIGN: the names this library holds
# through that bind): the registry of each connection an Engine lock holds, from its
# grant to its unlock, by the connection's statements (its registry records its pool,
# which says whose it is). Not the checkout itself: a lock object dropped while it holds
# the lock must still let the pool take its connection back, where the pool guard
# unlocks it (and takes it out of here).
_LENT: dict[Statements, _PooledRegistry] = {}


def _own_checkout(engine: Engine, fairy: Any) -> tuple[Any, _PooledRegistry]:
    """In a forked child: a checkout of a connection this process opened, in place of
    ``fairy``, the parent's. Each of the parent's connections the pool hands out is cut
    from it (``_cut``), and the pool opens a new one in its place."""
    while True:
        _cut(fairy)
        fairy.close()
        fairy = engine.raw_connection()
        registry = fairy.info.get(_REGISTRY) or _pooled_registry(fairy, engine.pool)
        if registry[3] in (_pid, -_pid):  # (negated: see _server_opener)
            return fairy, registry


def _cut(fairy: Any) -> None:
    """SQLAlchemy's recipe for a pooled connection that crossed a fork: the pool entry and
    the checkout forget the DB-API connection without touching it, so that this process
    neither resets, nor closes, nor lends out the parent's session (through the socket
    they share), and the pool opens a new connection at the entry's next checkout."""
    fairy._connection_record.dbapi_connection = fairy.dbapi_connection = None


def _connected(dbapi_connection: Any, record: Any) -> None:
    # Which process opened the connection (see _pid).
    record.info[_OPENER] = _pid


def _checkin_guard(dbapi_connection: Any, record: Any) -> None:
    # The pool guard (DESIGN: no pooled connection is ever checked back in while holding
    # a lock taken through this library): a connection that comes back while its
    # registry still counts a lock (its lock object was dropped while held, or its
    # Connection closed inside the block) is unlocked, here, before anyone else can
    # check it out; one that cannot be is discarded, which ends its server session.
    registry = record.info.get(_REGISTRY)
    if dbapi_connection is not None and registry is not None and registry[0]:
        _unlock_at_checkin(record, registry)


def _unlock_at_checkin(record: Any, registry: _PooledRegistry) -> None:
    holders, statements, _, opener, _ = registry
    keys = list(holders)
    holders.clear()
    _LENT.pop(statements, None)
    if opener != _pid and opener != -_pid:  # see _pid: a forked child's copy
        return
    try:
        for key in keys:
            statements.run(UNLOCK_SQL, (key,))
    except Exception as error:
        record.invalidate(error)


def guard_engine(engine: Engine) -> Engine:
    """Put the contract floors' listeners on ``engine``'s pool (once), before it opens a
    connection: the process that opened each connection (``_connected``), and the pool
    guard at checkin."""
    if not event.contains(engine, "checkin", _checkin_guard):
        event.listen(engine, "connect", _connected)
        event.listen(engine, "checkin", _checkin_guard)
    return engine


class _SessionContractFloorLock(_ContractFloorLock):
    """The contract floor on a Session outside a transaction: ``SessionFloor``'s lock
    connection (checked out from the Session's engine and set as ``session.bind`` while
    the Session holds locks, so a second lock of the Session finds it there), with the
    rules of ``_EngineContractFloorLock`` on that connection: holders counted in its
    registry entry, the unlock's answer checked, the pool guard at checkin, the opener
    and the lock connection's ``advisory_locks_pooler`` option read per lock (a forked
    child's Session cuts its parent's lock connection and takes one of its own:
    ``_own_session_connection``), errors. The Engine goes back as ``session.bind`` when
    the Session's last lock is released. ``current_advisory_locks(session)`` reads the
    registry of ``session.bind``: nothing more per lock.

    Left out: as for ``_ContractFloorLock``; and giving the lock connection back when the
    lock objects using it are dropped while held, which the library does from a weak
    reference's callback (one per lock connection, so per lock here): this floor keeps
    that connection as ``session.bind`` until the Session's locks are released or the
    Session is collected. DESIGN does not say what a dropped lock object must do; no
    connection goes back to the pool holding a lock either way."""

    __slots__ = ("_engine", "_held", "_registry")

    _registry: _PooledRegistry

    def __init__(self, session: Session, name: str, timeout: float) -> None:
        super().__init__(session, name, timeout)
        self._held: Any = None
        self._engine: Any = None

    def __enter__(self) -> _SessionContractFloorLock:
        me = _thread_id()
        if self._claim.setdefault(0, me) != me:  # see _claim
            raise _claimed()
        if self._held is not None:  # a re-entry of this object
            if self._registry[3] in (_pid, -_pid):  # (negated: see _server_opener)
                self._registry[0][self._key] += 1
                self._count += 1
                return self
            # A forked child's copy of the parent's holding (see _pid): the object takes
            # the lock anew, on a lock connection of this process's.
            self._held = None
        session = self._connection
        try:
            pinned = session.bind
            if isinstance(pinned, SAConnection):  # another lock of this Session holds it
                connection, engine = pinned, pinned.engine
            else:
                if session.get_transaction() is not None:
                    raise RuntimeError(
                        "floor.session.contract covers a Session outside a transaction"
                    )
                engine = session.get_bind()
                connection = engine.connect()
                session.bind = connection
            fairy = connection.connection
            registry = fairy.info.get(_REGISTRY)
            if registry is None:
                registry = _pooled_registry(fairy, engine.pool)
            holders, statements, _, opener, _ = registry
            if opener != _pid or POOLER_OPTION in connection._execution_options:
                # See _pid and _server_opener (before the holders: never a re-entry in a
                # child, nor behind a pooler).
                if opener != _pid and opener != -_pid:  # the parent's connection
                    connection, engine, registry = _own_session_connection(session, connection)
                    holders, statements, _, opener, _ = registry
                try:
                    _pooler_allows(
                        connection._execution_options.get(POOLER_OPTION),
                        opener == -_pid,
                    )
                except BaseException:
                    if not holders:
                        session.bind = engine
                        connection.close()
                    raise
            count = holders.get(self._key)
            if count:  # another lock object of this Session holds this name: counted
                holders[self._key] = count + 1
            else:
                try:  # see _acquire_error
                    statements.run(TIMEOUT_LOCK_SQL, (self._key, self._timeout_ms))
                except BaseException as error:
                    _invalidate_if_broken(connection, error)
                    if not holders:
                        session.bind = engine
                        connection.close()
                    raise
                holders[self._key] = 1
        except BaseException as error:
            del self._claim[0]
            _raise(_acquire_error(error), error)
        self._count = 1
        self._held, self._engine, self._registry = connection, engine, registry
        return self

    def __exit__(self, *exc_info: object) -> None:
        count = self._count
        if not count:
            raise _not_held()
        holders, statements, _, opener, _ = self._registry
        held = holders[self._key] - 1
        if held:
            holders[self._key] = held
            if count == 1:  # another lock of the Session still holds the name
                self._held = None
            _count_out(self, count)
            return
        del holders[self._key]
        self._count = 0
        connection, self._held = self._held, None
        try:  # see _acquire_error
            if opener != _pid and opener != -_pid:  # see _pid: a child's copy
                _cut(connection.connection)
                self._connection.bind = self._engine
                connection.close()
                return
            released = statements.run(UNLOCK_SQL, (self._key,))
        except BaseException as error:
            _invalidate_if_broken(connection, error)
            self._connection.bind = self._engine  # its other locks are lost with it
            connection.close()
            _raise(_release_error(error), error)
        finally:
            del self._claim[0]  # see _claim: free once the unlock is sent
        if not holders:
            self._connection.bind = self._engine
            connection.close()
        if released != b"t":
            raise _not_released()


def _own_session_connection(
    session: Session, connection: SAConnection
) -> tuple[SAConnection, Engine, _PooledRegistry]:
    """In a forked child: a lock connection of this process's for ``session``, in place
    of ``connection``, the parent's (the Session's lock connection, pinned by a lock of
    the parent's, or a checkout of a connection the parent opened): each such
    connection is cut from the pool (``_cut``) and the Session's engine asked again."""
    engine = connection.engine
    session.bind = engine
    while True:
        _cut(connection.connection)
        connection.close()
        connection = engine.connect()
        fairy = connection.connection
        registry = fairy.info.get(_REGISTRY) or _pooled_registry(fairy, engine.pool)
        if registry[3] in (_pid, -_pid):  # (negated: see _server_opener)
            session.bind = connection
            return connection, engine, registry


# Each contract floor's lock class, by its case name; each takes (bind, name, timeout).
_CONTRACT_LOCKS: dict[str, Callable[[Any, str, float], Any]] = {
    PSYCOPG_CONTRACT: _ContractFloorLock,
    CONNECTION_CONTRACT: _ConnectionContractFloorLock,
    ENGINE_CONTRACT: _EngineContractFloorLock,
    SESSION_CONTRACT: _SessionContractFloorLock,
    DJANGO_CONTRACT: _DjangoContractFloorLock,
}


def contract_floor_take(
    kind: str, bind: Any, name: str, timeout: float
) -> Callable[[], Callable[[], None]]:
    """Contract floor ``kind`` on ``bind`` (an Engine or a Session's engine guarded by
    ``guard_engine``; Django: the alias) for a client that holds the lock between acquire
    and release: ``take()`` builds the lock object and enters it, and returns what
    leaves it."""
    make = _CONTRACT_LOCKS[kind]

    def take() -> Callable[[], None]:
        lock = make(bind, name, timeout)
        lock.__enter__()
        release: Callable[[], None] = lock.release
        return release

    return take


def _contract_case(kind: str, description: str, bind: Any, sockets: Any) -> Case:
    """The uncontended case of contract floor ``kind`` on ``bind``."""
    make = _CONTRACT_LOCKS[kind]

    def operation(watch: Stopwatch) -> None:
        watch.start()
        with make(bind, kind, TIMEOUT_SECONDS):
            pass
        watch.stop()

    return Case(kind, "floor", description, operation, twin=TWIN, sockets=sockets)


def django_contract_floor(sockets: Callable[[], list[int]]) -> Case:
    """The contract floor on Django's default connection (configured by the caller)."""
    return _contract_case(
        DJANGO_CONTRACT,
        "by hand on Django's connection: every rule of floor.psycopg.contract (holders "
        "kept on the connection wrapper for its DB-API connection, the pooler declared in "
        "ADVISORY_LOCKS), a lock taken in a request noted, the signals' receivers tested, "
        "around floor.django.timeout's statements",
        "default",
        sockets,
    )


def engine_contract_floor(url: URL, stack: ExitStack) -> Case:
    """The contract floor on an Engine."""
    tracked = TrackedEngine(url, stack)
    return _contract_case(
        ENGINE_CONTRACT,
        "by hand on an Engine: every rule of floor.psycopg.contract (holders counted in "
        "the checkout's info, the opener recorded at connect, the pooler option read), "
        "the held connection filed for current_advisory_locks, the pool guard at checkin, "
        "around floor.engine.timeout's checkout, statements and checkin",
        guard_engine(tracked.engine),
        tracked.sockets,
    )


def session_contract_floor(url: URL, stack: ExitStack) -> Case:
    """The contract floor on a Session outside a transaction."""
    tracked = TrackedEngine(url, stack)
    session = Session(guard_engine(tracked.engine))
    stack.callback(session.close)
    return _contract_case(
        SESSION_CONTRACT,
        "by hand on a Session: every rule of floor.engine.contract, on the Session's lock "
        "connection, around floor.session.timeout's steps",
        session,
        tracked.sockets,
    )


def connection_contract_floor(url: URL, stack: ExitStack) -> Case:
    """The contract floor on a SQLAlchemy Connection outside a transaction."""
    tracked = TrackedEngine(url, stack)
    connection = guard_engine(tracked.engine).connect()
    stack.callback(connection.close)
    return _contract_case(
        CONNECTION_CONTRACT,
        "by hand on a Connection outside a transaction: every rule of "
        "floor.psycopg.contract (the opener recorded at connect, the pooler option read) "
        "around floor.connection.timeout's statements",
        connection,
        tracked.sockets,
    )


def psycopg_contract_floor(connection: Any, sockets: Any) -> Case:
    """The contract floor of a raw psycopg connection in autocommit (``_ContractFloorLock``)."""
    return _contract_case(
        PSYCOPG_CONTRACT,
        "by hand on a raw psycopg connection: the least a lock keeping every rule of "
        "DESIGN.md does (a lock object claimed by its thread, the name's cached key, "
        "holders counted per connection, the opener and the pooler checked, the "
        "connection's closed and transaction state read before each statement, driver "
        "errors translated) around the twin's two statements",
        connection,
        sockets,
    )
