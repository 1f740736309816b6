"""Bind floors: the least any correct library must do on a bind for acquire(timeout) + release.

The raw twin runs the two statements on a psycopg connection it owns, in autocommit, with
one cursor. A library handed a SQLAlchemy Engine, Connection or Session, or Django's
connection, must also do what that bind demands: check a connection out of the pool and
back in, keep the statements out of a transaction the pool or the application would roll
back, leave the connection's mode as the application configured it, find the thread's
Django connection. Each floor here does exactly that by hand, directly against
SQLAlchemy, Django and psycopg, with the twin's two statements and one cursor per DB-API
connection (as the library keeps), and nothing else: no lock object, no bookkeeping, no
events. So ``floor / twin`` is what the bind itself costs (no library on that bind can go
below it), and ``ours / floor`` is what the library adds on top.

The floors cover the path the benchmark takes (no transaction open); where a transaction
is open a library would have to join it, which a floor refuses rather than imitates.
"""

from __future__ import annotations

import hashlib
from contextlib import ExitStack
from typing import Any, ClassVar

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy.engine import URL, Engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import PoolProxiedConnection

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
    "connection_floor",
    "django_floor",
    "engine_floor",
    "psycopg_contract_floor",
    "session_floor",
]

FLOOR_KEY_BASE = RAW_KEY_BASE + 60
CURSOR_INFO_KEY = "benchmarks.floor_cursor"
IDLE = TransactionStatus.IDLE


def _cursor(fairy: PoolProxiedConnection) -> Any:
    """One cursor per pooled DB-API connection, kept in its ``info`` (which SQLAlchemy
    empties when the DB-API connection is replaced)."""
    info = fairy.info
    cursor = info.get(CURSOR_INFO_KEY)
    if cursor is None:
        cursor = info[CURSOR_INFO_KEY] = fairy.dbapi_connection.cursor()  # type: ignore[union-attr]
    return cursor


def _lock_unlock(cursor: Any, key: int) -> None:
    cursor.execute(TIMEOUT_LOCK_SQL, (key, str(TIMEOUT_SECONDS * 1000)))
    cursor.fetchone()
    cursor.execute(UNLOCK_SQL, (key,))
    cursor.fetchone()


def engine_floor(url: URL, stack: ExitStack) -> Case:
    tracked = TrackedEngine(url, stack)
    engine = tracked.engine
    key = FLOOR_KEY_BASE

    def operation(watch: Stopwatch) -> None:
        watch.start()
        fairy = engine.raw_connection()
        dbapi: Any = fairy.dbapi_connection
        cursor = _cursor(fairy)
        # The pool hands the connection out with autocommit off. A session lock must not
        # run inside a transaction the pool then rolls back: the driver would send a
        # BEGIN first and the checkin a ROLLBACK, two more round trips.
        dbapi.autocommit = True
        _lock_unlock(cursor, key)
        dbapi.autocommit = False
        fairy.close()  # checkin, with the pool's reset-on-return (nothing to roll back)
        watch.stop()

    return Case(
        "floor.engine.timeout",
        "floor",
        "by hand on an Engine: raw_connection() checkout, autocommit on, the twin's two "
        "statements, autocommit off, checkin",
        operation,
        twin=TWIN,
        sockets=tracked.sockets,
    )


def connection_floor(url: URL, stack: ExitStack) -> Case:
    tracked = TrackedEngine(url, stack)
    connection = tracked.engine.connect()
    stack.callback(connection.close)
    key = FLOOR_KEY_BASE + 1

    def statement(dbapi: Any, cursor: Any, sql: str, params: tuple[object, ...]) -> None:
        # Between statements the connection is in the mode the application configured
        # (autocommit off): each statement asks whether a transaction is open (it would
        # have to join it) and switches autocommit on only around itself.
        if dbapi.pgconn.transaction_status != IDLE:
            raise RuntimeError("floor.connection covers a Connection outside a transaction")
        dbapi.autocommit = True
        cursor.execute(sql, params)
        cursor.fetchone()
        dbapi.autocommit = False

    def operation(watch: Stopwatch) -> None:
        watch.start()
        fairy = connection.connection
        dbapi = fairy.dbapi_connection
        cursor = _cursor(fairy)
        statement(dbapi, cursor, TIMEOUT_LOCK_SQL, (key, str(TIMEOUT_SECONDS * 1000)))
        statement(dbapi, cursor, UNLOCK_SQL, (key,))
        watch.stop()

    return Case(
        "floor.connection.timeout",
        "floor",
        "by hand on a Connection outside a transaction: per statement, ask the driver "
        "whether a transaction is open, autocommit on, execute, autocommit off",
        operation,
        twin=TWIN,
        sockets=tracked.sockets,
    )


def session_floor(url: URL, stack: ExitStack) -> Case:
    tracked = TrackedEngine(url, stack)
    session = Session(tracked.engine)
    stack.callback(session.close)
    key = FLOOR_KEY_BASE + 2

    def operation(watch: Stopwatch) -> None:
        watch.start()
        # A Session outside a transaction: the lock gets a connection of its own from the
        # Session's engine pool, and (the documented contract: one pooled connection per
        # Session) the Session's transactions are routed to it while a lock is held, so
        # it is a Connection set as session.bind, which goes back to the Engine after
        # the last lock.
        if session.get_transaction() is not None:
            raise RuntimeError("floor.session covers a Session outside a transaction")
        engine = session.get_bind()
        assert isinstance(engine, Engine)
        connection = engine.connect()
        session.bind = connection
        fairy = connection.connection
        dbapi: Any = fairy.dbapi_connection
        cursor = _cursor(fairy)
        dbapi.autocommit = True
        _lock_unlock(cursor, key)
        dbapi.autocommit = False
        session.bind = engine
        connection.close()  # checkin, with the pool's reset-on-return
        watch.stop()

    return Case(
        "floor.session.timeout",
        "floor",
        "by hand on a Session: get_bind(), a Connection checked out and set as "
        "session.bind, autocommit on, the twin's two statements, autocommit off, the "
        "Engine back as session.bind, checkin",
        operation,
        twin=TWIN,
        sockets=tracked.sockets,
    )


