"""SQLAlchemy binding: find the connection a lock must run on, and keep pools clean.

Where a lock lives, by bind:

- ``Connection``: on that connection. Re-entrancy is counted per DB-API connection.
- ``Session``: a session lock runs on a connection the Session checks out of its engine's
  pool for as long as it holds session locks, so ``commit()``/``rollback()`` (which give
  the Session's own connection back to the pool) neither release nor leak it. A
  transaction lock runs on ``session.connection()``, inside the Session's transaction.
- ``Engine``: each lock checks out its own connection and returns it after release.

Pool guard: a connection that comes back to the pool while this library still records a
session lock on it is unlocked before anyone else can check it out, or discarded.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, TypeAlias, overload

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.pool import Pool, PoolProxiedConnection
from sqlalchemy.sql.expression import SavepointClause
from sqlalchemy.util import greenlet_spawn

from advisory_locks.backends import Backend, backend_for_dialect
from advisory_locks.backends.base import (
    Executor,
    HoldsLocksClientSide,
    Timeout,
    validate_flags,
)
from advisory_locks.errors import UnsupportedFeature
from advisory_locks.executors import (
    STATE_INFO_KEY,
    driver_autocommit,
    executor_for,
    protocol_session_id,
    set_driver_autocommit,
)
from advisory_locks.keys import LockName, derive_key
from advisory_locks.lock import (
    AdvisoryLock,
    AdvisoryLockSet,
    AsyncAdvisoryLock,
    AsyncAdvisoryLockSet,
    Lease,
    LockSite,
)
from advisory_locks.registry import ConnectionLocks

logger = logging.getLogger("advisory_locks")

if TYPE_CHECKING:
    from sqlalchemy.engine.interfaces import DBAPIConnection
    from sqlalchemy.pool import ConnectionPoolEntry

__all__ = [
    "AdvisoryLockSession",
    "AdvisoryLockSessionMixin",
    "AsyncAdvisoryLockSession",
    "AsyncBind",
    "SyncBind",
    "advisory_lock",
    "advisory_lock_set",
    "current_advisory_locks",
]

SyncBind: TypeAlias = Session | Connection | Engine
AsyncBind: TypeAlias = AsyncSession | AsyncConnection | AsyncEngine

LOCKS_INFO_KEY: Final = "advisory_locks.locks"
AUTOCOMMIT_INFO_KEY: Final = "advisory_locks.restore_autocommit"
SESSION_INFO_KEY: Final = "advisory_locks.session_connection"
BEHIND_PROXY_INFO_KEY: Final = "advisory_locks.behind_proxy"
# Execution option declaring what sits between the engine and the server:
# "transaction" (session locks refused), "session" (a pooler that pins each client to
# one server connection), or "none".
POOLER_OPTION: Final = "advisory_locks_pooler"
POOLER_MODES: Final = ("transaction", "session", "none")


@overload
def advisory_lock(
    bind: SyncBind,
    name: LockName,
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: str | None = None,
    key_prefix: str | int | None = None,
) -> AdvisoryLock: ...


@overload
def advisory_lock(
    bind: AsyncBind,
    name: LockName,
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: str | None = None,
    key_prefix: str | int | None = None,
) -> AsyncAdvisoryLock: ...


def advisory_lock(
    bind: SyncBind | AsyncBind,
    name: LockName,
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: str | None = None,
    key_prefix: str | int | None = None,
) -> AdvisoryLock | AsyncAdvisoryLock:
    """A named lock held by the database behind ``bind``.

    Use it as ``with advisory_lock(...)`` (``async with`` for an async bind), or call
    ``acquire()`` / ``release()``. Nothing is sent to the server until it is acquired.

    :param bind: a ``Session``, ``Connection`` or ``Engine`` (or their asyncio versions);
        it decides which connection holds the lock (see *Session and transaction locks*).
    :param name: a non-empty ``str`` (hashed to a key), an ``int`` (a signed 64-bit key)
        or an ``(int, int)`` pair (two signed 32-bit keys).
    :param timeout: ``None`` waits until granted, ``0`` never waits, ``t > 0`` lets the
        server wait at most ``t`` seconds.
    :param shared: take a shared (reader) lock instead of an exclusive one.
    :param transaction: hold the lock until the surrounding transaction ends; refused
        where there is no transaction (an ``Engine``, an ``AUTOCOMMIT`` connection).
    :param key_scheme: how a ``str`` name becomes a key: ``"sha256"`` (default),
        ``"pglock"`` or ``"rails"``; default ``$ADVISORY_LOCKS_KEY_SCHEME``.
    :param key_prefix: a namespace for ``str`` names; default ``$ADVISORY_LOCKS_PREFIX``.
    :returns: an ``AdvisoryLock``, or an ``AsyncAdvisoryLock`` for an async bind.
    :raises TypeError: for a name, bind or flag of the wrong type, before any SQL.
    :raises ValueError: for an empty name, an out-of-range key or a negative timeout.
    :raises UnsupportedFeature: for ``transaction=True`` without a transaction, or a mode
        the database cannot provide.
    """
    key = derive_key(name, scheme=key_scheme, prefix=key_prefix)
    validate_flags(shared=shared, transaction=transaction)
    sync_bind = _sync_bind(bind)
    site = _site_for(sync_bind, transaction=transaction)
    lock = AdvisoryLock(site, key, timeout=timeout, shared=shared, transaction=transaction)
    if sync_bind is bind:
        return lock
    return AsyncAdvisoryLock(lock, greenlet_spawn)


@overload
def advisory_lock_set(
    bind: SyncBind,
    names: Iterable[LockName],
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: str | None = None,
    key_prefix: str | int | None = None,
) -> AdvisoryLockSet: ...


@overload
def advisory_lock_set(
    bind: AsyncBind,
    names: Iterable[LockName],
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: str | None = None,
    key_prefix: str | int | None = None,
) -> AsyncAdvisoryLockSet: ...


def advisory_lock_set(
    bind: SyncBind | AsyncBind,
    names: Iterable[LockName],
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: str | None = None,
    key_prefix: str | int | None = None,
) -> AdvisoryLockSet | AsyncAdvisoryLockSet:
    """Several locks taken in key order, so overlapping sets never deadlock.

    ``timeout`` bounds the whole acquisition; the other options apply to every lock.
    """
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(f"names must be a collection of lock names, not {type(names).__name__}")
    keys = [derive_key(name, scheme=key_scheme, prefix=key_prefix) for name in names]
    validate_flags(shared=shared, transaction=transaction)
    sync_bind = _sync_bind(bind)
    site: LockSite
    if isinstance(sync_bind, Engine) and not transaction:
        # One connection for the whole set: a connection per lock could exhaust the pool
        # while the set waits for its next lock.
        site = SharedEngineSite(sync_bind)
    else:
        site = _site_for(sync_bind, transaction=transaction)
    lock_set = AdvisoryLockSet(
        (
            AdvisoryLock(site, key, timeout=timeout, shared=shared, transaction=transaction)
            for key in keys
        ),
        timeout=timeout,
    )
    if sync_bind is bind:
        return lock_set
    return AsyncAdvisoryLockSet(lock_set, greenlet_spawn)


def current_advisory_locks(bind: SyncBind | AsyncBind) -> list[LockName]:
    """Names of the locks this library holds through ``bind`` (in this process)."""
    sync_bind = _sync_bind(bind)
    return _site_for(sync_bind, transaction=False).held_names()


class AdvisoryLockSessionMixin:
    """Adds ``advisory_lock()`` to a Session class of your own."""

    def advisory_lock(
        self,
        name: LockName,
        *,
        timeout: Timeout = None,
        shared: bool = False,
        transaction: bool = False,
        key_scheme: str | None = None,
        key_prefix: str | int | None = None,
    ) -> AdvisoryLock:
        assert isinstance(self, Session), "AdvisoryLockSessionMixin needs a Session subclass"
        return advisory_lock(
            self,
            name,
            timeout=timeout,
            shared=shared,
            transaction=transaction,
            key_scheme=key_scheme,
            key_prefix=key_prefix,
        )


class AdvisoryLockSession(AdvisoryLockSessionMixin, Session):
    """A Session with ``advisory_lock()``; use ``sessionmaker(class_=AdvisoryLockSession)``."""


class AsyncAdvisoryLockSession(AsyncSession):
    """An AsyncSession with ``advisory_lock()``; use ``async_sessionmaker(class_=...)``."""

    sync_session_class = AdvisoryLockSession

    def advisory_lock(
        self,
        name: LockName,
        *,
        timeout: Timeout = None,
        shared: bool = False,
        transaction: bool = False,
        key_scheme: str | None = None,
        key_prefix: str | int | None = None,
    ) -> AsyncAdvisoryLock:
        return advisory_lock(
            self,
            name,
            timeout=timeout,
            shared=shared,
            transaction=transaction,
            key_scheme=key_scheme,
            key_prefix=key_prefix,
        )


def _sync_bind(bind: object) -> SyncBind:
    if isinstance(bind, (Session, Connection, Engine)):
        return bind
    if isinstance(bind, AsyncSession):
        return bind.sync_session
    if isinstance(bind, AsyncEngine):
        return bind.sync_engine
    if isinstance(bind, AsyncConnection):
        if bind.sync_connection is None:
            raise ValueError("the AsyncConnection is not started; use it inside 'async with'")
        return bind.sync_connection
    raise TypeError(
        "bind must be a SQLAlchemy Session, Connection or Engine (or an async one), "
        f"not {type(bind).__name__}"
    )


def _site_for(bind: SyncBind, *, transaction: bool) -> LockSite:
    if isinstance(bind, Connection):
        return ConnectionSite(bind)
    if isinstance(bind, Engine):
        if transaction:
            raise UnsupportedFeature(
                "transaction=True needs a transaction, and an Engine has none: pass a "
                "Connection or Session inside a transaction, or use a session lock"
            )
        return EngineSite(bind)
    return SessionSite(bind)


def _backend_for(engine: Engine) -> Backend:
    return backend_for_dialect(engine.dialect.name)


def connection_locks(info: dict[Any, Any], backend: Backend | None = None) -> ConnectionLocks:
    """The registry stored with a pooled DB-API connection (dropped if it is replaced)."""
    locks = info.get(LOCKS_INFO_KEY)
    if not isinstance(locks, ConnectionLocks):
        locks = info[LOCKS_INFO_KEY] = ConnectionLocks()
    if backend is not None:
        locks.backend = backend
    return locks


class ConnectionSite:
    """Locks on a Connection the caller owns."""

    __slots__ = ("backend", "connection")

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.backend = _backend_for(connection.engine)

    def lease(self, *, transaction: bool) -> Lease:
        return ConnectionLease(self.connection, self.backend, transaction=transaction)

    def held_names(self) -> list[LockName]:
        if self.connection.closed or self.connection.invalidated:
            return []
        return connection_locks(self.connection.info).names()


class ConnectionLease:
    """A caller's Connection: never closed or returned by the lock."""

    __slots__ = ("connection", "executor", "in_transaction", "locks")

    def __init__(self, connection: Connection, backend: Backend, *, transaction: bool) -> None:
        fairy = connection.connection
        dbapi = fairy.dbapi_connection
        if _autocommit(dbapi):
            if transaction:
                raise UnsupportedFeature(
                    "transaction=True needs a transaction, but this connection is in "
                    "AUTOCOMMIT mode, where every statement is its own transaction"
                )
            self.executor: Executor = executor_for(dbapi, fairy.driver_connection, fairy.info)
        elif transaction:
            if not connection.in_transaction():
                # Like any statement on a Connection, a transaction lock autobegins.
                connection.begin()
            self.executor = executor_for(dbapi, fairy.driver_connection, fairy.info)
        else:
            # A session lock must not open a transaction that SQLAlchemy does not know
            # about, on an idle connection or at a release after the caller's transaction
            # ended; it runs as autocommit whenever no transaction is open.
            self.executor = _AutocommitExecutor(connection, fairy)
        self.connection = connection
        check_server(
            fairy,
            self.executor,
            backend,
            pooler=connection.get_execution_options().get(POOLER_OPTION),
            session_lock=not transaction,
        )
        self.in_transaction = connection.in_transaction()
        self.locks = connection_locks(fairy.info, backend)
        if self.locks.pending_release and not self.in_transaction:
            # A failed transaction postponed these unlocks and has ended since. Finish
            # them first: taking one of these names again would otherwise stack on the
            # server, and the later unlock would leave it held.
            for holding in self.locks.pending_release:
                backend.release(self.executor, holding.key, shared=holding.shared)
            self.locks.pending_release.clear()

    def done(self) -> None:
        pass

    def broken(self, error: BaseException) -> None:
        if not self.connection.invalidated:
            self.connection.invalidate(error if isinstance(error, Exception) else None)


