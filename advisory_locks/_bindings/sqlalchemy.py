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

Importing this module registers the binding with the core's ``advisory_lock()`` and
installs the listeners (class-level, on every Engine and Pool).
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.pool import Pool, PoolProxiedConnection
from sqlalchemy.sql.expression import SavepointClause
from sqlalchemy.util import await_only, greenlet_spawn

from advisory_locks._bindings._sqlalchemy_compat import (
    adapter_begin_if_needed,
    cut_from_pool,
    pool_entry,
    report_disconnect,
    report_pooled_disconnect,
    transaction_connections,
)
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
    release_session_locks,
)
from advisory_locks._core.contract import LockOptions, Timeout
from advisory_locks._core.dispatch import register_binding
from advisory_locks._core.executors import (
    DBAPIExecutor,
    driver_autocommit,
    restore_driver_autocommit,
    set_driver_autocommit,
)
from advisory_locks._core.steps import ROWS, SCRIPT, VALUE, Statement, Steps, run_steps
from advisory_locks._dialects import Backend, backend_for_dialect
from advisory_locks.errors import LockConnectionLost, UnsupportedFeature
from advisory_locks.keys import LockKey, LockName

logger = logging.getLogger("advisory_locks")

if TYPE_CHECKING:
    from sqlalchemy.engine.interfaces import DBAPIConnection, Dialect
    from sqlalchemy.pool import ConnectionPoolEntry

__all__ = ["POOLER_OPTION", "AsyncBind", "SQLAlchemyBinding", "SyncBind", "sync_bind"]

SyncBind: TypeAlias = Session | Connection | Engine
AsyncBind: TypeAlias = AsyncSession | AsyncConnection | AsyncEngine

# Keys in a pooled connection's info dict (it lives and dies with the DB-API connection).
STATE_INFO_KEY: Final = "advisory_locks.state"
EXECUTOR_INFO_KEY: Final = "advisory_locks.executor"
AUTOCOMMIT_INFO_KEY: Final = "advisory_locks.restore_autocommit"
SESSION_INFO_KEY: Final = "advisory_locks.session_connection"
# (process id, weak reference to the pool entry), recorded when the DB-API connection opens.
CONNECTED_INFO_KEY: Final = "advisory_locks.connected"
# Execution option declaring what sits between the engine and the server:
# "transaction" (session locks refused), "session" (a pooler that pins each client to
# one server connection), or "none".
POOLER_OPTION: Final = "advisory_locks_pooler"
TRANSACTION_POOLER_DECLARED: Final = f"the engine declares {POOLER_OPTION}='transaction'"
DECLARE_POOLER: Final = f"create_engine(..., execution_options={{'{POOLER_OPTION}': 'session'}})"


def _declared_pooler(execution_options: Any) -> object:
    pooler = execution_options.get(POOLER_OPTION)
    if pooler is not None and pooler not in POOLER_MODES:
        raise ValueError(f"{POOLER_OPTION} must be one of {POOLER_MODES}, not {pooler!r}")
    return pooler


class SQLAlchemyBinding:
    """Locks on SQLAlchemy binds, registered with the core dispatch."""

    def lock(self, bind: Any, key: LockKey, options: LockOptions) -> Any:
        sync = sync_bind(bind)
        lock = AdvisoryLock(_site_for(sync, transaction=options.transaction), key, options)
        if sync is bind:
            return lock
        return AsyncAdvisoryLock(lock, _run_in_greenlet(lock._site))

    def lock_set(
        self, bind: Any, keys: list[LockKey], options: LockOptions, timeout: Timeout
    ) -> Any:
        sync = sync_bind(bind)
        site: Any
        if isinstance(sync, Engine) and not options.transaction:
            # One connection for the whole set: a connection per lock could exhaust the
            # pool while the set waits for its next lock.
            site = SharedEngineSite(sync)
        else:
            site = _site_for(sync, transaction=options.transaction)
        lock_set = AdvisoryLockSet(
            site, (AdvisoryLock(site, key, options) for key in keys), timeout=timeout
        )
        if sync is bind:
            return lock_set
        return AsyncAdvisoryLockSet(lock_set, _run_in_greenlet(site))

    def held_names(self, bind: Any) -> list[LockName]:
        names: list[LockName] = _site_for(sync_bind(bind), transaction=False).held_names()
        return names

    def lease_site(self, bind: Any) -> Any:
        if sync_bind(bind) is not bind:
            raise UnsupportedFeature(
                "lease locks on asyncio binds are not available yet: pass the sync "
                "Engine (async_engine.sync_engine) from a thread, or use an advisory lock"
            )
        from advisory_locks._bindings.sqlalchemy_lease import lease_site

        return lease_site(bind)


