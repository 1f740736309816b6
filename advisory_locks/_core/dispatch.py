"""``advisory_lock(bind, ...)``: find the binding for ``bind`` and let it make the lock.

The core imports no ORM and no driver. A binding registers the classes of the binds it
understands; the first time a bind of an unregistered class arrives, the binding for the
package that class comes from is imported (which registers it), so ``import
advisory_locks`` stays cheap and installs nothing in a program that never locks through
SQLAlchemy.
"""

from __future__ import annotations

import datetime
import importlib
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Final, Protocol, overload

from advisory_locks._core.contract import (
    SESSION_TIMEOUT_TYPES,
    LockOptions,
    Timeout,
    lock_options,
    session_options,
)
from advisory_locks._core.lease import (
    DEFAULT_TTL,
    AsyncLeaseLock,
    LeaseLock,
    LeaseOptions,
    lease_name,
)
from advisory_locks._core.prune import prune, prune_age
from advisory_locks.errors import UnsupportedFeature
from advisory_locks.keys import KeyScheme, LockKey, LockName, derive_key

if TYPE_CHECKING:
    from typing import TypeAlias

    import psycopg
    import psycopg_pool
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
    from sqlalchemy.orm import Session

    # Typed raw drivers (asyncpg and psycopg2 ship no types: their binds are Any).
    SyncRawBind: TypeAlias = psycopg.Connection[Any] | psycopg_pool.ConnectionPool[Any]
    AsyncRawBind: TypeAlias = psycopg.AsyncConnection[Any] | psycopg_pool.AsyncConnectionPool[Any]

    from advisory_locks._core.advisory import (
        AdvisoryLock,
        AdvisoryLockSet,
        AsyncAdvisoryLock,
        AsyncAdvisoryLockSet,
    )

__all__ = [
    "Binding",
    "advisory_lock",
    "advisory_lock_set",
    "binding_for",
    "current_advisory_locks",
    "lease_lock",
    "prune_leases",
    "register_binding",
]

# The binding modules to import for a bind whose class comes from this top-level package.
BINDING_MODULES: Final[dict[str, tuple[str, ...]]] = {
    "sqlalchemy": ("advisory_locks._bindings.sqlalchemy",),
    "psycopg": ("advisory_locks._bindings.psycopg", "advisory_locks._bindings.psycopg_async"),
    "psycopg_pool": (
        "advisory_locks._bindings.psycopg",
        "advisory_locks._bindings.psycopg_async",
    ),
    "psycopg2": ("advisory_locks._bindings.psycopg2",),
    "asyncpg": ("advisory_locks._bindings.asyncpg",),
    "pymysql": ("advisory_locks._bindings.mysql",),
    "MySQLdb": ("advisory_locks._bindings.mysql",),
    "sqlite3": ("advisory_locks._bindings.sqlite3",),
}


class Binding(Protocol):
    """What a binding offers the core for the binds it registered."""

    def lock(self, bind: Any, key: LockKey, options: LockOptions) -> Any:
        """An ``AdvisoryLock`` (or ``AsyncAdvisoryLock`` for an async bind)."""

    def lock_set(
        self, bind: Any, keys: list[LockKey], options: LockOptions, timeout: Timeout
    ) -> Any:
        """An ``AdvisoryLockSet`` (or its async twin) taking ``keys`` in key order."""

    def held_names(self, bind: Any) -> list[LockName]:
        """Names this library holds through ``bind`` in this process."""


_bindings: dict[type, Binding] = {}
_first_use = threading.RLock()


def register_binding(types: Iterable[type], binding: Binding) -> None:
    """Make ``binding`` the one for binds of ``types`` (and their subclasses)."""
    with _first_use:
        for cls in types:
            _bindings[cls] = binding


def binding_for(bind: object) -> Binding:
    """The binding for ``bind``; TypeError when no binding understands it."""
    cls = type(bind)
    binding = _bindings.get(cls)
    if binding is not None:
        return binding
    binding = _registered_for(cls)
    if binding is None:
        # The classes it derives from count too: an application's subclass of a driver's
        # connection (sqlite3's factory=, an instrumented PyMySQL Connection) is one.
        modules = dict.fromkeys(
            module
            for base in cls.__mro__
            for module in BINDING_MODULES.get(base.__module__.partition(".")[0], ())
        )
        with _first_use:
            # Importing registers; one thread at a time, so no thread sees a module that
            # another is still importing.
            for module in modules:
                try:
                    importlib.import_module(module)
                except ModuleNotFoundError as error:
                    if error.name != module:
                        raise
        binding = _registered_for(cls)
    if binding is None:
        raise TypeError(
            "bind must be a SQLAlchemy Session, Connection or Engine (or an async one), a "
            "psycopg / psycopg2 / asyncpg / PyMySQL / mysqlclient / sqlite3 connection, or "
            f"a psycopg_pool or asyncpg pool; not {cls.__module__}.{cls.__qualname__}"
        )
    _bindings[cls] = binding
    return binding