class _AutocommitExecutor:
    """Runs each statement with the DB-API connection in autocommit, if SQLAlchemy has
    no transaction open on it at that moment; inside the caller's transaction otherwise."""

    __slots__ = ("connection", "fairy")

    def __init__(self, connection: Connection, fairy: PoolProxiedConnection) -> None:
        self.connection = connection
        self.fairy = fairy

    @property
    def state(self) -> dict[str, Any]:
        return executor_for(self.fairy.dbapi_connection, None, self.fairy.info).state

    def fetch_value(self, sql: str, params: Any) -> object:
        return self._call("fetch_value", sql, params)

    def run_script(self, sql: str) -> None:
        self._call("run_script", sql)

    def fetch_rows(self, sql: str) -> list[tuple[object, ...]]:
        return self._call("fetch_rows", sql)  # type: ignore[no-any-return]

    def _call(self, method: str, *args: Any) -> Any:
        dbapi = self.fairy.dbapi_connection
        executor = executor_for(dbapi, self.fairy.driver_connection, self.fairy.info)
        if self.connection.in_transaction() or _autocommit(dbapi):
            return getattr(executor, method)(*args)
        _set_autocommit(dbapi, True)
        try:
            return getattr(executor, method)(*args)
        finally:
            _set_autocommit(dbapi, False)


