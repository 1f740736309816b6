"""Lease locks on raw driver binds: where their statements run.

The rule, the same for every raw driver:

- A pool bind lends each lease statement one of its connections and takes it back at
  once: holding a lease pins no pooled connection. A connection checked out of a pool
  (asyncpg's ``pool.acquire()`` proxy) stands for its pool.
- The renewer (and, on PostgreSQL, the LISTEN connection that wakes waiters) never uses a
  pooled connection the application might be waiting for, nor the caller's connection,
  which the application may be using at that very moment (another task, another
  thread). It opens connections of its own, made the way the pool makes its connections.
- A single connection cannot say how to open another one without guessing credentials
  (a password from a file, a token that expires, a pooler in between): ``connect=`` says
  it, a callable that returns (an awaitable of) a new connection to the same database,
  and every lease statement runs on connections it opens, never on the caller's, whose
  transaction the lease must not join. Without it, ``lease_lock()`` refuses the bind
  before any SQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final, Protocol

from advisory_locks._bindings._raw import declared_pooler
from advisory_locks._core.executors import (
    driver_autocommit,
    driver_in_transaction,
    restore_driver_autocommit,
    set_driver_autocommit,
)
from advisory_locks._core.listener import AsyncReleaseListener, ReleaseListener
from advisory_locks._core.steps import Steps, arun_steps
from advisory_locks._dialects.lease import LEASE_TABLE, LeaseBackend, lease_backend_for_dialect
from advisory_locks.errors import LockConnectionLost, UnsupportedFeature

logger = logging.getLogger("advisory_locks")

__all__ = [
    "CREATE_HINT",
    "AsyncLeaseDriver",
    "AsyncRawLeaseSite",
    "LeaseDriver",
    "RawLeaseSite",
    "async_lease_site",
    "lease_site",
]

CREATE_HINT: Final = (
    f"the table {LEASE_TABLE} does not exist in this database. Create it once: with "
    "SQLAlchemy, advisory_locks.sqlalchemy.create_lease_table(engine); with Django, "
    "manage.py migrate advisory_locks_django; or run the CREATE TABLE statement of the "
    "Leases page of the docs (concepts/leases)"
)


class AsyncLeaseDriver(Protocol):
    """What the lease site needs to know about one asyncio driver."""

    name: str
    dialect: str

    def pool_of(self, bind: Any) -> Any:
        """The pool ``bind`` is (or was checked out of), else None."""

    async def checkout(self, pool: Any) -> Any: ...

    async def checkin(self, pool: Any, connection: Any, *, broken: bool) -> None: ...

    async def open_like(self, pool: Any) -> Any:
        """A new connection, made the way ``pool`` makes its connections."""

    async def close(self, connection: Any) -> None: ...

    def executor(self, connection: Any) -> Any: ...

    def fence_executor(self, bind: Any) -> Any:
        """An executor on ``bind`` inside its open transaction (else UnsupportedFeature)."""


class _Borrowed:
    """One connection lent for one lease statement (or two)."""

    __slots__ = ("_broken", "_connection", "_opened", "_site", "executor")

    def __init__(self, site: AsyncRawLeaseSite, connection: Any, *, opened: bool = False) -> None:
        self._site = site
        self._connection = connection
        self._opened = opened  # opened for these statements, never the pool's
        self._broken = False
        self.executor = site.driver.executor(connection)

    def done(self) -> None:
        pass

    def broken(self, error: BaseException) -> None:
        self._broken = True

    async def asettle(self) -> None:
        await self._site.give_back(self._connection, broken=self._broken, opened=self._opened)


class _OwnConnection:
    """A connection the site opened itself (the renewer's, the listener's)."""

    __slots__ = ("_driver", "driver", "executor")

    def __init__(self, driver: AsyncLeaseDriver, connection: Any) -> None:
        self._driver = driver
        self.driver = connection
        self.executor = driver.executor(connection)

    async def aclose(self) -> None:
        await self._driver.close(self.driver)


class AsyncRawLeaseSite:
    """The leases of one asyncio pool (or of one connection and its ``connect``)."""

    asynchronous = True
    create_hint = CREATE_HINT

    def __init__(
        self,
        driver: AsyncLeaseDriver,
        *,
        pool: Any = None,
        connect: Callable[[], Any] | None = None,
        pooler: str | None = None,
    ) -> None:
        self.driver = driver
        self.binding = driver.name
        self.backend: LeaseBackend = lease_backend_for_dialect(driver.dialect)
        self._pool = pool
        self._connect = connect
        self._pooler = pooler
        self._listeners: weakref.WeakKeyDictionary[Any, AsyncReleaseListener] = (
            weakref.WeakKeyDictionary()
        )

    async def run(self, steps: Steps[Any]) -> Any:
        return await arun_steps(steps, self)

    async def aborrow(self, *, transaction: bool) -> _Borrowed:
        if self._pool is not None:
            connection = await self.driver.checkout(self._pool)
        else:
            connection = await self._open()
        return _Borrowed(self, connection)

    async def aborrow_anew(self) -> _Borrowed:
        """A connection opened for the statements, closed after them (see the blocking
        site's ``borrow_anew``)."""
        return _Borrowed(self, await self._open(), opened=True)

    async def give_back(self, connection: Any, *, broken: bool, opened: bool = False) -> None:
        if self._pool is not None and not opened:
            await self.driver.checkin(self._pool, connection, broken=broken)
        else:
            await self.driver.close(connection)

    async def _open(self) -> Any:
        if self._connect is None:
            return await self.driver.open_like(self._pool)
        opened = self._connect()
        if inspect.isawaitable(opened):
            opened = await opened
        return opened

    async def renewal_connection(self) -> _OwnConnection:
        return _OwnConnection(self.driver, await self._open())

    def release_listener(self) -> AsyncReleaseListener | None:
        """This loop's listener; None behind a declared transaction pooler, where a
        LISTEN would stay on a server connection that is handed to someone else."""
        if self.backend.listen_sql is None or self._pooler == "transaction":
            return None
        loop = asyncio.get_running_loop()
        listener = self._listeners.get(loop)
        if listener is None:
            listener = self._listeners[loop] = AsyncReleaseListener(
                self.renewal_connection, LEASE_TABLE
            )
        return listener

    async def fence(self, bind: object, fence_steps: Callable[[Any], Steps[None]]) -> None:
        await arun_steps(fence_steps(self.driver.fence_executor(bind)), self)


# Pools take no weak references (asyncpg's): sites are kept until their pool closes.
_pool_sites: dict[tuple[int, Any], tuple[Any, AsyncRawLeaseSite]] = {}
_connection_sites: weakref.WeakKeyDictionary[Any, dict[Any, AsyncRawLeaseSite]] = (
    weakref.WeakKeyDictionary()
)


def async_lease_site(
    driver: AsyncLeaseDriver, bind: Any, connect: Callable[[], Any] | None
) -> AsyncRawLeaseSite:
    """The lease site of ``bind``: one per pool (so its leases renew together), one per
    connection and ``connect``."""
    pool = driver.pool_of(bind)
    pooler = declared_pooler(bind, pool)
    if pool is not None:
        key = (id(pool), connect)
        found = _pool_sites.get(key)
        if found is not None and found[0] is pool:
            return found[1]
        for old, (other, _site) in list(_pool_sites.items()):
            with contextlib.suppress(Exception):
                if other.is_closing():
                    del _pool_sites[old]
        site = AsyncRawLeaseSite(driver, pool=pool, connect=connect, pooler=pooler)
        _pool_sites[key] = (pool, site)
        return site
    if connect is None:
        raise UnsupportedFeature(
            f"a lease on a single {driver.name} connection needs connect=: a callable "
            "that opens another connection to the same database (the renewer cannot use "
            "yours, which your code may be using at that moment); or pass the pool"
        )
    sites = _connection_sites.setdefault(bind, {})
    if connect not in sites:
        sites[connect] = AsyncRawLeaseSite(driver, connect=connect, pooler=pooler)
    return sites[connect]


class LeaseDriver:
    """What the lease site needs to know about one blocking driver: its ``RawDriver``
    (checkout, check-in, executor), its database, and how to open a connection like a
    pool's (None: a driver without pools)."""

    def __init__(
        self,
        raw: Any,
        dialect: str,
        *,
        is_pool: Callable[[object], bool] = lambda bind: False,
        open_like: Callable[[Any], Any] | None = None,
        notifies: bool = False,
    ) -> None:
        self.raw = raw
        self.name: str = raw.name
        self.dialect = dialect
        self._is_pool = is_pool
        self._open_like = open_like
        self.notifies = notifies

    def pool_of(self, bind: Any) -> Any:
        if self._is_pool(bind):
            return bind
        return self.raw.pool_of(bind)

    def checkout(self, pool: Any) -> Any:
        try:
            return self.raw.checkout(pool)
        except Exception as error:
            # The pool lent nothing (full, closed): the library's error, as for a lock.
            refusal = self.raw.pool_refusal(pool, error, (), lease=True)
            if refusal is None:
                raise
            raise refusal from error

    def checkin(self, pool: Any, connection: Any) -> None:
        self.raw.checkin(pool, connection)

    def open_like(self, pool: Any) -> Any:
        assert self._open_like is not None
        return self._open_like(pool)

    def executor(self, connection: Any) -> Any:
        return self.raw.executor(connection, {})


class _SyncBorrowed:
    """One connection lent for one lease statement (or two), in autocommit."""

    __slots__ = ("_broken", "_connection", "_opened", "_restore", "_site", "executor")

    def __init__(
        self,
        site: RawLeaseSite,
        connection: Any,
        restore: tuple[object] | None,
        *,
        opened: bool = False,
    ) -> None:
        self._site = site
        self._connection = connection
        self._restore = restore
        self._opened = opened  # opened for these statements, never the pool's
        self._broken = False
        self.executor = site.driver.executor(connection)

    def done(self) -> None:
        pass

    def broken(self, error: BaseException) -> None:
        self._broken = True

    def settle(self) -> None:
        self._site.give_back(
            self._connection, self._restore, broken=self._broken, opened=self._opened
        )

    async def asettle(self) -> None:  # pragma: no cover - a blocking site's borrow
        self.settle()


class _SyncOwnConnection:
    """A connection the site opened itself (the renewer's, the listener's)."""

    __slots__ = ("driver", "executor")

    def __init__(self, driver: LeaseDriver, connection: Any) -> None:
        self.driver = connection
        self.executor = driver.executor(connection)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.driver.close()


class RawLeaseSite:
    """The leases of one blocking pool (or of one connection and its ``connect``)."""

    create_hint = CREATE_HINT

    def __init__(
        self,
        driver: LeaseDriver,
        *,
        pool: Any = None,
        connect: Callable[[], Any] | None = None,
        pooler: str | None = None,
    ) -> None:
        self.driver = driver
        self.binding = driver.name
        self.backend: LeaseBackend = lease_backend_for_dialect(driver.dialect)
        self._pool = pool
        self._connect = connect
        self._pooler = pooler
        self._listener: ReleaseListener | None = None
        self._listener_lock = threading.Lock()

    def borrow(self, *, transaction: bool) -> _SyncBorrowed:
        if self._pool is None:
            return _SyncBorrowed(self, self._open(), None)
        connection = self.driver.checkout(self._pool)
        try:
            restore = None
            if not driver_autocommit(connection):
                restore = (set_driver_autocommit(connection, True),)
        except BaseException as error:
            lost = self._connection_lost(error)
            self.give_back(connection, None, broken=lost is not None)
            if lost is not None:
                raise lost from error
            raise
        return _SyncBorrowed(self, connection, restore)

    def _connection_lost(self, error: BaseException) -> LockConnectionLost | None:
        """The error for a connection found gone while it is made ready for a lease
        statement (switching to autocommit sends a statement on some drivers), as at the
        lease's first statement; None for any other error."""
        if isinstance(error, Exception) and self.backend.is_connection_failure(error):
            return LockConnectionLost(
                f"a lease lock's connection to the database was lost ({error})"
            )
        return None

    def give_back(
        self,
        connection: Any,
        restore: tuple[object] | None,
        *,
        broken: bool,
        opened: bool = False,
    ) -> None:
        if self._pool is None or opened:
            with contextlib.suppress(Exception):
                connection.close()
            return
        try:
            if not broken and restore is not None:
                try:
                    restore_driver_autocommit(connection, restore[0])
                except BaseException as error:
                    # The connection, whose mode could not be put back, is replaced. The
                    # statements were answered: their result stands (an interruption,
                    # though, goes on up, after the check-in below).
                    broken = True
                    if not isinstance(error, Exception):
                        raise
                    logger.debug("a lease connection's mode could not be restored", exc_info=True)
        finally:
            if broken:
                with contextlib.suppress(Exception):
                    connection.close()  # the pool replaces a closed connection
            self.driver.checkin(self._pool, connection)

    def borrow_anew(self) -> _SyncBorrowed:
        """A connection opened for the statements (``connect=``, else one made as the
        pool makes its own), closed after them: a pool's idle ones may all be dead."""
        return _SyncBorrowed(self, self._open(), None, opened=True)

    def _open(self) -> Any:
        connection = self._connect() if self._connect is not None else None
        if connection is None:
            connection = self.driver.open_like(self._pool)
        try:
            self.driver.raw.refuse(connection)
            if not driver_autocommit(connection):
                set_driver_autocommit(connection, True)
        except BaseException as error:
            lost = self._connection_lost(error)
            if lost is None:
                connection.close()
                raise
            with contextlib.suppress(Exception):
                connection.close()
            raise lost from error
        return connection

    def renewal_connection(self) -> _SyncOwnConnection:
        return _SyncOwnConnection(self.driver, self._open())

    def release_listener(self) -> ReleaseListener | None:
        """The listener waking this site's waiters; None where LISTEN cannot work (another
        database, a driver without notifications, a declared transaction pooler)."""
        listen_sql = self.backend.listen_sql
        if listen_sql is None or not self.driver.notifies or self._pooler == "transaction":
            return None
        with self._listener_lock:
            if self._listener is None:
                self._listener = ReleaseListener(self.renewal_connection, listen_sql)
            return self._listener

    def fence_executor(self, bind: object) -> Any:
        if self.driver.pool_of(bind) is bind or not hasattr(bind, "cursor"):
            raise TypeError(
                "fence() runs inside your transaction: pass the connection that makes the "
                f"protected writes, not {type(bind).__name__}"
            )
        if driver_autocommit(bind) and not driver_in_transaction(bind):
            raise UnsupportedFeature(
                "fence() needs a transaction, but this connection is in autocommit mode "
                "outside one, where the fence would end with its own statement"
            )
        return self.driver.executor(bind)


# One site per pool (so that its leases renew together), or per connect= callable.
_sync_sites: weakref.WeakKeyDictionary[Any, RawLeaseSite] = weakref.WeakKeyDictionary()
# Pools that take no weak references: kept by id (with the pool, to check identity).
_sync_strong_sites: dict[int, tuple[Any, RawLeaseSite]] = {}
_sites_lock = threading.Lock()


def lease_site(driver: LeaseDriver, bind: Any, connect: Callable[[], Any] | None) -> RawLeaseSite:
    """The lease site of a blocking ``bind``; a single connection needs ``connect``."""
    pool = driver.pool_of(bind)
    pooler = declared_pooler(bind, pool)
    if pool is None and connect is None:
        raise UnsupportedFeature(
            f"a lease on a single {driver.name} connection needs connect=: a callable "
            "that opens another connection to the same database (the renewer cannot use "
            "yours, which another thread may be using at that moment); or pass a pool"
        )
    if pool is not None and connect is not None:
        # connect= opens the renewer's connection; statements borrow from the pool.
        return RawLeaseSite(driver, pool=pool, connect=connect, pooler=pooler)
    owner = pool if pool is not None else connect
    with _sites_lock:
        try:
            site = _sync_sites.get(owner)
        except TypeError:
            found = _sync_strong_sites.get(id(owner))
            site = found[1] if found is not None and found[0] is owner else None
            if site is None:
                site = RawLeaseSite(driver, pool=pool, connect=connect, pooler=pooler)
                _sync_strong_sites[id(owner)] = (owner, site)
            return site
        if site is None:
            site = RawLeaseSite(driver, pool=pool, connect=connect, pooler=pooler)
            # A callable without weak references gets a site of its own each time.
            with contextlib.suppress(TypeError):
                _sync_sites[owner] = site
        return site
