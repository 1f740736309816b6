"""Lease locks on SQLAlchemy binds: where their statements run, and the lease ``Table``.

Every lease statement borrows a connection from the bind's Engine pool in autocommit mode
and gives it back at once (a Session or Connection bind only names its Engine: the
caller's transaction is never used, except by ``fence()``, whose point is to run inside
it). Holding a lease pins no connection. The renewer opens its own connections from a
copy of the Engine's pool (``Pool.recreate()``: the same URL, connect arguments and
connect events), so it never waits for a connection the application holds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final

from sqlalchemy import BigInteger, Column, DateTime, MetaData, String, Table
from sqlalchemy import exc as sqlalchemy_errors
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.util import greenlet_spawn

from advisory_locks._bindings._sqlalchemy_compat import (
    raise_connect_error,
    report_pooled_disconnect,
)
from advisory_locks._bindings.sqlalchemy import (
    POOLER_OPTION,
    LockConnectionTimeout,
    _dialect_disconnect,
    executor_for,
    sync_bind,
)
from advisory_locks._core.executors import (
    DBAPIExecutor,
    driver_autocommit,
    driver_in_transaction,
    restore_driver_autocommit,
    set_driver_autocommit,
)
from advisory_locks._core.listener import (
    LISTENING_DRIVERS,
    AsyncReleaseListener,
    ReleaseListener,
)
from advisory_locks._core.steps import Steps, run_steps
from advisory_locks._dialects.lease import LEASE_TABLE, LeaseBackend, lease_backend_for_dialect
from advisory_locks.errors import LockConnectionLost, UnsupportedFeature

logger = logging.getLogger("advisory_locks")

__all__ = [
    "CREATE_HINT",
    "SQLAlchemyAsyncLeaseSite",
    "SQLAlchemyLeaseSite",
    "create_lease_table",
    "lease_site",
    "lease_table",
]

CREATE_HINT: Final = (
    f"the table {LEASE_TABLE} does not exist in this database. Create it once with "
    "advisory_locks.sqlalchemy.create_lease_table(engine), or add "
    "advisory_locks.sqlalchemy.lease_table(metadata) to your metadata and migrations "
    "(Alembic); Django projects: manage.py migrate advisory_locks_django"
)


def _name_type() -> Any:
    # Binary collation on MySQL: "Job" and "job" are two leases, as on the other databases.
    return String(255).with_variant(
        mysql.VARCHAR(255, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


def _time_type() -> Any:
    # Microseconds on MySQL (its DATETIME defaults to whole seconds).
    return DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def lease_table(metadata: MetaData) -> Table:
    """The ``advisory_locks_lease`` Table in ``metadata`` (added once, then returned)."""
    existing = metadata.tables.get(LEASE_TABLE)
    if existing is not None:
        return existing
    return Table(
        LEASE_TABLE,
        metadata,
        Column("name", _name_type(), primary_key=True, autoincrement=False),
        Column("holder", _name_type(), nullable=True),
        Column("token", BigInteger(), nullable=False),
        Column("acquired_at", _time_type(), nullable=False),
        Column("renewed_at", _time_type(), nullable=False),
        Column("expires_at", _time_type(), nullable=False),
        mysql_engine="InnoDB",
        comment="Lease locks of advisory-locks: rows are never deleted (token counts on)",
    )


def create_lease_table(bind: Any) -> None:
    """Create ``advisory_locks_lease`` in ``bind``'s database if it does not exist."""
    engine = _engine_of(bind)
    backend = lease_backend_for_dialect(engine.dialect.name)
    with engine.connect() as connection:
        for sql in backend.create_table():
            connection.exec_driver_sql(sql)
        connection.commit()


def _engine_of(bind: Any) -> Engine:
    sync = sync_bind(bind)
    if isinstance(sync, Engine):
        return sync
    if isinstance(sync, Connection):
        return sync.engine
    engine = sync.get_bind()
    return engine if isinstance(engine, Engine) else engine.engine