class PooledLease:
    """A connection checked out of an engine's pool for locks only, in autocommit mode.

    Autocommit keeps every acquire and release to one round trip, and means nothing the
    lock does can be rolled back underneath it.
    """

    __slots__ = ("__weakref__", "engine", "executor", "fairy", "in_transaction", "locks")

    in_transaction: bool

    def __init__(self, engine: Engine, backend: Backend) -> None:
        self.engine = engine
        self.fairy = engine.raw_connection()
        dbapi = self.fairy.dbapi_connection
        if not _autocommit(dbapi):
            _set_autocommit(dbapi, True)
            self.fairy.info[AUTOCOMMIT_INFO_KEY] = True
        self.executor: Executor = executor_for(dbapi, self.fairy.driver_connection, self.fairy.info)
        try:
            check_server(
                self.fairy,
                self.executor,
                backend,
                pooler=engine.get_execution_options().get(POOLER_OPTION),
                session_lock=True,
            )
        except BaseException:
            self.fairy.close()
            raise
        self.locks = connection_locks(self.fairy.info, backend)
        self.in_transaction = False
        _engine_leases(engine).add(self)

    @property
    def returned(self) -> bool:
        return self.fairy.dbapi_connection is None

    def done(self) -> None:
        if self.locks.holdings or self.locks.pending_release or self.returned:
            return
        _engine_leases(self.engine).discard(self)
        self.fairy.close()

    def broken(self, error: BaseException) -> None:
        _engine_leases(self.engine).discard(self)
        if not self.returned:
            self.fairy.invalidate(error if isinstance(error, Exception) else None)
            self.fairy.close()