def _run_in_greenlet(site: Any) -> Any:
    # SQLAlchemy's asyncio binds run blocking DB-API code in a greenlet; the steps run
    # there with blocking calls, exactly as for a sync bind.
    def run(steps: Steps[Any]) -> Any:
        return greenlet_spawn(run_steps, steps, site)

    return run


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


def _site_for(bind: SyncBind, *, transaction: bool) -> Any:
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
        state = ConnectionState() if connected is None else ConnectionState(pid=connected[0])
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
    executor: Any
    if type(driver).__module__.startswith("asyncpg"):
        executor = AdaptedAsyncpgExecutor(dbapi_connection, driver, state)
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


class ConnectionSite:
    """Locks on a Connection the caller owns."""

    __slots__ = ("backend", "connection")

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.backend = _backend_for(connection.engine)

    def borrow(self, *, transaction: bool) -> ConnectionBorrow:
        return _connection_borrow(self.connection, self.backend, transaction=transaction)

    def held_names(self) -> list[LockName]:
        if self.connection.closed or self.connection.invalidated:
            return []
        return connection_state(self.connection.info).names()


class _SettledAtOnce:
    """A borrowed connection whose give-back is a blocking call made at once."""

    __slots__ = ()

    def settle(self) -> None:
        pass

    async def asettle(self) -> None:
        pass


class ConnectionBorrow(_SettledAtOnce):
    """A caller's Connection: never closed or returned by the lock."""

    __slots__ = ("connection", "executor", "fairy", "in_transaction", "state")

    def __init__(self, connection: Connection, backend: Backend, *, transaction: bool) -> None:
        fairy = connection.connection
        dbapi = fairy.dbapi_connection
        info = fairy.info
        self.fairy = fairy
        if connection_state(info, backend, fairy).inherited:
            # A forked child's copy of its parent's connection: nothing may be sent on
            # it (the lock refuses it, naming itself).
            self.connection, self.in_transaction = connection, False
            self.state = connection_state(info)
            return
        if driver_autocommit(dbapi):
            if transaction:
                raise UnsupportedFeature(
                    "transaction=True needs a transaction, but this connection is in "
                    "AUTOCOMMIT mode, where every statement is its own transaction"
                )
            self.executor: Any = executor_for(fairy, info)
        elif transaction:
            if not connection.in_transaction():
                # Like any statement on a Connection, a transaction lock autobegins.
                connection.begin()
            self.executor = executor_for(fairy, info)
        elif not backend.locks_on_server:
            # Nothing the lock does reaches the server as a transaction-opening
            # statement (SQLite's locks are files): leave the connection's mode alone.
            self.executor = executor_for(fairy, info)
        else:
            # A session lock must not open a transaction that SQLAlchemy does not know
            # about, on an idle connection or at a release after the caller's transaction
            # ended; it runs as autocommit whenever no transaction is open.
            self.executor = _AutocommitExecutor(connection, fairy)
        self.connection = connection
        self.state = connection_state(info, backend)
        run_steps(
            check_server(
                self.state,
                self.executor,
                fairy.driver_connection,
                pooler=_declared_pooler(connection.get_execution_options()),
                session_lock=not transaction,
                declare_pooler=DECLARE_POOLER,
                transaction_pooler_declared=TRANSACTION_POOLER_DECLARED,
            )
        )
        self.in_transaction = connection.in_transaction()
        if self.state.pending_release and not self.in_transaction:
            # A failed transaction postponed these unlocks and has ended since.
            run_steps(finish_pending_releases(self.state, self.executor))

    def done(self) -> None:
        pass

    def broken(self, error: BaseException) -> None:
        if isinstance(error, Exception):
            # Gone: SQLAlchemy's own disconnect handling, pool and all.
            report_disconnect(self.connection, error)
        elif not self.connection.invalidated:
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
        return ConnectionBorrow(connection, backend, transaction=transaction)
    except Exception as error:
        if (connection.invalidated or connection.closed) or not (
            backend.is_connection_failure(error)
            or _dialect_disconnect(connection.dialect, error, connection.connection)
        ):
            raise
        report_disconnect(connection, error)
        raise LockConnectionLost(str(error)) from error