def django_floor(sockets: Any) -> Case:
    """On Django's default connection (configured by the caller), in autocommit.

    Django opens its psycopg connections with ``prepare_threshold=None`` unless OPTIONS
    say otherwise (prepared statements break behind transaction poolers), so unlike the
    twin's, these statements are parsed and planned by the server every time, and the
    client builds a Parse message for each: part of what this bind costs, in wall time
    above all, which a library that leaves Django's configuration alone cannot avoid.
    """
    from django.db import DEFAULT_DB_ALIAS, connections

    key = FLOOR_KEY_BASE + 3
    cached: list[Any] = [None, None]  # the psycopg connection and its cursor

    def operation(watch: Stopwatch) -> None:
        watch.start()
        # Django's connections are per thread: find this thread's, connected, and make
        # sure no transaction is open (autocommit, outside atomic()) that the lock would
        # have to join. get_autocommit() connects first if needed.
        wrapper = connections[DEFAULT_DB_ALIAS]
        if not wrapper.get_autocommit() or wrapper.in_atomic_block:
            raise RuntimeError("floor.django covers Django's connection in autocommit")
        raw = wrapper.connection
        if cached[0] is not raw:
            # The twin's cursor class: Django's cursor factory binds parameters on the
            # client (psycopg's ClientCursor), which a library need not use.
            cached[:] = [raw, psycopg.Cursor(raw)]
        _lock_unlock(cached[1], key)
        watch.stop()

    return Case(
        "floor.django.timeout",
        "floor",
        "by hand on Django's connection: connections['default'], connected and in "
        "autocommit outside atomic(), the twin's two statements on a reused cursor of "
        "its psycopg connection",
        operation,
        twin=TWIN,
        sockets=sockets,
    )


class _ContractFloorLock:
    """The least a lock that keeps the product contract must do on a raw psycopg
    connection, written by hand for the one path the benchmark takes.

    On top of the twin's two statements: a lock object for ``with`` (the API returns one),
    the name checked and its key looked up (hashed once, then cached; a name's key is
    the same in every process), the timeout checked before any SQL, the holders counted
    per connection (re-entrancy, in a registry kept on the connection), and the
    connection read before each statement, since a raw connection has no events: closed
    or not, and whether a transaction is open, which decides if the statement may run as
    it is or must run switched to autocommit so that it begins none. At release, the
    count, the unlock's answer (False means the lock was lost) and the registry.

    Left out, though the library does them, because a library could choose otherwise:
    refusing to share one lock object between threads or tasks, the server check for
    poolers, forked children, events, error translation, a reused cursor shared safely
    between threads. So it is a lower bound for any library keeping the contract on this
    bind, not a competitor.
    """

    __slots__ = ("_connection", "_key", "_timeout_ms")

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

    def __enter__(self) -> _ContractFloorLock:
        connection = self._connection
        registry = connection.__dict__.get(_REGISTRY)
        if registry is None:
            registry = connection.__dict__[_REGISTRY] = {}, connection.cursor()
        holders, cursor = registry
        count = holders.get(self._key)
        if count:
            holders[self._key] = count + 1
            return self
        if connection.closed:
            raise RuntimeError("closed")
        if connection.pgconn.transaction_status != IDLE or connection.autocommit:
            cursor.execute(TIMEOUT_LOCK_SQL, (self._key, self._timeout_ms))
            cursor.fetchone()
        else:
            raise RuntimeError("the benchmark's connection is in autocommit")
        holders[self._key] = 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        connection = self._connection
        holders, cursor = connection.__dict__[_REGISTRY]
        count = holders[self._key] - 1
        if count:
            holders[self._key] = count
            return
        del holders[self._key]
        if connection.closed:
            raise RuntimeError("lost")
        if connection.pgconn.transaction_status != IDLE or connection.autocommit:
            cursor.execute(UNLOCK_SQL, (self._key,))
            released = cursor.fetchone()
        else:
            raise RuntimeError("the benchmark's connection is in autocommit")
        if not (released and released[0]):
            raise RuntimeError("lost")


_REGISTRY = "_benchmarks_contract_floor"


def psycopg_contract_floor(connection: Any, sockets: Any) -> Case:
    """The contract floor of a raw psycopg connection in autocommit (``_ContractFloorLock``)."""

    def operation(watch: Stopwatch) -> None:
        watch.start()
        with _ContractFloorLock(connection, "floor.psycopg.contract", TIMEOUT_SECONDS):
            pass
        watch.stop()

    return Case(
        "floor.psycopg.contract",
        "floor",
        "by hand on a raw psycopg connection: the least a lock keeping the contract does "
        "(a lock object, the name's cached key, holders counted per connection, the "
        "connection's closed and transaction state read before each statement) around the "
        "twin's two statements",
        operation,
        twin=TWIN,
        sockets=sockets,
    )