_leases_by_engine: weakref.WeakKeyDictionary[Engine, weakref.WeakSet[PooledLease]] = (
    weakref.WeakKeyDictionary()
)


def _engine_leases(engine: Engine) -> weakref.WeakSet[PooledLease]:
    leases = _leases_by_engine.get(engine)
    if leases is None:
        leases = _leases_by_engine[engine] = weakref.WeakSet()
    return leases


class EngineSite:
    """Each lock takes its own pooled connection."""

    __slots__ = ("backend", "engine")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.backend = _backend_for(engine)

    def lease(self, *, transaction: bool) -> Lease:
        return PooledLease(self.engine, self.backend)

    def held_names(self) -> list[LockName]:
        return [name for lease in list(_engine_leases(self.engine)) for name in lease.locks.names()]


class SharedEngineSite(EngineSite):
    """The locks of one lock set on an Engine share one pooled connection."""

    __slots__ = ("_lease",)

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self._lease: PooledLease | None = None

    def lease(self, *, transaction: bool) -> Lease:
        # A lease goes back to the pool once none of its locks is held, so a set taken
        # again after its release checks out a fresh one.
        if self._lease is None or self._lease.returned:
            self._lease = PooledLease(self.engine, self.backend)
        return self._lease


class SessionSite:
    """Session locks on one pooled connection per Session; transaction locks in its
    transaction."""

    __slots__ = ("backend", "session")

    def __init__(self, session: Session) -> None:
        self.session = session
        bind = session.get_bind()
        self.backend = _backend_for(bind if isinstance(bind, Engine) else bind.engine)

    def lease(self, *, transaction: bool) -> Lease:
        if transaction:
            return ConnectionLease(self.session.connection(), self.backend, transaction=True)
        bind = self.session.get_bind()
        if isinstance(bind, Connection):
            return ConnectionLease(bind, self.backend, transaction=False)
        lease = self._pooled_lease()
        if lease is None:
            lease = PooledLease(bind, self.backend)
            # Only the locks keep the lease alive: once every lock object using it is
            # gone, its connection is collected and the pool guard unlocks what they
            # left, even while this Session lives on.
            self.session.info[SESSION_INFO_KEY] = weakref.ref(lease)
        return lease

    def _pooled_lease(self) -> PooledLease | None:
        reference = self.session.info.get(SESSION_INFO_KEY)
        lease = reference() if isinstance(reference, weakref.ref) else None
        return lease if isinstance(lease, PooledLease) and not lease.returned else None

    def held_names(self) -> list[LockName]:
        names: list[LockName] = []
        lease = self._pooled_lease()
        if lease is not None:
            names += lease.locks.names()
        bind = self.session.get_bind()
        # A Session bound to a Connection takes its session locks on that connection.
        connections = {bind} if isinstance(bind, Connection) else set()
        transaction = self.session.get_transaction()
        if transaction is not None:
            # Only connections the transaction already has can hold its locks. Asking
            # for one would connect, which an AsyncSession cannot do from sync code.
            # (SessionTransaction.connections is the public name from SQLAlchemy 2.1.7.)
            connections.update(entry[0] for entry in transaction._connections.values())
        for connection in connections:
            names += ConnectionSite(connection).held_names()
        return names