def _registered_for(cls: type) -> Binding | None:
    for base in cls.__mro__:
        binding = _bindings.get(base)
        if binding is not None:
            return binding
    return None


@overload
def advisory_lock(
    bind: Session | Connection | Engine | SyncRawBind,
    name: LockName,
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: KeyScheme | None = None,
    key_prefix: str | int | None = None,
) -> AdvisoryLock: ...


@overload
def advisory_lock(
    bind: AsyncSession | AsyncConnection | AsyncEngine | AsyncRawBind,
    name: LockName,
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: KeyScheme | None = None,
    key_prefix: str | int | None = None,
) -> AsyncAdvisoryLock: ...


@overload
def advisory_lock(
    bind: object,
    name: LockName,
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: KeyScheme | None = None,
    key_prefix: str | int | None = None,
) -> AdvisoryLock | AsyncAdvisoryLock: ...


def advisory_lock(
    bind: object,
    name: LockName,
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: KeyScheme | None = None,
    key_prefix: str | int | None = None,
) -> AdvisoryLock | AsyncAdvisoryLock:
    """A named lock held by the database behind ``bind``.

    Use it as ``with advisory_lock(...)`` (``async with`` for an async bind), or call
    ``acquire()`` / ``release()``. Nothing is sent to the server until it is acquired.

    :param bind: where the lock lives. A SQLAlchemy ``Session``, ``Connection`` or ``Engine``
        (or their asyncio versions); a psycopg 3 ``Connection`` / ``AsyncConnection``
        or ``psycopg_pool`` pool; an asyncpg ``Connection`` or ``Pool``; a psycopg2,
        PyMySQL, mysqlclient or ``sqlite3`` connection. A pool or Engine lends each
        lock its own connection until the lock is released.
    :param name: a non-empty ``str`` (hashed to a key by ``key_scheme``), an ``int`` (a signed
        64-bit key, used as is) or an ``(int, int)`` pair (two signed 32-bit keys).
    :param timeout: ``None`` waits until granted, ``0`` tries once and never waits, ``t > 0``
        lets the server wait at most ``t`` seconds.
    :param shared: take a shared (reader) lock instead of an exclusive one (PostgreSQL and
        SQLite; elsewhere ``UnsupportedFeature``).
    :param transaction: hold the lock until the surrounding transaction ends (PostgreSQL);
        refused where there is no transaction (an ``Engine``, a pool, an autocommit
        connection).
    :param key_scheme: how a ``str`` name becomes a key: ``"sha256"`` (default), ``"pglock"``,
        ``"rails"``, ``"hashtext"``, or a callable ``name -> int | (int, int)``;
        default ``$ADVISORY_LOCKS_KEY_SCHEME``.
    :param key_prefix: a namespace for ``str`` names; default ``$ADVISORY_LOCKS_PREFIX``.

    :returns: An ``AdvisoryLock``, or an ``AsyncAdvisoryLock`` for an async bind.

    :raises TypeError: a name, bind or flag of the wrong type, before any SQL.
    :raises ValueError: an empty name, an out-of-range key or a negative timeout.
    :raises UnsupportedFeature: ``transaction=True`` without a transaction, or a mode the
        database cannot provide.
    """
    key = derive_key(name, scheme=key_scheme, prefix=key_prefix)
    # lock_options(), without the call for a session lock's options made before.
    options = (
        session_options.get(timeout)
        if shared is False and transaction is False and timeout.__class__ in SESSION_TIMEOUT_TYPES
        else None
    )
    if options is None:
        options = lock_options(timeout, shared, transaction)
    binding = _bindings.get(type(bind))  # binding_for(), without the call once it is known
    if binding is None:
        binding = binding_for(bind)
    lock = binding.lock(bind, key, options)
    return lock  # type: ignore[no-any-return]


@overload
def advisory_lock_set(
    bind: Session | Connection | Engine | SyncRawBind,
    names: Iterable[LockName],
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: KeyScheme | None = None,
    key_prefix: str | int | None = None,
) -> AdvisoryLockSet: ...


@overload
def advisory_lock_set(
    bind: AsyncSession | AsyncConnection | AsyncEngine | AsyncRawBind,
    names: Iterable[LockName],
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: KeyScheme | None = None,
    key_prefix: str | int | None = None,
) -> AsyncAdvisoryLockSet: ...