class _AutocommitExecutor:
    """Runs each statement with the DB-API connection in autocommit, if SQLAlchemy has
    no transaction open on it at that moment; inside the caller's transaction otherwise."""

    __slots__ = ("connection", "fairy")

    def __init__(self, connection: Connection, fairy: PoolProxiedConnection) -> None:
        self.connection = connection
        self.fairy = fairy

    @property
    def state(self) -> dict[str, Any]:
        return connection_state(self.fairy.info).driver_state

    def execute(self, statement: Statement) -> object:
        dbapi = self.fairy.dbapi_connection
        executor = executor_for(self.fairy, self.fairy.info)
        if self.connection.in_transaction() or driver_autocommit(dbapi):
            return executor.execute(statement)
        previous = set_driver_autocommit(dbapi, True)
        try:
            return executor.execute(statement)
        finally:
            restore_driver_autocommit(dbapi, previous)


class PooledBorrow(_SettledAtOnce):
    """A connection checked out of an engine's pool for locks only, in autocommit mode.

    Autocommit keeps every acquire and release to one round trip, and means nothing the
    lock does can be rolled back underneath it.
    """

    __slots__ = ("__weakref__", "engine", "executor", "fairy", "in_transaction", "state")

    in_transaction: bool

    def __init__(self, engine: Engine, backend: Backend) -> None:
        self.engine = engine
        self.fairy = _own_connection(engine)
        self.state = connection_state(self.fairy.info, backend, self.fairy)
        try:
            dbapi = self.fairy.dbapi_connection
            if backend.locks_on_server and not driver_autocommit(dbapi):
                self.fairy.info[AUTOCOMMIT_INFO_KEY] = (set_driver_autocommit(dbapi, True),)
            self.executor: Any = executor_for(self.fairy, self.fairy.info)
            run_steps(
                check_server(
                    self.state,
                    self.executor,
                    self.fairy.driver_connection,
                    pooler=_declared_pooler(engine.get_execution_options()),
                    session_lock=True,
                    declare_pooler=DECLARE_POOLER,
                    transaction_pooler_declared=TRANSACTION_POOLER_DECLARED,
                )
            )
        except BaseException as error:
            if isinstance(error, Exception) and (
                backend.is_connection_failure(error) or self.is_disconnect(error)
            ):
                report_pooled_disconnect(engine, self.fairy, error)
                self.fairy.close()
                raise LockConnectionLost(str(error)) from error
            self.fairy.close()
            raise
        self.in_transaction = False
        _engine_borrows(engine).add(self)

    @property
    def returned(self) -> bool:
        return self.fairy.dbapi_connection is None

    def done(self) -> None:
        if self.state.holdings or self.state.pending_release or self.returned:
            return
        _engine_borrows(self.engine).discard(self)
        self.fairy.close()

    def broken(self, error: BaseException) -> None:
        _engine_borrows(self.engine).discard(self)
        if self.returned:
            return
        if isinstance(error, Exception):
            # Gone: SQLAlchemy's own disconnect handling, pool and all.
            report_pooled_disconnect(self.engine, self.fairy, error)
        else:
            # Interrupted mid-statement: this connection's state is unknown.
            self.fairy.invalidate()
        self.fairy.close()

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


def _own_connection(engine: Engine) -> PoolProxiedConnection:
    """A pooled connection this process opened.

    In a forked child the pool may hand out a connection the parent opened, whose server
    session the parent goes on using: a lock taken there would be the parent's too (the
    server counts the second holder as a re-entry). Each such connection is cut from the
    child's pool without being touched (SQLAlchemy's fork recipe), and the pool opens a
    fresh one in its place. Every round cuts one inherited connection, so this ends.
    """
    while True:
        fairy = engine.raw_connection()
        connected = fairy.info.get(CONNECTED_INFO_KEY)
        if connected is None or connected[0] == current_process_id():
            return fairy
        cut_from_pool(fairy)
        fairy.close()