def check_server(
    fairy: PoolProxiedConnection,
    executor: Executor,
    backend: Backend,
    *,
    pooler: object,
    session_lock: bool,
) -> None:
    """Refuse servers that only imitate advisory locks, and session locks through a
    transaction pooler; the server is asked once per physical connection."""
    if pooler is not None and pooler not in POOLER_MODES:
        raise ValueError(f"{POOLER_OPTION} must be one of {POOLER_MODES}, not {pooler!r}")
    if session_lock and pooler == "transaction":
        raise UnsupportedFeature(
            "session advisory locks are refused: the engine declares "
            f"{POOLER_OPTION}='transaction'. {_TRANSACTION_POOLING}"
        )
    info: Mapping[Any, Any] = fairy.info
    behind_proxy = info.get(BEHIND_PROXY_INFO_KEY)
    if behind_proxy is None:
        server_id = backend.inspect_server(executor)
        client_id = protocol_session_id(fairy.driver_connection)
        behind_proxy = fairy.info[BEHIND_PROXY_INFO_KEY] = (
            client_id is not None and client_id != server_id
        )
    if session_lock and behind_proxy and pooler is None:
        raise UnsupportedFeature(
            "session advisory locks are refused on this connection: it reaches the server "
            "through a pooler or proxy (the server process id the driver was told at "
            f"connect is not the one its statements run in). {_TRANSACTION_POOLING} If the "
            "pooler pins each client to one server connection (pool_mode=session), declare "
            f"it: create_engine(..., execution_options={{'{POOLER_OPTION}': 'session'}})."
        )


_TRANSACTION_POOLING: Final = (
    "A transaction pooler (PgBouncer pool_mode=transaction) may run each transaction on "
    "another server connection, leaving a session lock behind on one that other clients "
    "then use: take the lock with transaction=True inside a transaction instead."
)


def _autocommit(dbapi_connection: DBAPIConnection | None) -> bool:
    return driver_autocommit(dbapi_connection)


def _set_autocommit(dbapi_connection: Any, value: bool) -> None:
    set_driver_autocommit(dbapi_connection, value)


# -- events: transaction ends, savepoints, and the pool guard ------------------------------


def _locks_of(connection: Connection) -> ConnectionLocks | None:
    if connection.invalidated or connection.closed:
        return None
    locks = connection.info.get(LOCKS_INFO_KEY)
    return locks if isinstance(locks, ConnectionLocks) else None


@event.listens_for(Engine, "commit")
def _transaction_committed(connection: Connection) -> None:
    locks = _locks_of(connection)
    if locks is not None:
        locks.transaction_ended()


@event.listens_for(Engine, "rollback")
def _transaction_rolled_back(connection: Connection) -> None:
    locks = _locks_of(connection)
    if locks is None:
        return
    locks.transaction_ended()
    if not locks.pending_release:
        return
    # Unlocks that the failed transaction postponed can run once it has ended, but
    # SQLAlchemy announces a rollback before sending it: end the transaction here (the
    # rollback SQLAlchemy then sends is harmless, and session unlocks survive it), so
    # the locks are not held while the connection sits idle. If this fails, the next
    # transaction's begin or the pool's checkin finishes them.
    fairy = connection.connection
    dbapi_connection = fairy.dbapi_connection
    if dbapi_connection is None:
        return
    try:
        dbapi_connection.rollback()
        _release_session_locks(
            locks, dbapi_connection, fairy.driver_connection, fairy.info, pending_only=True
        )
    except Exception:
        logger.debug("postponed unlocks wait for the next transaction", exc_info=True)