class LeaseBorrow:
    """A pooled connection in autocommit mode for one lease statement (or two).

    A connection found dead is reported as an advisory lock's checkout reports one
    (``report_pooled_disconnect``): the engine's ``handle_error`` hooks run, and the pool
    replaces every connection it opened before, which a restart or a failover has ended
    too, so the next checkout (``SQLAlchemyLeaseSite.borrow_anew``) is a new one.
    """

    __slots__ = ("_backend", "_broken", "_engine", "_restore", "executor", "fairy")

    def __init__(self, engine: Engine, backend: LeaseBackend) -> None:
        try:
            self.fairy: PoolProxiedConnection = engine.raw_connection()
        except sqlalchemy_errors.TimeoutError as error:
            raise LockConnectionTimeout(
                "a lease lock needed a connection from the engine's pool for one of its "
                f"statements and none came free within its pool_timeout "
                f"({engine.pool.status()}). A held lease keeps no connection, but each "
                "acquire, release and ensure_held() borrows one: make "
                "pool_size + max_overflow at least the number of threads or tasks that "
                "use connections at once."
            ) from error
        except engine.dialect.loaded_dbapi.Error as error:
            raise_connect_error(engine, error)  # what engine.connect() raises
        self._engine = engine
        self._backend = backend
        dbapi = self.fairy.dbapi_connection
        self._restore: tuple[object] | None = None
        self._broken: BaseException | None = None
        try:
            if not driver_autocommit(dbapi):
                self._restore = (set_driver_autocommit(dbapi, True),)
            self.executor: Any = executor_for(self.fairy, self.fairy.info)
        except BaseException as error:
            if self._discard(error):
                # Switching to autocommit sends a statement on some drivers (PyMySQL):
                # a pooled connection the server ended fails there, as at a lease's
                # first statement.
                raise LockConnectionLost(
                    f"a lease lock's connection to the database was lost ({error})"
                ) from error
            raise

    def done(self) -> None:
        pass

    def broken(self, error: BaseException) -> None:
        self._broken = error

    def settle(self) -> None:
        fairy = self.fairy
        if fairy.dbapi_connection is None:
            return
        if self._broken is not None:
            self._discard(self._broken)
            return
        try:
            if self._restore is not None:
                restore_driver_autocommit(fairy.dbapi_connection, self._restore[0])
        except BaseException as error:
            # The connection, whose mode could not be put back, does not go back to the
            # pool as it is. The statements were answered: their result stands (an
            # interruption, though, goes on up).
            self._discard(error)
            if not isinstance(error, Exception):
                raise
            logger.debug("a lease connection's mode could not be restored", exc_info=True)
            return
        fairy.close()

    def _discard(self, error: BaseException) -> bool:
        """Give the connection back for good after ``error``; whether it was a disconnect
        (then reported so, to the engine and its whole pool)."""
        fairy = self.fairy
        gone = isinstance(error, Exception) and (
            self._backend.is_connection_failure(error)
            or _dialect_disconnect(self._engine.dialect, error, fairy)
        )
        try:
            if gone:
                assert isinstance(error, Exception)
                report_pooled_disconnect(self._engine, fairy, error)
            else:
                fairy.invalidate(error if isinstance(error, Exception) else None)
        finally:
            fairy.close()
        return gone

    async def asettle(self) -> None:
        self.settle()


class _RenewalConnection:
    __slots__ = ("executor", "fairy")

    def __init__(self, fairy: PoolProxiedConnection) -> None:
        self.fairy = fairy
        self.executor = DBAPIExecutor(fairy.dbapi_connection)

    def close(self) -> None:
        # Discarded rather than pooled: a renewer's connection is opened again only
        # after a failure or when the process holds leases again.
        self.fairy.invalidate()
        self.fairy.close()


class _ListenConnection:
    __slots__ = ("driver", "fairy")

    def __init__(self, fairy: PoolProxiedConnection) -> None:
        self.fairy = fairy
        self.driver = fairy.driver_connection

    def close(self) -> None:
        # Never back to a pool: it is still LISTENing.
        self.fairy.invalidate()
        self.fairy.close()