@overload
def advisory_lock_set(
    bind: object,
    names: Iterable[LockName],
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: KeyScheme | None = None,
    key_prefix: str | int | None = None,
) -> AdvisoryLockSet | AsyncAdvisoryLockSet: ...


def advisory_lock_set(
    bind: object,
    names: Iterable[LockName],
    *,
    timeout: Timeout = None,
    shared: bool = False,
    transaction: bool = False,
    key_scheme: KeyScheme | None = None,
    key_prefix: str | int | None = None,
) -> AdvisoryLockSet | AsyncAdvisoryLockSet:
    """Several locks taken in key order, so overlapping sets never deadlock.

    :param bind: as for [advisory_lock][advisory_locks.advisory_lock]; every lock of the set
        runs on one connection.
    :param names: the lock names (duplicates are taken once).
    :param timeout: bounds the whole acquisition, not each lock.
    :param shared: as for ``advisory_lock``, for every lock of the set.
    :param transaction: as for ``advisory_lock``, for every lock of the set.
    :param key_scheme: as for ``advisory_lock``.
    :param key_prefix: as for ``advisory_lock``.

    :returns: An ``AdvisoryLockSet``, or an ``AsyncAdvisoryLockSet`` for an async bind.
    """
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(f"names must be a collection of lock names, not {type(names).__name__}")
    keys = [derive_key(name, scheme=key_scheme, prefix=key_prefix) for name in names]
    options = lock_options(timeout, shared, transaction)
    lock_set = binding_for(bind).lock_set(bind, keys, options, options.timeout)
    return lock_set  # type: ignore[no-any-return]


def current_advisory_locks(bind: object) -> list[LockName]:
    """Names of the locks this library holds through ``bind`` (in this process).

    :param bind: any bind ``advisory_lock`` accepts.
    """
    return binding_for(bind).held_names(bind)


@overload
def lease_lock(
    bind: Session | Connection | Engine | SyncRawBind,
    name: str,
    *,
    ttl: float = DEFAULT_TTL,
    renew_every: float | None = None,
    timeout: Timeout = None,
    key_prefix: str | int | None = None,
    connect: Callable[[], Any] | None = None,
) -> LeaseLock: ...


@overload
def lease_lock(
    bind: AsyncSession | AsyncConnection | AsyncEngine | AsyncRawBind,
    name: str,
    *,
    ttl: float = DEFAULT_TTL,
    renew_every: float | None = None,
    timeout: Timeout = None,
    key_prefix: str | int | None = None,
    cancel_on_loss: bool = False,
    connect: Callable[[], Awaitable[Any]] | None = None,
) -> AsyncLeaseLock: ...


@overload
def lease_lock(
    bind: object,
    name: str,
    *,
    ttl: float = DEFAULT_TTL,
    renew_every: float | None = None,
    timeout: Timeout = None,
    key_prefix: str | int | None = None,
    cancel_on_loss: bool = False,
    connect: Callable[[], Any] | None = None,
) -> LeaseLock | AsyncLeaseLock: ...