_borrows_by_engine: weakref.WeakKeyDictionary[Engine, weakref.WeakSet[PooledBorrow]] = (
    weakref.WeakKeyDictionary()
)


def _engine_borrows(engine: Engine) -> weakref.WeakSet[PooledBorrow]:
    borrows = _borrows_by_engine.get(engine)
    if borrows is None:
        borrows = _borrows_by_engine[engine] = weakref.WeakSet()
    return borrows


class EngineSite:
    """Each lock takes its own pooled connection."""

    __slots__ = ("backend", "engine")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.backend = _backend_for(engine)

    def borrow(self, *, transaction: bool) -> Any:
        return PooledBorrow(self.engine, self.backend)

    def held_names(self) -> list[LockName]:
        return [
            name for borrow in list(_engine_borrows(self.engine)) for name in borrow.state.names()
        ]

    def holds_anywhere(self, key: LockKey) -> bool:
        """Whether a lock of this engine (any thread's) holds ``key``."""
        return any(
            holding.key.ints == key.ints
            for borrow in list(_engine_borrows(self.engine))
            for holding in list(borrow.state.holdings.values())
        )


class SharedEngineSite(EngineSite):
    """The locks of one lock set on an Engine share one pooled connection."""

    __slots__ = ("_borrow",)

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self._borrow: PooledBorrow | None = None

    def borrow(self, *, transaction: bool) -> Any:
        # A borrow goes back to the pool once none of its locks is held, so a set taken
        # again after its release checks out a fresh one.
        if self._borrow is None or self._borrow.returned:
            self._borrow = PooledBorrow(self.engine, self.backend)
        return self._borrow


class SessionSite:
    """Session locks on one pooled connection per Session; transaction locks in its
    transaction."""

    __slots__ = ("backend", "session")

    def __init__(self, session: Session) -> None:
        self.session = session
        bind = session.get_bind()
        self.backend = _backend_for(bind if isinstance(bind, Engine) else bind.engine)

    def borrow(self, *, transaction: bool) -> Any:
        if transaction:
            return _connection_borrow(self.session.connection(), self.backend, transaction=True)
        bind = self.session.get_bind()
        if isinstance(bind, Connection):
            return _connection_borrow(bind, self.backend, transaction=False)
        borrow = self._pooled_borrow()
        if borrow is None:
            borrow = PooledBorrow(bind, self.backend)
            # Only the locks keep the borrow alive: once every lock object using it is
            # gone, its connection is collected and the pool guard unlocks what they
            # left, even while this Session lives on.
            self.session.info[SESSION_INFO_KEY] = weakref.ref(borrow)
        return borrow

    def _pooled_borrow(self) -> PooledBorrow | None:
        reference = self.session.info.get(SESSION_INFO_KEY)
        borrow = reference() if isinstance(reference, weakref.ref) else None
        return borrow if isinstance(borrow, PooledBorrow) and not borrow.returned else None

    def held_names(self) -> list[LockName]:
        names: list[LockName] = []
        borrow = self._pooled_borrow()
        if borrow is not None:
            names += borrow.state.names()
        bind = self.session.get_bind()
        # A Session bound to a Connection takes its session locks on that connection.
        connections = {bind} if isinstance(bind, Connection) else set()
        transaction = self.session.get_transaction()
        if transaction is not None:
            # Only connections the transaction already has can hold its locks. Asking
            # for one would connect, which an AsyncSession cannot do from sync code.
            connections.update(transaction_connections(transaction))
        for connection in connections:
            names += ConnectionSite(connection).held_names()
        return names


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
        state.transaction_ended()


@event.listens_for(Engine, "rollback")
def _transaction_rolled_back(connection: Connection) -> None:
    state = _state_of(connection)
    if state is None:
        return
    state.transaction_ended()
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
    state = _state_of(connection)
    if state is not None and state.pending_release:
        fairy = connection.connection
        run_steps(finish_pending_releases(state, executor_for(fairy, fairy.info)))


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
    if isinstance(state, ConnectionState) and state.inherited:
        # A forked child checking in its copy of a parent's connection: the locks and
        # the session settings are the parent's; send nothing.
        return
    try:
        if isinstance(state, ConnectionState):
            state.transaction_ended()
            if state.session_holdings():
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
