"""SQLAlchemy binding: find the connection a lock must run on, and keep pools clean.

Where a lock lives, by bind:

- ``Connection``: on that connection. Re-entrancy is counted per DB-API connection.
- ``Session``: a session lock runs on one connection the Session keeps for as long as it
  holds session locks (its *lock connection*), so ``commit()``/``rollback()`` (which give
  the Session's own connection back to the pool) neither release nor leak it. While it is
  kept, the Session's transactions run on it too (``session.bind`` is that Connection), so
  a Session never holds two pooled connections and never waits for itself. A transaction
  lock runs on ``session.connection()``, inside the Session's transaction.
- ``Engine``: each lock checks out its own connection and returns it after release.

Single-connection pools (``StaticPool``, ``SingletonThreadPool``): the connection a lock
gets is the one the application is using. The lock joins the transaction it may have
open, never switches its mode, and never gives it back in a way that resets it.

Pool guard: a connection that comes back to the pool while this library still records a
session lock on it is unlocked before anyone else can check it out, or discarded.

Importing this module registers the binding with the core's ``advisory_lock()`` and
installs the listeners (class-level, on every Engine and Pool).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeAlias

from sqlalchemy import event
from sqlalchemy import exc as sqlalchemy_errors
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.pool import (
    AssertionPool,
    Pool,
    PoolProxiedConnection,
    SingletonThreadPool,
    StaticPool,
)
from sqlalchemy.sql.expression import SavepointClause
from sqlalchemy.util import await_only, greenlet_spawn

from advisory_locks._bindings._sqlalchemy_compat import (
    adapter_begin_if_needed,
    check_out_again,
    connection_on,
    cut_from_pool,
    give_back_without_reset,
    is_newest_checkout,
    pool_entry,
    raise_connect_error,
    report_disconnect,
    report_pooled_disconnect,
    session_has_binds,
    static_pool_checkout,
    transaction_connections,
)
from advisory_locks._core import connection as _connection_module
from advisory_locks._core.advisory import (
    AdvisoryLock,
    AdvisoryLockSet,
    AsyncAdvisoryLock,
    AsyncAdvisoryLockSet,
)
from advisory_locks._core.connection import (
    POOLER_MODES,
    ConnectionState,
    check_server,
    current_process_id,
    finish_pending_releases,
    opened_before_fork,
    release_session_locks,
    server_checked,
)
from advisory_locks._core.contract import LockOptions, Timeout
from advisory_locks._core.dispatch import register_binding
from advisory_locks._core.executors import (
    PQTRANS_IDLE,
    PQTRANS_UNKNOWN,
    DBAPIExecutor,
    claim_idle_autocommit,
    driver_autocommit,
    driver_in_transaction,
    in_pipeline,
    libpq_connection,
    pipeline_refusal,
    psycopg_cursor,
    restore_driver_autocommit,
    set_driver_autocommit,
)
from advisory_locks._core.libpq import NOT_SENT, libpq_statements
from advisory_locks._core.steps import ROWS, SCRIPT, VALUE, Statement, Steps, run_steps
from advisory_locks._dialects import Backend, backend_for_dialect, loaded_backends
from advisory_locks.errors import (
    AdvisoryLockError,
    LockConnectionLost,
    LockUsageError,
    UnsupportedFeature,
)
from advisory_locks.keys import LockKey, LockName

logger = logging.getLogger("advisory_locks")

if TYPE_CHECKING:
    from sqlalchemy.engine.interfaces import DBAPIConnection, Dialect
    from sqlalchemy.pool import ConnectionPoolEntry

__all__ = [
    "POOLER_OPTION",
    "AsyncBind",
    "LockConnectionTimeout",
    "SQLAlchemyBinding",
    "SyncBind",
    "sync_bind",
]

SyncBind: TypeAlias = Session | Connection | Engine
AsyncBind: TypeAlias = AsyncSession | AsyncConnection | AsyncEngine

# Keys in a pooled connection's info dict (it lives and dies with the DB-API connection).
STATE_INFO_KEY: Final = "advisory_locks.state"
EXECUTOR_INFO_KEY: Final = "advisory_locks.executor"
AUTOCOMMIT_INFO_KEY: Final = "advisory_locks.restore_autocommit"
SESSION_INFO_KEY: Final = "advisory_locks.session_connection"
# In a Session's info: its SessionPin, while it keeps a lock connection.
PIN_INFO_KEY: Final = "advisory_locks.session_pin"
# In a pooled connection's info: the lock checkouts that hold it now (see _guard_checkin).
LOCK_CHECKOUTS_INFO_KEY: Final = "advisory_locks.lock_checkouts"
# Pools that hand the same DB-API connection to more than one checkout: everything a lock
# does on it, the application's other users of the pool see.
SINGLE_CONNECTION_POOLS: Final = (StaticPool, SingletonThreadPool, AssertionPool)
# (process id, weak reference to the pool entry), recorded when the DB-API connection opens.
CONNECTED_INFO_KEY: Final = "advisory_locks.connected"
# (DB-API connection, driver connection): see _driver().
DRIVER_INFO_KEY: Final = "advisory_locks.driver_connection"
# The _ConnectionParts of the Connection that last locked on this DB-API connection.
PARTS_INFO_KEY: Final = "advisory_locks.connection_parts"
# The _PooledParts of the engine locks' checkouts of this DB-API connection.
POOLED_PARTS_INFO_KEY: Final = "advisory_locks.pooled_parts"
# Execution option declaring what sits between the engine and the server:
# "transaction" (session locks refused), "session" (a pooler that pins each client to
# one server connection), or "none".
POOLER_OPTION: Final = "advisory_locks_pooler"
TRANSACTION_POOLER_DECLARED: Final = f"the engine declares {POOLER_OPTION}='transaction'"
DECLARE_POOLER: Final = f"create_engine(..., execution_options={{'{POOLER_OPTION}': 'session'}})"


class LockConnectionTimeout(AdvisoryLockError, sqlalchemy_errors.TimeoutError):
    """A lock needed a connection from the engine's pool and none came free in time.

    Raised instead of SQLAlchemy's pool ``TimeoutError`` (which it also is, so handlers
    for that keep working), with a message that says how to size the pool; ``__cause__``
    is SQLAlchemy's error. ``name`` is the lock's name (None for a lock set, whose names
    the message gives).
    """

    def __init__(self, message: str, *, name: LockName | None = None) -> None:
        super().__init__(message)
        self.name = name


LockConnectionTimeout.__module__ = "advisory_locks.sqlalchemy"


def _declared_pooler(execution_options: Any) -> object:
    pooler = execution_options.get(POOLER_OPTION)
    if pooler is not None and pooler not in POOLER_MODES:
        raise ValueError(f"{POOLER_OPTION} must be one of {POOLER_MODES}, not {pooler!r}")
    return pooler


class SQLAlchemyBinding:
    """Locks on SQLAlchemy binds, registered with the core dispatch."""

    def lock(self, bind: Any, key: LockKey, options: LockOptions) -> Any:
        # The common binds, without the dispatch below.
        cls = type(bind)
        if cls is Connection:
            return AdvisoryLock(ConnectionSite(bind), key, options)
        if cls is Engine and not options.transaction:
            return AdvisoryLock(EngineSite(bind, (key,)), key, options)
        if cls is Session:
            return AdvisoryLock(SessionSite(bind, (key,), options.shared), key, options)
        sync = sync_bind(bind)
        site = _site_for(sync, transaction=options.transaction, keys=(key,), shared=options.shared)
        lock = AdvisoryLock(site, key, options)
        if sync is bind:
            return lock
        return AsyncAdvisoryLock(lock, _run_in_greenlet(site), call=_call_in_greenlet)

    def lock_set(
        self, bind: Any, keys: list[LockKey], options: LockOptions, timeout: Timeout
    ) -> Any:
        sync = sync_bind(bind)
        site: Any
        if isinstance(sync, Engine) and not options.transaction:
            # One connection for the whole set: a connection per lock could exhaust the
            # pool while the set waits for its next lock.
            site = SharedEngineSite(sync, tuple(keys))
        else:
            site = _site_for(
                sync, transaction=options.transaction, keys=tuple(keys), shared=options.shared
            )
        lock_set = AdvisoryLockSet(
            site, (AdvisoryLock(site, key, options) for key in keys), timeout=timeout
        )
        if sync is bind:
            return lock_set
        return AsyncAdvisoryLockSet(lock_set, _run_in_greenlet(site), call=_call_in_greenlet)

    def held_names(self, bind: Any) -> list[LockName]:
        names: list[LockName] = _site_for(sync_bind(bind), transaction=False).held_names()
        return names

    def lease_site(self, bind: Any, *, connect: object = None) -> Any:
        if connect is not None:
            raise TypeError(
                "connect= is for raw driver connections; a SQLAlchemy bind's leases open "
                "their connections from its Engine's pool"
            )
        from advisory_locks._bindings.sqlalchemy_lease import lease_site

        return lease_site(bind)


def _run_in_greenlet(site: Any) -> Any:
    # SQLAlchemy's asyncio binds run blocking DB-API code in a greenlet; the steps run
    # there with blocking calls, exactly as for a sync bind.
    def run(steps: Steps[Any]) -> Any:
        return greenlet_spawn(run_steps, steps, site)

    return run


async def _call_in_greenlet(function: Callable[[], Any]) -> Any:
    # A blocking lock's own acquire or release, run as SQLAlchemy's asyncio binds run
    # blocking DB-API code.
    return await greenlet_spawn(function)


def sync_bind(bind: object) -> SyncBind:
    """The sync object behind a SQLAlchemy bind (an async one's ``sync_*``)."""
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


def _site_for(
    bind: SyncBind, *, transaction: bool, keys: tuple[LockKey, ...] = (), shared: bool = False
) -> Any:
    if isinstance(bind, Connection):
        return ConnectionSite(bind)
    if isinstance(bind, Engine):
        if transaction:
            raise UnsupportedFeature(
                "transaction=True needs a transaction, and an Engine has none: pass a "
                "Connection or Session inside a transaction, or use a session lock"
            )
        return EngineSite(bind, keys)
    return SessionSite(bind, keys, shared=shared)


def _backend_for(engine: Engine) -> Backend:
    name = engine.dialect.name
    # backend_for_dialect(name), without the call once the backend is loaded
    return loaded_backends.get(name) or backend_for_dialect(name)


def _what(keys: tuple[LockKey, ...]) -> str:
    """How errors name the lock(s) a site serves."""
    if len(keys) == 1:
        return f"advisory lock {keys[0].name!r}"
    return f"advisory locks {[key.name for key in keys]!r}" if keys else "an advisory lock"


def _no_connection(engine: Engine, keys: tuple[LockKey, ...]) -> LockConnectionTimeout:
    return LockConnectionTimeout(
        f"{_what(keys)} needed a connection from the engine's pool and none came free within its "
        f"pool_timeout ({engine.pool.status()}). A thread or task holding a lock holds a "
        "connection: a Session that holds session locks keeps one (its transactions run "
        "on it), an Engine lock takes one per lock, besides any connection the thread "
        "holds already. Make pool_size + max_overflow at least the number of threads or "
        "tasks that hold connections at once, or take the lock on a Connection or "
        "Session that is open already.",
        name=keys[0].name if len(keys) == 1 else None,
    )


def _check_out(engine: Engine, keys: tuple[LockKey, ...]) -> PoolProxiedConnection:
    """A pooled connection for locks, opened by this process; on a StaticPool in use,
    that use's own connection, counted once more, so that giving it back resets nothing
    under its user."""
    in_use = static_pool_checkout(engine.pool)
    if in_use is not None and _opened_here(in_use):
        return check_out_again(in_use)
    try:
        return _own_connection(engine, _raw_connection(engine))
    except sqlalchemy_errors.TimeoutError as error:
        raise _no_connection(engine, keys) from error


def _raw_connection(engine: Engine) -> PoolProxiedConnection:
    """``engine.raw_connection()``, failing as ``engine.connect()`` fails: with
    SQLAlchemy's error, not the driver's (an Engine lock's own checkout calls it inline)."""
    try:
        return engine.raw_connection()
    except engine.dialect.loaded_dbapi.Error as error:
        raise_connect_error(engine, error)


def _opened_here(fairy: PoolProxiedConnection) -> bool:
    return _opener(fairy) == current_process_id()


def _opener(fairy: PoolProxiedConnection) -> int:
    """The process that opened ``fairy``'s DB-API connection, as ``_connected`` recorded
    it at connect. A connection opened before this module hooked the pools is recorded
    at its first lock instead: as this process's, unless its socket was open when this
    process was forked (``opened_before_fork``), and then as the parent's."""
    connected = fairy.info.get(CONNECTED_INFO_KEY)
    if connected is not None:
        return connected[0]  # type: ignore[no-any-return]
    opener = opened_before_fork(_driver(fairy)) or current_process_id()
    record = pool_entry(fairy)
    if record is not None:
        record.info[CONNECTED_INFO_KEY] = (opener, weakref.ref(record))
    return opener


def _give_back(fairy: PoolProxiedConnection, *, shared: bool) -> None:
    """Give back a lock's checkout, never resetting a connection someone else now uses.

    A StaticPool checkout that a later one superseded is not the pool's to reset any
    more: SQLAlchemy drops such a proxy without touching the connection, and so do we.
    A shared connection with a transaction open on it goes back without the pool's
    rollback, which would end that transaction.
    """
    if fairy.dbapi_connection is None:
        fairy.close()
    elif not is_newest_checkout(fairy):
        return
    elif shared and _inside_transaction(fairy):
        give_back_without_reset(fairy)
    else:
        fairy.close()


def _lock_checkouts(info: dict[Any, Any]) -> weakref.WeakSet[Any]:
    """The lock checkouts holding this pooled connection now (on a single-connection
    pool, another user's checkout can go back while a lock still holds it)."""
    checkouts = info.get(LOCK_CHECKOUTS_INFO_KEY)
    if not isinstance(checkouts, weakref.WeakSet):
        checkouts = info[LOCK_CHECKOUTS_INFO_KEY] = weakref.WeakSet()
    return checkouts


def _driver(fairy: PoolProxiedConnection) -> Any:
    """``fairy.driver_connection`` (three calls into the pool and the dialect), kept in
    the connection's ``info`` with the DB-API connection it belongs to."""
    dbapi = fairy.dbapi_connection
    info = fairy.info
    cached = info.get(DRIVER_INFO_KEY)
    if cached is not None and cached[0] is dbapi:
        return cached[1]
    driver = fairy.driver_connection
    info[DRIVER_INFO_KEY] = (dbapi, driver)
    return driver


def _inside_transaction(fairy: PoolProxiedConnection, *connections: Connection | None) -> bool:
    """Whether a statement sent now on this connection runs inside an open transaction,
    which a lock must join rather than end: one SQLAlchemy began on it, or one the driver
    reports (another user of a single-connection pool, or the driver used directly)."""
    for connection in connections:
        if connection is not None and connection.in_transaction():
            # SQLAlchemy keeps "transactions" on AUTOCOMMIT connections too; none is open.
            return not driver_autocommit(fairy.dbapi_connection)
    return driver_in_transaction(_driver(fairy)) is True


def connection_state(
    info: dict[Any, Any],
    backend: Backend | None = None,
    fairy: PoolProxiedConnection | None = None,
) -> ConnectionState:
    """The state stored with a pooled DB-API connection (dropped if it is replaced).

    A lock passes the checked-out ``fairy`` it runs on, so that a forked child can cut
    that connection from its pool even when it was opened before this module was
    imported (and so without the process id and pool entry ``_connected`` records).
    """
    state = info.get(STATE_INFO_KEY)
    if not isinstance(state, ConnectionState):
        connected = info.get(CONNECTED_INFO_KEY)
        if connected is not None:
            state = ConnectionState(pid=connected[0])
        elif fairy is not None:
            state = ConnectionState(pid=_opener(fairy))
        else:
            state = ConnectionState()
        info[STATE_INFO_KEY] = state
    if state.fork_hook is None:
        connected = info.get(CONNECTED_INFO_KEY)
        record = connected[1]() if connected is not None else None
        if record is None and fairy is not None:
            record = pool_entry(fairy)
        if record is not None:
            entry = weakref.ref(record)
            state.fork_hook = lambda: _cut_entry(entry)
    if backend is not None:
        state.backend = backend
    return state


def executor_for(fairy: PoolProxiedConnection | ConnectionPoolEntry, info: dict[Any, Any]) -> Any:
    """One executor (and so one cursor) per DB-API connection, kept in its ``info``."""
    dbapi_connection = fairy.dbapi_connection
    cached = info.get(EXECUTOR_INFO_KEY)
    if cached is not None and cached.connection is dbapi_connection:
        return cached
    state = connection_state(info).driver_state
    driver = fairy.driver_connection
    module = type(driver).__module__
    executor: Any
    if module.startswith("asyncpg"):
        executor = AdaptedAsyncpgExecutor(dbapi_connection, driver, state)
    elif driver is not dbapi_connection and module == "psycopg":
        executor = AdaptedPsycopgExecutor(dbapi_connection, driver, state)
    else:
        executor = DBAPIExecutor(dbapi_connection, state)
    info[EXECUTOR_INFO_KEY] = executor
    return executor


class AdaptedAsyncpgExecutor:
    """Executor for SQLAlchemy's asyncpg adapter, run inside SQLAlchemy's greenlet.

    The adapter's cursor prepares every statement, which rejects multi-statement
    scripts, so statements go to the asyncpg connection itself.
    """

    __slots__ = ("_driver", "connection", "state")

    def __init__(self, adapter: Any, driver: Any, state: dict[str, Any]) -> None:
        self.connection = adapter
        self._driver = driver
        self.state = state

    def execute(self, statement: Statement) -> object:
        adapter_begin_if_needed(self.connection, await_only)
        kind = statement.kind
        if kind == VALUE:
            return await_only(self._driver.fetchval(_numbered(statement.sql), *statement.params))
        if kind == SCRIPT:
            await_only(self._driver.execute(statement.sql))
            return None
        assert kind == ROWS
        rows = await_only(self._driver.fetch(_numbered(statement.sql), *statement.params))
        return [tuple(row) for row in rows]


def _numbered(sql: str) -> str:
    # asyncpg's placeholders are $1, $2, ...; a statement's text has "%s" only as those.
    parts = sql.split("%s")
    return parts[0] + "".join(f"${position}{part}" for position, part in enumerate(parts[1:], 1))


class AdaptedPsycopgExecutor:
    """Executor for SQLAlchemy's adapter of psycopg's AsyncConnection.

    The adapter's cursor takes no ``prepare`` argument, and psycopg prepares every
    statement with ``prepare_threshold=0``, which a script of several statements cannot
    be: scripts go to the AsyncConnection itself, unprepared. The driver keeps the
    transaction state, so both paths see the same transaction.
    """

    __slots__ = ("_driver", "_executor", "_libpq")

    def __init__(self, adapter: Any, driver: Any, state: dict[str, Any]) -> None:
        self._executor = DBAPIExecutor(adapter, state)
        self._driver = driver
        # Value statements in autocommit go to the AsyncConnection without a cursor
        # (see libpq), unless the application gave it a cursor class of its own.
        self._libpq = libpq_statements(psycopg_cursor(driver), state)

    @property
    def connection(self) -> Any:
        return self._executor.connection

    @property
    def state(self) -> dict[str, Any]:
        return self._executor.state

    def execute(self, statement: Statement) -> object:
        if self._driver._pipeline is not None:
            raise pipeline_refusal()
        kind = statement.kind
        if kind == SCRIPT:
            await_only(self._driver.execute(statement.sql, prepare=False))
            return None
        libpq = self._libpq
        if libpq is not None and kind == VALUE:
            value = await_only(libpq.avalue(statement))
            if value is not NOT_SENT:
                return value
        return self._executor.execute(statement)


class ConnectionSite:
    """Locks on a Connection the caller owns."""

    __slots__ = ("backend", "connection")
    binding = "sqlalchemy"

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        name = connection.engine.dialect.name  # _backend_for(), without the call
        self.backend = loaded_backends.get(name) or backend_for_dialect(name)

    def borrow(self, *, transaction: bool) -> ConnectionBorrow:
        connection, backend = self.connection, self.backend
        try:  # _connection_borrow(), without the call (and positional: see _AutocommitExecutor)
            return ConnectionBorrow(connection, backend, transaction)
        except Exception as error:
            _borrow_failed(connection, backend, error)

    def held_names(self) -> list[LockName]:
        if self.connection.closed or self.connection.invalidated:
            return []
        return connection_state(self.connection.info).names()


class _SettledAtOnce:
    """A borrowed connection whose give-back is a blocking call made at once."""

    __slots__ = ()
    settled_by_done = True

    def settle(self) -> None:
        pass

    async def asettle(self) -> None:
        pass


class _ConnectionParts:
    """What every lock's borrow of one Connection shares while the Connection keeps one
    DB-API connection: made at its first lock and kept in the pooled connection's ``info``
    (so a replaced DB-API connection, whose ``info`` SQLAlchemy empties, never finds it),
    so that each later lock reads the state, the executor and the driver connection with
    one lookup instead of building them again.

    It refers to nothing the pool's entry must not keep alive: the Connection weakly,
    and never the pool's checkout (a Connection dropped unclosed goes back to the pool
    when its checkout is collected). Nor does a borrow's executor refer to its borrow,
    so a lock leaves no reference cycle behind for the garbage collector.
    """

    __slots__ = (
        "backend",
        "connection",
        "dbapi",
        "driver",
        "executor",
        "options",
        "persist",
        "pgconn",
        "pooler",
        "state",
    )

    def __init__(
        self, connection: Connection, fairy: PoolProxiedConnection, backend: Backend
    ) -> None:
        info = fairy.info
        self.connection = weakref.ref(connection)
        self.dbapi = fairy.dbapi_connection
        self.backend = backend
        self.driver = _driver(fairy)
        self.pgconn = libpq_connection(self.driver)
        self.state = state = connection_state(info, backend, fairy)
        # A forked child's copy of its parent's connection gets no executor: nothing may
        # be sent on it.
        self.executor: Any = None if state.inherited else executor_for(fairy, info)
        # On a single-connection pool others may use the driver connection without
        # SQLAlchemy: a lock puts the autocommit mode back after each statement there.
        self.persist = not isinstance(connection.engine.pool, SINGLE_CONNECTION_POOLS)
        # The pooler the Connection's execution options declare, and those options (a
        # Connection's options are replaced, never changed, when it is given new ones).
        self.options: object = None
        self.pooler: object = None
        info[PARTS_INFO_KEY] = self

    def declared_pooler(self, options: Any) -> object:
        pooler = _declared_pooler(options)
        self.options, self.pooler = options, pooler
        return pooler

    def inside_transaction(self) -> bool:
        # _inside_transaction(fairy, connection), asked before each statement, without
        # going through the pool's proxies for the driver connection.
        connection = self.connection()
        if connection is not None and connection.in_transaction():
            return not driver_autocommit(self.dbapi)
        return self.driver_inside()

    def driver_inside(self) -> bool:
        """Whether the driver has a transaction open that SQLAlchemy did not begin."""
        pgconn = self.pgconn
        if pgconn is None:
            return driver_in_transaction(self.driver) is True
        # driver_in_transaction() on psycopg 3, in one read (UNKNOWN: a bad connection)
        status: int = pgconn.transaction_status
        return status != PQTRANS_IDLE and status != PQTRANS_UNKNOWN


class ConnectionBorrow(_SettledAtOnce):
    """A caller's Connection: never closed or returned by the lock."""

    __slots__ = ("connection", "executor", "fairy", "in_transaction", "state")

    def __init__(self, connection: Connection, backend: Backend, transaction: bool) -> None:
        self.connection = connection
        self.fairy = fairy = connection.connection
        info = fairy.info
        parts = info.get(PARTS_INFO_KEY)
        if (
            parts is None
            or parts.connection() is not connection
            or parts.dbapi is not fairy.dbapi_connection
            or parts.backend is not backend
        ):
            parts = _ConnectionParts(connection, fairy, backend)
        self.state = state = parts.state
        if state.inherited:
            # A forked child's copy of its parent's connection: nothing may be sent on
            # it (the lock refuses it, naming itself).
            self.in_transaction = False
            return
        # Switched to autocommit by an earlier lock: no transaction has begun since (the
        # "begin" hook below takes the key away first).
        switched = AUTOCOMMIT_INFO_KEY in info
        if not switched and driver_autocommit(parts.dbapi):
            # In autocommit as the application configured it (not as an earlier lock
            # left it: that mode goes when a transaction begins, so it needs the
            # executor that switches).
            if transaction:
                raise UnsupportedFeature(
                    "transaction=True needs a transaction, but this connection is in "
                    "AUTOCOMMIT mode, where every statement is its own transaction"
                )
            self.executor: Any = parts.executor
        elif transaction:
            if not connection.in_transaction():
                if in_pipeline(parts.dbapi):
                    # Refused before the autobegin, which would leave the Connection in
                    # a transaction for a lock statement that is never sent.
                    raise pipeline_refusal()
                # Like any statement on a Connection, a transaction lock autobegins.
                connection.begin()
            self.executor = parts.executor
        elif not backend.locks_on_server:
            # Nothing the lock does reaches the server as a transaction-opening
            # statement (SQLite's locks are files): leave the connection's mode alone.
            self.executor = parts.executor
        else:
            # A session lock must not open a transaction that SQLAlchemy does not know
            # about, on an idle connection or at a release after the caller's transaction
            # ended; it runs as autocommit whenever no transaction is open. The mode stays
            # switched until SQLAlchemy next begins a transaction on the connection or
            # takes it back (the "begin" and "checkin" hooks below put it back first), so
            # that a lock and its release switch once, not around each statement (except
            # on a single-connection pool: see _ConnectionParts.persist).
            self.executor = _AutocommitExecutor(
                fairy, parts.inside_transaction, parts.persist, parts.executor
            )
        options = connection.get_execution_options()
        pooler = parts.pooler if options is parts.options else parts.declared_pooler(options)
        if pooler is not None or state.behind_proxy is not False:  # not server_checked()
            _check_server_once(state, self.executor, fairy, pooler, session_lock=not transaction)
        self.in_transaction = transaction or (
            parts.driver_inside() if switched else parts.inside_transaction()
        )
        if state.pending_release and not connection.in_transaction():
            # A failed transaction postponed these unlocks and has ended since.
            run_steps(finish_pending_releases(state, self.executor))

    def done(self) -> None:
        pass

    def broken(self, error: BaseException) -> None:
        if isinstance(error, Exception):
            # Gone: SQLAlchemy's own disconnect handling, pool and all.
            report_disconnect(self.connection, error)
        elif not (self.connection.invalidated or self.connection.closed):
            # Interrupted mid-statement: this connection's state is unknown.
            self.connection.invalidate()

    def is_disconnect(self, error: Exception) -> bool:
        return _dialect_disconnect(self.connection.dialect, error, self.fairy)


def _connection_borrow(
    connection: Connection, backend: Backend, *, transaction: bool
) -> ConnectionBorrow:
    """A ``ConnectionBorrow``; a connection that died under the statements it runs to get
    ready is handed to SQLAlchemy's disconnect handling and reported as such."""
    try:
        return ConnectionBorrow(connection, backend, transaction)
    except Exception as error:
        _borrow_failed(connection, backend, error)


def _borrow_failed(connection: Connection, backend: Backend, error: Exception) -> NoReturn:
    """Raise what an error making a ``ConnectionBorrow`` means: the error itself, or
    ``LockConnectionLost`` for a connection that died (reported to SQLAlchemy first)."""
    if (connection.invalidated or connection.closed) or not (
        backend.is_connection_failure(error)
        or _dialect_disconnect(connection.dialect, error, connection.connection)
    ):
        raise error
    report_disconnect(connection, error)
    raise LockConnectionLost(str(error)) from error


class _AutocommitExecutor:
    """Runs each statement with the DB-API connection in autocommit, unless ``inside()``
    says a transaction is open on it, which the statement then joins.

    The mode is put back exactly as it was: at once, after that one statement, so that
    whoever else uses the connection finds the mode they configured; or, with
    ``persist``, when SQLAlchemy next begins a transaction on the connection or takes it
    back (a Session's lock connection: one switch per lock, not two per statement).
    """

    __slots__ = ("_executor", "fairy", "inside", "persist")

    def __init__(
        self,
        fairy: PoolProxiedConnection,
        inside: Callable[[], bool],
        persist: bool = False,
        executor: Any = None,
    ) -> None:
        # Positional arguments where a lock makes one: Python 3.11 builds a dict for the
        # keywords of a call to a class.
        self.fairy = fairy
        self.inside = inside
        self.persist = persist
        # The connection's executor_for(), where the caller has it at hand.
        self._executor = executor_for(fairy, fairy.info) if executor is None else executor

    @property
    def state(self) -> dict[str, Any]:
        return connection_state(self.fairy.info).driver_state

    def execute(self, statement: Statement) -> object:
        fairy = self.fairy
        info = fairy.info
        dbapi = fairy.dbapi_connection
        executor = self._executor
        if executor.connection is not dbapi:  # the checkout now holds another connection
            executor = self._executor = executor_for(fairy, info)
        if AUTOCOMMIT_INFO_KEY in info:  # switched by an earlier statement, kept so
            return executor.execute(statement)
        inside = self.inside() if self.persist else None
        # The usual first statement (psycopg 3, idle): switched in one read.
        if inside is False and _claim_autocommit(dbapi, info):
            return executor.execute(statement)
        # In autocommit already, or inside a transaction the statement joins: it runs as
        # it is either way (the cheaper question first).
        if inside or driver_autocommit(dbapi) or (inside is None and self.inside()):
            return executor.execute(statement)
        previous = set_driver_autocommit(dbapi, True)
        if self.persist:
            info[AUTOCOMMIT_INFO_KEY] = (previous,)
            return executor.execute(statement)
        try:
            result = executor.execute(statement)
        except BaseException:
            # A connection that broke mid-statement cannot be switched back (psycopg:
            # "can't change 'autocommit' now"), and the statement's own error is the one
            # that says the connection is gone.
            with contextlib.suppress(Exception):
                restore_driver_autocommit(dbapi, previous)
            raise
        restore_driver_autocommit(dbapi, previous)
        return result


def _claim_autocommit(dbapi: Any, info: dict[Any, Any]) -> bool:
    """``claim_idle_autocommit`` on a pooled connection, recording the mode it had in
    ``info`` for the "begin" and "checkin" hooks to put back; False, with nothing changed,
    where the caller must ask the general questions."""
    previous = claim_idle_autocommit(dbapi)
    if previous is None:
        return False
    if not previous:
        info[AUTOCOMMIT_INFO_KEY] = (False,)
    return True


def _check_server_once(
    state: ConnectionState,
    executor: Any,
    fairy: PoolProxiedConnection,
    pooler: object,
    *,
    session_lock: bool,
) -> None:
    """``check_server`` for a lock's connection, unless ``server_checked`` says it would
    send nothing and refuse nothing (every lock after a connection's first)."""
    if not server_checked(state, pooler):
        run_steps(
            check_server(
                state,
                executor,
                _driver(fairy),
                pooler=pooler,
                session_lock=session_lock,
                declare_pooler=DECLARE_POOLER,
                transaction_pooler_declared=TRANSACTION_POOLER_DECLARED,
            )
        )


class _PooledParts:
    """What every lock's checkout of one pooled DB-API connection from an engine shares:
    its state and executor, made at the first and kept in the connection's ``info``
    (which SQLAlchemy empties when it replaces the DB-API connection), so that each later
    checkout reads both with one lookup."""

    __slots__ = ("backend", "dbapi", "executor", "own", "pgconn", "state")

    def __init__(self, fairy: PoolProxiedConnection, backend: Backend) -> None:
        info = fairy.info
        self.dbapi = dbapi = fairy.dbapi_connection
        self.backend = backend
        self.state = connection_state(info, backend, fairy)
        self.executor = executor = executor_for(fairy, info)
        # A blocking psycopg 3 connection's (see _OwnCheckoutExecutor), else None.
        self.pgconn = libpq_connection(dbapi) if type(executor) is DBAPIExecutor else None
        # An engine lock's executor on its own checkout, made at the first that needs it.
        self.own: _OwnCheckoutExecutor | None = None
        info[POOLED_PARTS_INFO_KEY] = self


class _OwnCheckoutExecutor:
    """Runs the session-lock statements of a lock's own checkout of a blocking psycopg 3
    connection, idle at checkout, from a pool of many (so no one else uses it while the
    lock has it): an engine lock's (one per DB-API connection, kept in its _PooledParts),
    or a Session's lock connection's (_PinnedExecutor).

    A session lock's statements need no transaction. Where libpq sends them (see
    ``LibpqStatements.value``'s ``outside``), they run on the idle connection whatever
    its autocommit mode, so the checkout is not switched to autocommit and back. A
    statement libpq does not send switches the connection to autocommit first, for the
    rest of the checkout (the checkin hook puts the mode back), as a checkout is switched
    at once where libpq cannot send.
    """

    __slots__ = ("_dbapi", "_executor", "_info")

    def __init__(self, info: dict[Any, Any], dbapi: Any, executor: DBAPIExecutor) -> None:
        self._info = info
        self._dbapi = dbapi
        self._executor = executor

    @property
    def state(self) -> dict[str, Any]:
        return self._executor.state

    def execute(self, statement: Statement) -> object:
        executor = self._executor
        libpq = executor._libpq
        if libpq is not None and statement.kind == VALUE:
            try:
                value = libpq.value(statement, True)
            except Exception:
                executor.failed()
                raise
            if value is not NOT_SENT:
                return value
        return self._not_sent(statement)

    def _not_sent(self, statement: Statement) -> object:
        info = self._info
        if AUTOCOMMIT_INFO_KEY not in info:
            dbapi = self._dbapi
            if not driver_autocommit(dbapi):
                info[AUTOCOMMIT_INFO_KEY] = (set_driver_autocommit(dbapi, True),)
        return self._executor.execute(statement)


class _PinnedExecutor(_OwnCheckoutExecutor):
    """``_OwnCheckoutExecutor`` on a Session's lock connection, whose transactions run on
    it (SessionPin): a statement libpq does not send joins the Session's transaction
    open on it, or else switches the connection to autocommit until the Session begins
    one (``_AutocommitExecutor`` with persist)."""

    __slots__ = ("_fairy", "_inside", "_otherwise")

    def __init__(
        self, fairy: PoolProxiedConnection, executor: DBAPIExecutor, inside: Callable[[], bool]
    ) -> None:
        self._info = fairy.info
        self._dbapi = fairy.dbapi_connection
        self._executor = executor
        self._fairy = fairy
        self._inside = inside
        self._otherwise: _AutocommitExecutor | None = None

    def _not_sent(self, statement: Statement) -> object:
        otherwise = self._otherwise
        if otherwise is None:
            otherwise = self._otherwise = _AutocommitExecutor(
                self._fairy, self._inside, True, self._executor
            )
        return otherwise.execute(statement)


def _pooled_parts(fairy: PoolProxiedConnection, backend: Backend) -> _PooledParts:
    """The checkout's _PooledParts, made if its DB-API connection has none yet."""
    parts: _PooledParts | None = fairy.info.get(POOLED_PARTS_INFO_KEY)
    if parts is None or parts.dbapi is not fairy.dbapi_connection or parts.backend is not backend:
        parts = _PooledParts(fairy, backend)
    return parts


def _libpq_idle(parts: _PooledParts) -> bool:
    """Whether the lock statements on the parts' connection are sent through libpq (a
    blocking psycopg 3 connection), and it is idle now, outside a pipeline (see
    _OwnCheckoutExecutor)."""
    pgconn = parts.pgconn
    return (
        pgconn is not None
        and parts.executor._libpq is not None
        and pgconn.transaction_status == PQTRANS_IDLE
        and parts.executor.connection._pipeline is None
    )


class PooledBorrow(_SettledAtOnce):
    """A connection checked out of an engine's pool for locks only.

    It runs in autocommit (set once at checkout, put back at checkin): every acquire and
    release is one round trip, and nothing the lock does can be rolled back underneath
    it. On a single-connection pool the connection is the application's too: it is
    left in the mode the application gave it, locks join the transaction it may have
    open, and giving it back never resets it under its other user.

    It goes back to the pool once every lock it was lent to is done with it.
    """

    __slots__ = (
        "__weakref__",
        "_out",
        "_registry",
        "_users",
        "engine",
        "executor",
        "fairy",
        "plain",
        "shared",
        "state",
    )

    def __init__(
        self, engine: Engine, registry: _EngineLocks, keys: tuple[LockKey, ...], users: int = 0
    ) -> None:
        """Check a connection out of ``engine`` (whose ``_engine_locks()`` the
        ``registry`` is) for locks; lent to ``users`` locks already (``lend`` lends it to
        more)."""
        self.engine = engine
        self._registry = registry
        backend = registry.backend
        single = isinstance(engine.pool, SINGLE_CONNECTION_POOLS)
        if single:
            fairy = _check_out(engine, keys)
            info = fairy.info
        else:
            # _check_out(), without its StaticPool's question, and _own_connection()'s
            # first round, without the call: the connection this process opened.
            try:
                fairy = engine.raw_connection()
            except sqlalchemy_errors.TimeoutError as error:
                raise _no_connection(engine, keys) from error
            except engine.dialect.loaded_dbapi.Error as error:
                raise_connect_error(engine, error)
            info = fairy.info
            connected = info.get(CONNECTED_INFO_KEY)
            if connected is None or connected[0] != _connection_module._process_id:
                try:
                    fairy = _own_connection(engine, fairy)
                except sqlalchemy_errors.TimeoutError as error:
                    raise _no_connection(engine, keys) from error
                info = fairy.info
        self.fairy = fairy
        self._out = True
        self._users = users
        dbapi = fairy.dbapi_connection
        # The state and executor of an earlier lock's checkout of this DB-API connection
        # (see _PooledParts), else those connection_state() and executor_for() make:
        # _pooled_parts() and _libpq_idle(), written out on the Engine's path.
        parts: _PooledParts | None = info.get(POOLED_PARTS_INFO_KEY)
        if parts is None or parts.dbapi is not dbapi or parts.backend is not backend:
            parts = _PooledParts(fairy, backend)
        self.state = state = parts.state
        executor: Any = parts.executor
        pgconn = parts.pgconn
        if (
            not single
            and pgconn is not None
            and executor._libpq is not None
            and pgconn.transaction_status == PQTRANS_IDLE
            and executor.connection._pipeline is None
        ):
            # The usual checkout (psycopg 3, idle, a pool of many, its statements sent
            # through libpq): not in a transaction, so not shared, and left in its mode
            # (see _OwnCheckoutExecutor). Given back with a plain close(): a checkout of
            # a pool of many is its connection's newest, and a connection no one else
            # uses has no transaction of anyone's open (see _give_back()).
            own = parts.own
            if own is None:
                own = parts.own = _OwnCheckoutExecutor(info, dbapi, executor)
            self.shared = False
            self.plain = True
            self.executor: Any = own
        else:
            try:
                self._set_up(single, backend, info, dbapi, executor)
            except BaseException as error:
                self._failed(error, backend)
        options = engine.get_execution_options()
        pooler = registry.pooler if options is registry.options else registry.declared(options)
        if pooler is not None or state.behind_proxy is not False:  # not server_checked()
            try:
                _check_server_once(state, self.executor, fairy, pooler, session_lock=True)
            except BaseException as error:
                self._failed(error, backend)
        registry.borrows[id(self)] = weakref.ref(self, registry.collected)  # registry.add()

    def _set_up(
        self, single: bool, backend: Backend, info: dict[Any, Any], dbapi: Any, executor: Any
    ) -> None:
        """Every checkout but the usual one: whether the connection is shared with the
        application (a single-connection pool, a transaction open on it), and its mode."""
        self.shared = self.plain = False  # until known: what _failed() gives back
        claimed = False
        if not single and backend.locks_on_server:
            # On psycopg 3 idle: not shared, and switched to autocommit, in one read of
            # the connection (_claim_autocommit(), without the call).
            previous = claim_idle_autocommit(dbapi)
            if previous is not None:
                claimed = True
                if not previous:
                    info[AUTOCOMMIT_INFO_KEY] = (False,)
        fairy = self.fairy
        if claimed:
            self.shared = False
        else:
            self.shared = single or driver_in_transaction(_driver(fairy)) is True
            if self.shared:
                _lock_checkouts(info).add(self)
        self.plain = not single and not self.shared
        if self.shared:
            # The application's connection too: its mode stays as the application set
            # it, and a transaction open on it is joined (see _AutocommitExecutor).
            self.executor = (
                _AutocommitExecutor(fairy, lambda: _inside_transaction(fairy))
                if backend.locks_on_server
                else executor
            )
        else:
            self.executor = executor
            if not claimed and backend.locks_on_server and not driver_autocommit(dbapi):
                info[AUTOCOMMIT_INFO_KEY] = (set_driver_autocommit(dbapi, True),)

    def _failed(self, error: BaseException, backend: Backend) -> NoReturn:
        """Setting the checkout up failed: give it back (discarded where the connection
        is gone), and raise what the error means."""
        fairy = self.fairy
        if isinstance(error, Exception) and (
            backend.is_connection_failure(error) or self.is_disconnect(error)
        ):
            self._out = False
            _lock_checkouts(fairy.info).discard(self)
            report_pooled_disconnect(self.engine, fairy, error)
            fairy.close()
            raise LockConnectionLost(str(error)) from error
        self._give_back()
        raise error

    def lend(self) -> PooledBorrow:
        self._users += 1
        return self

    @property
    def in_transaction(self) -> bool:
        return self.shared and _inside_transaction(self.fairy)

    @property
    def returned(self) -> bool:
        return not self._out or self.fairy.dbapi_connection is None

    def _give_back(self) -> None:
        if not self._out:
            return
        self._out = False
        self._registry.discard(self)
        if self.plain:
            self.fairy.close()
            return
        if self.shared:  # only a shared connection's borrow was added (see __init__)
            _lock_checkouts(self.fairy.info).discard(self)
        _give_back(self.fairy, shared=self.shared)

    def done(self) -> None:
        self._users -= 1
        if self._users <= 0 and self._out:
            if self.plain:  # self._give_back(), without the call
                self._out = False
                self._registry.borrows.pop(id(self), None)
                self.fairy.close()
            else:
                self._give_back()

    def broken(self, error: BaseException) -> None:
        self._users -= 1
        if not self._out:
            return
        self._out = False
        self._registry.discard(self)
        fairy = self.fairy
        if fairy.dbapi_connection is None:
            return
        _lock_checkouts(fairy.info).discard(self)
        try:
            if isinstance(error, Exception):
                # Gone: SQLAlchemy's own disconnect handling, pool and all.
                report_pooled_disconnect(self.engine, fairy, error)
            else:
                # Interrupted mid-statement: this connection's state is unknown.
                fairy.invalidate()
        finally:
            fairy.close()

    def is_disconnect(self, error: Exception) -> bool:
        return _dialect_disconnect(self.engine.dialect, error, self.fairy)


def _dialect_disconnect(dialect: Dialect, error: Exception, fairy: Any) -> bool:
    """SQLAlchemy's verdict: whether the dialect reads ``error`` as a lost connection."""
    try:
        return isinstance(error, dialect.loaded_dbapi.Error) and bool(
            dialect.is_disconnect(error, fairy, None)
        )
    except Exception:  # a dialect that cannot tell says nothing
        return False


def _own_connection(engine: Engine, fairy: PoolProxiedConnection) -> PoolProxiedConnection:
    """``fairy``, a checkout of ``engine``'s pool, if this process opened its connection,
    else a pooled connection this process opened.

    In a forked child the pool may hand out a connection the parent opened, whose server
    session the parent goes on using: a lock taken there would be the parent's too (the
    server counts the second holder as a re-entry). Each such connection is cut from the
    child's pool without being touched (SQLAlchemy's fork recipe), and the pool opens a
    fresh one in its place. Every round cuts one inherited connection, so this ends.
    """
    while True:
        connected = fairy.info.get(CONNECTED_INFO_KEY)
        if connected is not None and connected[0] == current_process_id():
            return fairy
        if connected is None and _opener(fairy) == current_process_id():
            return fairy
        cut_from_pool(fairy)
        fairy.close()
        fairy = _raw_connection(engine)


class _EngineLocks:
    """What an engine's locks share: its backend, the pooler its execution options
    declare (an engine's options are replaced, never changed, when it is given new ones),
    and its lock borrows out now, weakly (a lock object dropped while held must not keep
    its checkout from going back to the pool when it is collected)."""

    __slots__ = ("__weakref__", "backend", "borrows", "collected", "options", "pooler")

    def __init__(self, engine: Engine) -> None:
        self.backend = _backend_for(engine)
        self.borrows: dict[int, weakref.ref[PooledBorrow]] = {}
        # The borrows' references' callback, made once rather than a bound method per
        # borrow, and referring to this weakly: no reference cycle for the collector.
        registry = weakref.ref(self)

        def collected(reference: weakref.ref[PooledBorrow]) -> None:
            found = registry()
            if found is not None:
                found._collected(reference)

        self.collected = collected
        self.options: object = None
        self.pooler: object = None

    def declared(self, options: Any) -> object:
        pooler = _declared_pooler(options)
        self.options, self.pooler = options, pooler
        return pooler

    def add(self, borrow: PooledBorrow) -> None:
        self.borrows[id(borrow)] = weakref.ref(borrow, self.collected)

    def discard(self, borrow: PooledBorrow) -> None:
        self.borrows.pop(id(borrow), None)

    def _collected(self, reference: weakref.ref[PooledBorrow]) -> None:
        # A borrow collected while out (its lock object dropped unreleased). Looked for
        # by its reference: its id may already be another borrow's.
        for key, kept in list(self.borrows.items()):
            if kept is reference:
                self.borrows.pop(key, None)

    def out(self) -> list[PooledBorrow]:
        """The borrows out now."""
        return [borrow for reference in list(self.borrows.values()) if (borrow := reference())]


# Each engine's lock parts, by id(engine): a WeakKeyDictionary would make a weak
# reference to the engine at every lookup. The entry goes when the engine does (its id
# cannot be reused before then).
_locks_by_engine: dict[int, _EngineLocks] = {}


def _engine_locks(engine: Engine) -> _EngineLocks:
    locks = _locks_by_engine.get(id(engine))
    if locks is None:
        made = _EngineLocks(engine)
        locks = _locks_by_engine.setdefault(id(engine), made)
        if locks is made:
            weakref.finalize(engine, _locks_by_engine.pop, id(engine), None)
    return locks


class EngineSite:
    """Each lock takes its own pooled connection."""

    __slots__ = ("backend", "engine", "keys", "locks")
    binding = "sqlalchemy"

    def __init__(self, engine: Engine, keys: tuple[LockKey, ...] = ()) -> None:
        self.engine = engine
        # _engine_locks(engine), without the call once the engine has them.
        self.locks = locks = _locks_by_engine.get(id(engine)) or _engine_locks(engine)
        self.backend = locks.backend
        self.keys = keys

    def borrow(self, *, transaction: bool) -> Any:
        return PooledBorrow(self.engine, self.locks, self.keys, 1)

    def held_names(self) -> list[LockName]:
        return [
            name for borrow in _engine_locks(self.engine).out() for name in borrow.state.names()
        ]

    def holds_anywhere(self, key: LockKey) -> bool:
        """Whether a lock of this engine (any thread's) holds ``key``."""
        return any(
            holding.key.ints == key.ints
            for borrow in _engine_locks(self.engine).out()
            for holding in list(borrow.state.holdings.values())
        )


class SharedEngineSite(EngineSite):
    """The locks of one lock set on an Engine share one pooled connection."""

    __slots__ = ("_borrow",)

    def __init__(self, engine: Engine, keys: tuple[LockKey, ...] = ()) -> None:
        super().__init__(engine, keys)
        self._borrow: PooledBorrow | None = None

    def borrow(self, *, transaction: bool) -> Any:
        # A borrow goes back to the pool once none of its locks is held, so a set taken
        # again after its release checks out a fresh one.
        if self._borrow is None or self._borrow.returned:
            self._borrow = PooledBorrow(self.engine, self.locks, self.keys)
        return self._borrow.lend()


class SessionPin:
    """The one connection a Session keeps while it holds session locks.

    Session locks must outlive the Session's transactions, whose connection SQLAlchemy
    gives back to the pool at every commit and rollback. A connection of their own next to
    the Session's would make each Session hold two: threads that each hold one and wait
    for a second then time out on a pool they could have shared, and a session lock and
    a transaction lock of one Session on one name wait for each other. So, for as long as
    it holds session locks, the Session's transactions run on the lock connection
    (``session.bind`` is that Connection). It goes back to the pool once no session lock
    is held on it and no transaction of the Session runs on it.

    A Session already inside a transaction when it takes its first session lock takes
    it on that transaction's connection, checked out once more so that it stays out
    when the transaction ends (``joined``); the Session's next transactions run on it.
    """

    __slots__ = (
        "__weakref__",
        "_borrow",
        "_pinned",
        "backend",
        "connection",
        "engine",
        "executor",
        "fairy",
        "joined",
        "sends_outside",
        "session",
        "shared",
        "state",
    )

    def __init__(
        self, session: Session, engine: Engine, backend: Backend, keys: tuple[LockKey, ...]
    ) -> None:
        joined = _transaction_connection_to(session, engine)
        single = isinstance(engine.pool, SINGLE_CONNECTION_POOLS)
        if joined is not None:
            fairy = check_out_again(joined.connection)
        elif single:
            fairy = _check_out(engine, keys)
        else:
            # _check_out() of a pool of many: a connection this process opened.
            try:
                fairy = engine.raw_connection()
                connected = fairy.info.get(CONNECTED_INFO_KEY)
                if connected is None or connected[0] != _connection_module._process_id:
                    fairy = _own_connection(engine, fairy)
            except sqlalchemy_errors.TimeoutError as error:
                raise _no_connection(engine, keys) from error
            except engine.dialect.loaded_dbapi.Error as error:  # _raw_connection()'s
                raise_connect_error(engine, error)
        self.connection = connection_on(engine, fairy)
        if joined is None:
            session.bind = self.connection
        self.session = weakref.ref(session)
        self.engine = engine
        self.backend = backend
        self.joined = joined
        self.fairy = fairy
        parts = _pooled_parts(fairy, backend)
        self.state = parts.state
        self.executor = parts.executor
        self._borrow: weakref.ref[PinnedBorrow] | None = None
        self._pinned = True
        self.sends_outside = False
        own = joined is None and not single and backend.locks_on_server
        if own and _libpq_idle(parts):
            # A checkout of its own from a pool of many (psycopg 3, idle, its statements
            # sent through libpq): not shared, and left in its mode (_OwnCheckoutExecutor
            # in PinnedBorrow).
            self.shared = False
            self.sends_outside = True
        elif own and _claim_autocommit(self.fairy.dbapi_connection, self.fairy.info):
            # Else, on psycopg 3 idle: not shared either, and switched to autocommit now,
            # in one read, as its first lock statement would switch it
            # (_AutocommitExecutor with persist).
            self.shared = False
        else:
            # As for PooledBorrow: a connection handed out inside a transaction is someone
            # else's too.
            self.shared = single or (
                joined is None and driver_in_transaction(_driver(self.fairy)) is True
            )
        session.info[PIN_INFO_KEY] = self
        if self.shared:
            _lock_checkouts(self.fairy.info).add(self)

    @property
    def usable(self) -> bool:
        return self._pinned and not self.connection.closed and not self.connection.invalidated

    def borrow(self) -> PinnedBorrow:
        borrow = self._borrow() if self._borrow is not None else None
        if borrow is None:
            borrow = PinnedBorrow(self)
            pin = weakref.ref(self)
            self._borrow = weakref.ref(borrow, lambda _: _lock_objects_gone(pin))
        return borrow

    def inside_transaction(self) -> bool:
        if AUTOCOMMIT_INFO_KEY in self.fairy.info:
            return False  # switched to autocommit by a lock, and no transaction began since
        if self.shared:
            return _inside_transaction(self.fairy, self.connection, self.joined)
        # Nobody else has this connection: only the Session's transactions run on it.
        joined = self.joined
        if self.connection.in_transaction() or (joined is not None and joined.in_transaction()):
            return not driver_autocommit(self.fairy.dbapi_connection)
        return False

    def _needed(self) -> bool:
        # A lock object that is gone can no longer release its lock: what it left is
        # released by the pool guard when the connection goes back.
        alive = self._borrow is not None and self._borrow() is not None
        return alive and self.state.holds_session_locks()

    def _in_use_by_session(self) -> bool:
        return self.joined is None and self.connection.in_transaction()

    def lock_done(self) -> None:
        if not self.state.holds_session_locks() and not self._in_use_by_session():
            self.unpin()

    def lock_objects_gone(self) -> None:
        if not self._pinned or self._in_use_by_session():
            return  # the end of the Session's transaction gives it back
        if self.engine.dialect.is_async:
            # Collected outside SQLAlchemy's greenlet, where no I/O can run: leave the
            # connection to SQLAlchemy's own clean-up of unreturned connections.
            self._unbind()
            return
        self.unpin()

    def transaction_ended(self) -> None:
        if not self._pinned:
            return
        if self.joined is not None:
            # The transaction it was joined to gave its connection back; ours stays out.
            self.joined = None
            session = self.session()
            if self._needed() and session is not None and session.bind is self.engine:
                session.bind = self.connection
                return
        if not self._needed():
            self.unpin()

    def broken(self, error: BaseException) -> None:
        connection = self.connection
        try:
            if isinstance(error, Exception):
                # Gone: SQLAlchemy's own disconnect handling, pool and all.
                report_disconnect(connection, error)
            elif not (connection.closed or connection.invalidated):
                # Interrupted mid-statement: this connection's state is unknown.
                connection.invalidate()
        finally:
            self.unpin()

    def _unbind(self) -> None:
        self._pinned = False
        if self.shared:  # only a shared connection's pin was added (see __init__)
            _lock_checkouts(self.fairy.info).discard(self)
        session = self.session()
        if session is None:
            return
        if session.info.get(PIN_INFO_KEY) is self:
            del session.info[PIN_INFO_KEY]
        if session.bind is self.connection:
            session.bind = self.engine

    def unpin(self) -> None:
        if not self._pinned:
            return
        self._unbind()
        connection = self.connection
        if connection.closed:
            return
        if connection.invalidated or not self.shared or connection.in_transaction():
            connection.close()
        else:
            # No transaction of the Session is open on it (else it would be kept), but
            # its other users' may be: give the checkout back as _give_back does.
            _give_back(self.fairy, shared=True)


def _lock_objects_gone(pin: weakref.ref[SessionPin]) -> None:
    alive = pin()
    if alive is not None:
        alive.lock_objects_gone()


def _transaction_connection_to(session: Session, engine: Engine) -> Connection | None:
    """The Connection the Session's transaction already has to ``engine``'s pool."""
    transaction = session.get_transaction()
    if transaction is None:
        return None
    for connection in transaction_connections(transaction):
        if (
            connection.engine.pool is engine.pool
            and not (connection.closed or connection.invalidated)
            and not connection_state(connection.info).inherited
        ):
            return connection  # type: ignore[no-any-return]
    return None


class PinnedBorrow(_SettledAtOnce):
    """Session locks on a Session's lock connection (see SessionPin)."""

    __slots__ = ("__weakref__", "executor", "pin", "state")

    def __init__(self, pin: SessionPin) -> None:
        self.pin = pin
        fairy = pin.fairy
        self.state = pin.state
        if pin.backend.locks_on_server:
            # Others may use the connection of a single-connection pool without
            # SQLAlchemy beginning anything on it: switch only for each statement there.
            if pin.sends_outside:
                # Sent through libpq while no transaction is open on the connection; a
                # statement it does not send joins the Session's transaction, or
                # switches, as below.
                self.executor: Any = _PinnedExecutor(fairy, pin.executor, pin.inside_transaction)
            else:
                self.executor = _AutocommitExecutor(
                    fairy, pin.inside_transaction, not pin.shared, pin.executor
                )
        else:
            self.executor = pin.executor
        if self.state.inherited:
            return  # a forked child's copy: nothing may be sent (the lock refuses it)
        try:
            pooler = _declared_pooler(pin.connection.get_execution_options())
            if pooler is not None or self.state.behind_proxy is not False:  # server_checked()
                _check_server_once(self.state, self.executor, fairy, pooler, session_lock=True)
        except Exception as error:
            if not (pin.backend.is_connection_failure(error) or self.is_disconnect(error)):
                raise
            pin.broken(error)
            raise LockConnectionLost(str(error)) from error

    @property
    def in_transaction(self) -> bool:
        return self.pin.inside_transaction()

    def done(self) -> None:
        self.pin.lock_done()

    def broken(self, error: BaseException) -> None:
        self.pin.broken(error)

    def is_disconnect(self, error: Exception) -> bool:
        return _dialect_disconnect(self.pin.engine.dialect, error, self.pin.fairy)


class SessionSite:
    """Session locks on the Session's lock connection; transaction locks in its
    transaction."""

    __slots__ = ("backend", "keys", "session", "shared")
    binding = "sqlalchemy"

    def __init__(
        self, session: Session, keys: tuple[LockKey, ...] = (), shared: bool = False
    ) -> None:
        self.session = session
        self.keys = keys
        self.shared = shared
        try:
            bind = session.get_bind()
        except sqlalchemy_errors.UnboundExecutionError as error:
            # Per-mapper binds= alone name no database for a lock, which maps nothing.
            raise ValueError(
                "this Session has no bind of its own to take a lock on (it has only "
                "per-mapper binds=, or none): make it with bind=engine, or take the lock "
                "on the Engine or a Connection"
            ) from error
        self.backend = _backend_for(bind if isinstance(bind, Engine) else bind.engine)

    def borrow(self, *, transaction: bool) -> Any:
        session = self.session
        pin = _session_pin(session)
        if transaction:
            if pin is None:
                self._refuse_waiting_for_itself(transaction=True)
            return _connection_borrow(self._session_connection(), self.backend, transaction=True)
        if pin is not None:
            return pin.borrow()
        bind = session.get_bind()
        if isinstance(bind, Connection):
            return _connection_borrow(bind, self.backend, transaction=False)
        if _routable(session, bind):
            pin = SessionPin(session, bind, self.backend, self.keys)
            try:
                return pin.borrow()
            except BaseException:
                pin.lock_done()
                raise
        self._refuse_waiting_for_itself(transaction=False)
        borrow = self._pooled_borrow()
        if borrow is None:
            borrow = PooledBorrow(bind, _engine_locks(bind), self.keys)
            # Only the locks keep the borrow alive: once every lock object using it is
            # gone, its connection is collected and the pool guard unlocks what they
            # left, even while this Session lives on.
            session.info[SESSION_INFO_KEY] = weakref.ref(borrow)
        return borrow.lend()

    def _session_connection(self) -> Connection:
        try:
            return self.session.connection()
        except sqlalchemy_errors.TimeoutError as error:
            bind = self.session.get_bind()
            engine = bind if isinstance(bind, Engine) else bind.engine
            raise _no_connection(engine, self.keys) from error

    def _pooled_borrow(self) -> PooledBorrow | None:
        reference = self.session.info.get(SESSION_INFO_KEY)
        borrow = reference() if isinstance(reference, weakref.ref) else None
        return borrow if isinstance(borrow, PooledBorrow) and not borrow.returned else None

    def _refuse_waiting_for_itself(self, *, transaction: bool) -> None:
        """A Session that routes its statements itself (its own get_bind(), binds per
        mapper) keeps session locks on a connection of their own, apart from its
        transaction's: one name taken in both scopes would wait for itself there."""
        if transaction:
            borrow = self._pooled_borrow()
            others = [] if borrow is None else [borrow.state]
        else:
            others = _transaction_states(self.session)
        for state in others:
            for key in self.keys:
                for held_shared in (False, True):
                    if self.shared and held_shared:
                        continue  # shared locks admit each other
                    if state.find(key, shared=held_shared, transaction=not transaction):
                        raise LockUsageError(
                            f"this Session holds {key.name!r} as a "
                            f"{'session' if transaction else 'transaction'} lock on another "
                            "of its connections, so taking it as a "
                            f"{'transaction' if transaction else 'session'} lock would wait "
                            "for itself. This Session routes its statements itself (its "
                            "get_bind() or binds), so its session locks cannot share its "
                            "transaction's connection: take the name in one scope only"
                        )

    def held_names(self) -> list[LockName]:
        states: dict[int, ConnectionState] = {}
        pin = _session_pin(self.session)
        if pin is not None:
            states[id(pin.state)] = pin.state
        borrow = self._pooled_borrow()
        if borrow is not None:
            states[id(borrow.state)] = borrow.state
        for state in _transaction_states(self.session):
            states[id(state)] = state
        bind = self.session.get_bind()
        # A Session bound to a Connection takes its session locks on that connection.
        if isinstance(bind, Connection) and not (bind.closed or bind.invalidated):
            state = connection_state(bind.info)
            states[id(state)] = state
        return [name for state in states.values() for name in state.names()]


def _session_pin(session: Session) -> SessionPin | None:
    pin = session.info.get(PIN_INFO_KEY)
    if not isinstance(pin, SessionPin):
        return None
    if pin.state.inherited:
        # A forked child's copy of its parent's Session: the lock connection and its
        # locks are the parent's. The child's Session goes back to its engine (for a
        # connection of the child's own), touching nothing of the parent's.
        pin._unbind()
        return None
    return pin if pin.usable else None


def _routable(session: Session, bind: Engine) -> bool:
    """Whether the Session sends every statement to ``session.bind`` (so its transactions
    can run on the lock connection), rather than choosing binds itself."""
    return (
        session.bind is bind
        and type(session).get_bind is Session.get_bind
        and not session_has_binds(session)
    )


def _transaction_states(session: Session) -> list[ConnectionState]:
    transaction = session.get_transaction()
    if transaction is None:
        return []
    # Only connections the transaction already has can hold its locks. Asking for one
    # would connect, which an AsyncSession cannot do from sync code.
    return [
        connection_state(connection.info)
        for connection in transaction_connections(transaction)
        if not (connection.closed or connection.invalidated)
    ]


# -- events: transaction ends, savepoints, and the pool guard ------------------------------


def _state_of(connection: Connection) -> ConnectionState | None:
    if connection.invalidated or connection.closed:
        return None
    state = connection.info.get(STATE_INFO_KEY)
    return state if isinstance(state, ConnectionState) else None


@event.listens_for(Engine, "commit")
def _transaction_committed(connection: Connection) -> None:
    state = _state_of(connection)
    if state is not None:
        state.transaction_ended("commit")


@event.listens_for(Engine, "rollback")
def _transaction_rolled_back(connection: Connection) -> None:
    state = _state_of(connection)
    if state is None:
        return
    state.transaction_ended("rollback")
    if not state.pending_release:
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
        run_steps(finish_pending_releases(state, executor_for(fairy, fairy.info)))
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
    state = info.get(STATE_INFO_KEY)
    if isinstance(state, ConnectionState):
        state.connection_gone()


@event.listens_for(Engine, "begin")
def _transaction_began(connection: Connection) -> None:
    if connection.invalidated or connection.closed:
        return
    restore = connection.info.pop(AUTOCOMMIT_INFO_KEY, None)
    if restore is not None:
        # A Session's lock connection left in autocommit by its locks: the Session's
        # transaction needs the mode the application configured, before its first
        # statement.
        restore_driver_autocommit(connection.connection.dbapi_connection, restore[0])
    state = _state_of(connection)
    if state is not None and state.pending_release:
        fairy = connection.connection
        run_steps(finish_pending_releases(state, executor_for(fairy, fairy.info)))


@event.listens_for(Engine, "set_connection_execution_options")
def _isolation_level_set(connection: Connection, options: dict[str, Any]) -> None:
    if "isolation_level" in options and not (connection.closed or connection.invalidated):
        # SQLAlchemy is about to set the driver's mode itself (AUTOCOMMIT or not): the
        # mode a lock's statements left behind must not be put back over it later.
        connection.info.pop(AUTOCOMMIT_INFO_KEY, None)


@event.listens_for(Engine, "before_execute")
def _savepoint_started(connection: Connection, statement: object, *arguments: object) -> None:
    # Not the "savepoint" event: SQLAlchemy fires it before naming an automatic
    # savepoint (begin_nested(), Session savepoints), so its name is None there and a
    # later rollback to it could not be matched. The SAVEPOINT statement has the name.
    if isinstance(statement, SavepointClause):
        connection_state(connection.info).savepoint_started(statement.ident)


@event.listens_for(Engine, "rollback_savepoint")
def _savepoint_rolled_back(connection: Connection, name: str, context: object) -> None:
    state = _state_of(connection)
    if state is not None:
        state.savepoint_rolled_back(name)


@event.listens_for(Engine, "release_savepoint")
def _savepoint_released(connection: Connection, name: str, context: object) -> None:
    state = _state_of(connection)
    if state is not None:
        state.savepoint_released(name)


@event.listens_for(Session, "after_transaction_end")
def _session_transaction_ended(session: Session, transaction: Any) -> None:
    # After SQLAlchemy gave back (or kept, for a Connection bind) the transaction's
    # connections: a Session's lock connection may go back to the pool now, or, joined
    # to the transaction that just ended, becomes the Session's bind.
    if transaction.parent is not None:
        return
    pin = session.info.get(PIN_INFO_KEY)
    if isinstance(pin, SessionPin):
        pin.transaction_ended()


@event.listens_for(Pool, "connect")
def _connected(dbapi_connection: DBAPIConnection, record: ConnectionPoolEntry) -> None:
    # Which process opened the connection: a forked child must never take a lock on, nor
    # unlock through, a connection of its parent's.
    record.info[CONNECTED_INFO_KEY] = (current_process_id(), weakref.ref(record))


def _cut_entry(entry: weakref.ref[ConnectionPoolEntry]) -> None:
    # In a forked child, for a connection that carries the parent's locks.
    record = entry()
    if record is not None:
        cut_from_pool(record)


@event.listens_for(Pool, "checkin")
def _guard_checkin(dbapi_connection: DBAPIConnection | None, record: ConnectionPoolEntry) -> None:
    # The pool has rolled the connection back, which ends every transaction lock but no
    # session lock. A session lock still recorded here was never released (its lock
    # object was dropped, or its Connection closed inside the block): release it now, so
    # the next borrower of this connection cannot inherit it.
    if dbapi_connection is None:
        return
    info = record.info
    state = info.get(STATE_INFO_KEY)
    if state is not None and state.inherited:
        # A forked child checking in its copy of a parent's connection: the locks and
        # the session settings are the parent's; send nothing.
        return
    try:
        # A connection this library recorded nothing on (every lock's checkout, once its
        # lock is released) needs only its autocommit mode back.
        if state is not None and (state.holdings or state.savepoints or state.pending_release):
            state.transaction_ended("rollback")
            # On a single-connection pool another user's checkout comes back while a
            # lock's own checkout still holds the connection: its locks stay.
            if state.session_holdings() and not _lock_checkouts(info):
                run_steps(release_session_locks(state, executor_for(record, info)))
                # Unless it is in autocommit, the driver opened a transaction for the
                # unlocks. Rolling it back keeps them (session unlocks ignore rollback)
                # and gives the pool an idle connection, not one with a stale snapshot.
                dbapi_connection.rollback()
        restore = info.pop(AUTOCOMMIT_INFO_KEY, None)
        if restore is not None:
            restore_driver_autocommit(dbapi_connection, restore[0])
    except Exception as error:
        record.invalidate(error)


register_binding(
    (Session, Connection, Engine, AsyncSession, AsyncConnection, AsyncEngine), SQLAlchemyBinding()
)