def lease_lock(
    bind: object,
    name: str,
    *,
    ttl: float = DEFAULT_TTL,
    renew_every: float | None = None,
    timeout: Timeout = None,
    key_prefix: str | int | None = None,
    cancel_on_loss: bool = False,
    connect: Callable[[], Any] | None = None,
) -> LeaseLock | AsyncLeaseLock:
    """A lease lock: a row of ``advisory_locks_lease`` held until it expires unless
    renewed, with a fencing token. Unlike an advisory lock it belongs to no connection,
    so it can be held through a transaction pooler and across a long job without pinning
    a connection. Nothing is sent to the database until it is acquired.

    Use it as ``with lease_lock(...) as lease:`` (``async with`` for an async bind) or
    call ``acquire()`` / ``release()``. While held, the process's renewer (a thread; for
    async binds a task of the running event loop) extends it every ``renew_every``
    seconds, on a connection of its own.

    Args:
        bind: a SQLAlchemy ``Engine``, ``Session`` or ``Connection``, or their asyncio
            versions (``AsyncEngine``, ``AsyncSession``, ``AsyncConnection``); a raw
            driver's pool (psycopg_pool ``ConnectionPool`` / ``AsyncConnectionPool``,
            asyncpg ``Pool``) or connection (psycopg, psycopg2, asyncpg, PyMySQL,
            mysqlclient, ``sqlite3``; a connection checked out of a pool stands for its
            pool). A pool (an Engine's included) lends each lease statement a connection
            and takes it back at once.
        name: a non-empty ``str`` (with its prefix, at most 255 characters); the same
            name is the same lease for every process and ORM using the database.
        ttl: seconds the lease lasts after each acquire or renewal, by the database's
            clock; a holder that stops renewing (crash, pause) loses it this long after
            its last renewal.
        renew_every: seconds between renewals; default ``ttl / 3``. Must be below
            ``ttl`` minus a safety margin of ``ttl / 10``.
        timeout: ``None`` waits until the lease is free, ``0`` tries once, ``t > 0`` waits
            at most ``t`` seconds.
        key_prefix: a namespace put before ``name``; default ``$ADVISORY_LOCKS_PREFIX``.
        cancel_on_loss: async binds only: cancel the task that acquired the lease as soon
            as its loss is known; its ``async with`` block then raises ``LockStolen`` /
            ``LockLost`` instead of ``CancelledError``. (A thread cannot be cancelled:
            blocking code checks ``lost`` or calls ``ensure_held()``.)
        connect: for a single raw driver connection: a callable returning (for an
            asyncio driver, an awaitable of) a new connection to the same database.
            The lease's statements and its renewer run on connections it opens, never
            on yours, which your code may be using at that very moment. Required there;
            a pool bind needs none.

    Returns:
        A ``LeaseLock``, or an ``AsyncLeaseLock`` for an async bind.

    Raises:
        TypeError: a name or option of the wrong type, before any SQL.
        ValueError: an empty or too long name, ``ttl <= 0``, NaN, or ``renew_every`` not
            below ``ttl`` minus the margin, before any SQL.
        UnsupportedFeature: a bind that cannot hold leases, ``cancel_on_loss`` with a
            blocking bind, a single raw connection without ``connect``; before any SQL.
        LeaseTableMissing: (at acquire) the database has no ``advisory_locks_lease``.
    """
    stored_name = lease_name(name, key_prefix)
    options = LeaseOptions(ttl=ttl, renew_every=renew_every, timeout=timeout)
    if not isinstance(cancel_on_loss, bool):
        raise TypeError(
            f"cancel_on_loss must be True or False, not {type(cancel_on_loss).__name__}"
        )
    if connect is not None and not callable(connect):
        raise TypeError(f"connect must be a callable that opens a connection, not {connect!r}")
    binding = binding_for(bind)
    make_site = getattr(binding, "lease_site", None)
    if make_site is None:
        raise UnsupportedFeature(
            f"lease locks are not available for {type(bind).__name__} binds yet; pass a "
            "SQLAlchemy Engine, Session or Connection (or an async one), or an asyncpg Pool"
        )
    site = make_site(bind, connect=connect)
    if getattr(site, "asynchronous", False):
        return AsyncLeaseLock(site, name, stored_name, options, cancel_on_loss=cancel_on_loss)
    if cancel_on_loss:
        raise UnsupportedFeature(
            "cancel_on_loss=True needs an async bind: a thread cannot be cancelled; "
            "blocking code watches lease.lost or calls lease.ensure_held()"
        )
    return LeaseLock(site, name, stored_name, options)


def prune_leases(bind: object, *, older_than: float | datetime.timedelta) -> int:
    """Clear the holders of leases that expired more than ``older_than`` ago, by the
    database server's clock; return how many were cleared.

    Rows are never deleted: a pruned name's next acquire gets the next token (tokens
    never reset). A lease that has not expired is never pruned, whatever the age, so
    this is safe to run at any time (from cron: ``advisory-locks leases --prune 1d``).
    It only tidies the table for people reading it (``advisory-locks leases``, the Django
    admin): an expired lease is free to acquire whether it was pruned or not.

    Args:
        bind: a SQLAlchemy ``Engine``, ``Session`` or ``Connection``; the statement runs
            on a connection borrowed from its Engine's pool, in its own transaction.
        older_than: seconds (or a ``datetime.timedelta``) from 0 (every expired lease)
            to 100 years.

    Raises:
        TypeError: ``older_than`` is not a number or timedelta, before any SQL.
        ValueError: ``older_than`` is negative, NaN, infinite or over 100 years, before
            any SQL.
        UnsupportedFeature: a bind that cannot hold leases.
        LeaseTableMissing: the database has no ``advisory_locks_lease``.
    """
    seconds = prune_age(older_than)
    make_site = getattr(binding_for(bind), "lease_site", None)
    if make_site is None:
        raise UnsupportedFeature(
            f"lease locks are not available for {type(bind).__name__} binds yet; pass a "
            "SQLAlchemy Engine, Session or Connection"
        )
    site = make_site(bind)
    if getattr(site, "asynchronous", False):
        raise UnsupportedFeature(
            "prune_leases() is blocking: pass a blocking bind on the same database (an "
            "Engine made by create_engine() with a blocking driver, or a blocking pool); "
            "an async engine's sync_engine cannot run outside its event loop"
        )
    return prune(site, seconds)