@event.listens_for(Pool, "invalidate")
def _connection_invalidated(
    dbapi_connection: DBAPIConnection | None,
    record: ConnectionPoolEntry,
    exception: BaseException | None,
) -> None:
    _connection_gone(record.info)


@event.listens_for(Pool, "close")
def _connection_closed(
    dbapi_connection: DBAPIConnection | None, record: ConnectionPoolEntry
) -> None:
    _connection_gone(record.info)


def _connection_gone(info: dict[Any, Any]) -> None:
    # The server lets go of a closed session's locks; forget them too, so a release
    # reports LockLost instead of reaching for a connection that is gone, and let a
    # backend that holds locks in this process (SQLite's files) free them now rather
    # than when the pool reuses the slot.
    locks = info.get(LOCKS_INFO_KEY)
    if not isinstance(locks, ConnectionLocks):
        return
    for holding in [*locks.holdings.values(), *locks.pending_release]:
        locks.forget(holding)
    locks.pending_release.clear()
    locks.savepoints.clear()
    backend: object = locks.backend
    if isinstance(backend, HoldsLocksClientSide):
        backend.connection_closed(info.get(STATE_INFO_KEY, {}))


@event.listens_for(Engine, "begin")
def _transaction_began(connection: Connection) -> None:
    locks = _locks_of(connection)
    if locks is not None and locks.pending_release:
        fairy = connection.connection
        _release_session_locks(
            locks, fairy.dbapi_connection, fairy.driver_connection, fairy.info, pending_only=True
        )


@event.listens_for(Engine, "before_execute")
def _savepoint_started(connection: Connection, statement: object, *arguments: object) -> None:
    # Not the "savepoint" event: SQLAlchemy fires it before naming an automatic
    # savepoint (begin_nested(), Session savepoints), so its name is None there and a
    # later rollback to it could not be matched. The SAVEPOINT statement has the name.
    if isinstance(statement, SavepointClause):
        connection_locks(connection.info).savepoint_started(statement.ident)


@event.listens_for(Engine, "rollback_savepoint")
def _savepoint_rolled_back(connection: Connection, name: str, context: object) -> None:
    locks = _locks_of(connection)
    if locks is not None:
        locks.savepoint_rolled_back(name)


@event.listens_for(Engine, "release_savepoint")
def _savepoint_released(connection: Connection, name: str, context: object) -> None:
    locks = _locks_of(connection)
    if locks is not None:
        locks.savepoint_released(name)


@event.listens_for(Pool, "checkin")
def _guard_checkin(dbapi_connection: DBAPIConnection | None, record: ConnectionPoolEntry) -> None:
    # The pool has rolled the connection back, which ends every transaction lock but no
    # session lock. A session lock still recorded here was never released (its lock
    # object was dropped, or its Connection closed inside the block): release it now, so
    # the next borrower of this connection cannot inherit it.
    if dbapi_connection is None:
        return
    info = record.info
    locks = info.get(LOCKS_INFO_KEY)
    try:
        if isinstance(locks, ConnectionLocks):
            locks.transaction_ended()
            if locks.session_holdings():
                _release_session_locks(
                    locks, dbapi_connection, record.driver_connection, record.info
                )
                # Unless it is in autocommit, the driver opened a transaction for the
                # unlocks. Rolling it back keeps them (session unlocks ignore rollback)
                # and gives the pool an idle connection, not one with a stale snapshot.
                dbapi_connection.rollback()
        if info.pop(AUTOCOMMIT_INFO_KEY, False):
            _set_autocommit(dbapi_connection, False)
    except Exception as error:
        record.invalidate(error)


def _release_session_locks(
    locks: ConnectionLocks,
    dbapi_connection: Any,
    driver_connection: Any,
    info: dict[Any, Any],
    *,
    pending_only: bool = False,
) -> None:
    """Unlock the session locks still recorded (each was taken once on the server):
    only those whose release waited for a failed transaction to end, or all of them."""
    if locks.backend is None:
        return
    executor = executor_for(dbapi_connection, driver_connection, info)
    holdings = list(locks.pending_release) if pending_only else locks.session_holdings()
    locks.pending_release.clear()
    for holding in holdings:
        locks.forget(holding)
        locks.backend.release(executor, holding.key, shared=holding.shared)