class SQLAlchemyLeaseSite:
    """The leases of one Engine's database."""

    create_hint = CREATE_HINT
    binding = "sqlalchemy"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.backend: LeaseBackend = lease_backend_for_dialect(engine.dialect.name)
        # Copies of the Engine's pool for the renewer's and for the listener's connection:
        # one copy each, so that a listener idling on the only connection a copy of a
        # pool of one may open never starves the renewer.
        self._own_pools: dict[str, Any] = {}
        self._listener: ReleaseListener | None = None
        self._async_site: SQLAlchemyAsyncLeaseSite | None = None

    def asynchronous_site(self) -> SQLAlchemyAsyncLeaseSite:
        """The async twin of this site, for an AsyncEngine's leases."""
        with _sites_lock:
            if self._async_site is None:
                self._async_site = SQLAlchemyAsyncLeaseSite(self)
            return self._async_site

    def borrow(self, *, transaction: bool) -> LeaseBorrow:
        return LeaseBorrow(self.engine, self.backend)

    def borrow_anew(self) -> LeaseBorrow:
        # The dead connection's settle had the pool replace every connection it opened
        # before (LeaseBorrow._discard): its next checkout is a new one.
        return LeaseBorrow(self.engine, self.backend)

    def renewal_connection(self) -> _RenewalConnection:
        return _RenewalConnection(self._renewal_fairy())

    def release_listener(self) -> ReleaseListener | None:
        """The listener that wakes this Engine's waiters, or None where LISTEN cannot
        work: another database, a driver without notifications, or an Engine declared
        behind a transaction pooler (which would LISTEN on a server connection it then
        hands to someone else)."""
        if self.backend.listen_sql is None or self.engine.dialect.driver not in LISTENING_DRIVERS:
            return None
        if self.engine.get_execution_options().get(POOLER_OPTION) == "transaction":
            return None
        with _sites_lock:
            if self._listener is None:
                self._listener = ReleaseListener(self._listen_connection, self.backend.listen_sql)
            return self._listener

    def _listen_connection(self) -> _ListenConnection:
        fairy = self._renewal_fairy("listen")
        return _ListenConnection(fairy)

    def _renewal_fairy(self, purpose: str = "renew") -> PoolProxiedConnection:
        with _sites_lock:
            pool = self._own_pools.get(purpose)
            if pool is None:
                pool = self._own_pools[purpose] = self.engine.pool.recreate()
        fairy: PoolProxiedConnection = pool.connect()
        try:
            dbapi = fairy.dbapi_connection
            assert dbapi is not None
            if not driver_autocommit(dbapi):
                if driver_in_transaction(dbapi):
                    # Connect events may have left a transaction open (psycopg refuses
                    # to switch to autocommit inside one).
                    dbapi.rollback()
                set_driver_autocommit(dbapi, True)
        except BaseException:
            fairy.invalidate()
            fairy.close()
            raise
        return fairy

    def fence_executor(self, bind: object) -> Any:
        if isinstance(bind, Session):
            connection = bind.connection()
        elif isinstance(bind, Connection):
            connection = bind
            if not connection.in_transaction():
                connection.begin()  # as any statement on a Connection would
        else:
            raise TypeError(
                "fence() runs inside your transaction: pass the SQLAlchemy Session or "
                f"Connection that makes the protected writes, not {type(bind).__name__}"
            )
        if connection.engine.dialect.name != self.engine.dialect.name:
            raise UnsupportedFeature(
                "fence() must run on the lease's own database: the lease lives on "
                f"{self.engine.dialect.name}, this connection is {connection.engine.dialect.name}"
            )
        fairy = connection.connection
        if driver_autocommit(fairy.dbapi_connection):
            raise UnsupportedFeature(
                "fence() needs a transaction, but this connection is in AUTOCOMMIT mode, "
                "where the fence would end with its own statement"
            )
        return executor_for(fairy, fairy.info)


class _AsyncPooledConnection:
    """A connection of the renewal pool for the async renewer or listener: discarded at
    close, never pooled (a listener's is still LISTENing)."""

    __slots__ = ("driver", "executor", "fairy")

    def __init__(self, fairy: PoolProxiedConnection) -> None:
        self.fairy = fairy
        self.driver = fairy.driver_connection
        self.executor = executor_for(fairy, fairy.info)

    async def aclose(self) -> None:
        await greenlet_spawn(_discard, self.fairy)


def _discard(fairy: PoolProxiedConnection) -> None:
    fairy.invalidate()
    fairy.close()


# Drivers of asyncio Engines whose connections receive notifications in the loop.
ASYNC_LISTENING_DRIVERS: Final = frozenset({"asyncpg", "psycopg", "psycopg_async"})


class SQLAlchemyAsyncLeaseSite:
    """The leases of one AsyncEngine's database, for ``AsyncLeaseLock``.

    The rules run as blocking steps inside SQLAlchemy's greenlet bridge, on the same
    pooled connections as the sync site of its ``sync_engine``; the renewer is a task of
    the running loop and opens its connection from the same copy of the pool.
    """

    asynchronous = True
    create_hint = CREATE_HINT
    binding = "sqlalchemy"

    def __init__(self, site: SQLAlchemyLeaseSite) -> None:
        self.sync = site
        self.backend = site.backend
        self._listeners: weakref.WeakKeyDictionary[Any, AsyncReleaseListener] = (
            weakref.WeakKeyDictionary()
        )

    async def run(self, steps: Steps[Any]) -> Any:
        return await greenlet_spawn(run_steps, steps, self.sync)

    async def renewal_connection(self) -> _AsyncPooledConnection:
        fairy = await greenlet_spawn(self.sync._renewal_fairy)
        return _AsyncPooledConnection(fairy)

    async def _listen_connection(self) -> _AsyncPooledConnection:
        fairy = await greenlet_spawn(self.sync._renewal_fairy, "listen")
        return _AsyncPooledConnection(fairy)

    def release_listener(self) -> AsyncReleaseListener | None:
        """This loop's listener, or None where LISTEN cannot work (as for the sync site)."""
        engine = self.sync.engine
        if self.backend.listen_sql is None or engine.dialect.driver not in ASYNC_LISTENING_DRIVERS:
            return None
        if engine.get_execution_options().get(POOLER_OPTION) == "transaction":
            return None
        loop = asyncio.get_running_loop()
        listener = self._listeners.get(loop)
        if listener is None:
            listener = self._listeners[loop] = AsyncReleaseListener(
                self._listen_connection, LEASE_TABLE
            )
        return listener

    async def fence(self, bind: object, fence_steps: Callable[[Any], Steps[None]]) -> None:
        if not isinstance(bind, (AsyncSession, AsyncConnection)):
            raise TypeError(
                "fence() runs inside your transaction: pass the AsyncSession or "
                f"AsyncConnection that makes the protected writes, not {type(bind).__name__}"
            )
        sync = sync_bind(bind)

        def fence() -> None:
            run_steps(fence_steps(self.sync.fence_executor(sync)), self.sync)

        await greenlet_spawn(fence)


_sites: weakref.WeakKeyDictionary[Engine, SQLAlchemyLeaseSite] = weakref.WeakKeyDictionary()
_sites_lock = threading.RLock()


def lease_site(bind: Any) -> SQLAlchemyLeaseSite | SQLAlchemyAsyncLeaseSite:
    """The lease site of ``bind``'s Engine (one per Engine, so its leases renew together);
    its async twin for an asyncio bind."""
    engine = _engine_of(bind)
    with _sites_lock:
        site = _sites.get(engine)
        if site is None:
            site = _sites[engine] = SQLAlchemyLeaseSite(engine)
    if sync_bind(bind) is not bind:
        return site.asynchronous_site()
    return site
