"""``lease_lock()`` for Django: the core ``LeaseLock`` on a database alias.

Where the statements run (the lease site of an alias):

- acquire, release and ``ensure_held()`` run on the calling thread's Django connection,
  in autocommit, each statement its own transaction. Inside ``atomic()`` they cannot run
  there (the lease would commit or roll back with the caller's transaction), so they run
  on a short-lived connection of their own instead.
- ``fence()`` runs on the calling thread's Django connection inside the caller's
  ``atomic()``: that is its point.
- the process's renewer thread (and, on PostgreSQL, the thread that LISTENs for
  releases) opens connections of its own with the alias's settings: a Django connection
  belongs to one thread and is not thread-safe.

The table is the app's ``Lease`` model (``advisory_locks_lease``), the very table a
SQLAlchemy worker uses, so the two exclude each other by name.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final, TypeVar, cast

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from advisory_locks._core.contract import Timeout, reported_inside
from advisory_locks._core.executors import DBAPIExecutor
from advisory_locks._core.lease import LeaseLock, LeaseOptions, lease_name
from advisory_locks._core.listener import LISTENING_DRIVERS, ReleaseListener
from advisory_locks._core.prune import prune, prune_age
from advisory_locks._dialects.lease import LEASE_TABLE, LeaseBackend, lease_backend_for_dialect
from advisory_locks.errors import LockLost, UnsupportedFeature
from advisory_locks_django import signals
from advisory_locks_django._binding import DjangoExecutor
from advisory_locks_django._compat import health_check_due, new_wrapper, run_health_check
from advisory_locks_django.conf import SESSION_UNSAFE_POOLERS, lock_settings
from advisory_locks_django.locks import DEFAULT, _Default, _name_factory

__all__ = ["DjangoLeaseLock", "lease_lock", "prune_leases"]

F = TypeVar("F", bound=Callable[..., Any])

logger = logging.getLogger("advisory_locks_django")

STATE_ATTRIBUTE: Final = "_advisory_locks_lease_state"

# Django's lease waits block a thread (its statements run on Django's sync connections):
# awaited from async code, such a wait would hold Django's one sync thread.
_NOT_ASYNC: Final = (
    "advisory_locks_django.lease_lock() is for sync code: take the lease in a sync "
    "function run with sync_to_async(..., thread_sensitive=False), or, in async code, use "
    "advisory_locks.lease_lock() on an async bind (an AsyncEngine, an asyncpg pool)"
)


def lease_lock(
    name: str | Callable[..., str],
    *,
    using: str = DEFAULT_DB_ALIAS,
    ttl: float | _Default = DEFAULT,
    renew_every: float | None = None,
    timeout: Timeout = None,
    key_prefix: str | int | None = None,
    skip_if_locked: bool = False,
) -> DjangoLeaseLock:
    """A lease lock on the database ``using``: a context manager and a decorator.

    A lease is a row of ``advisory_locks_lease`` (the ``Lease`` model) held until it
    expires unless renewed, with a fencing token; it belongs to no connection, so it
    survives reconnects and transaction poolers. While it is held, the process's renewer
    thread extends it every ``renew_every`` seconds on a connection of its own.

    :param name: a non-empty ``str``. When decorating, it may use ``{argument}`` fields
        filled from each call's arguments (``"sync-{account_id}"``), or be a callable that
        takes the call's arguments and returns the name.
    :param using: the database alias that holds the lease (run ``migrate`` there).
    :param ttl: seconds the lease lasts after each acquire or renewal, by the database
        server's clock. Default: ``ADVISORY_LOCKS["LEASE_TTL"]`` (30).
    :param renew_every: seconds between renewals; default ``ttl / 3``.
    :param timeout: ``None`` waits until the lease is free, ``0`` tries once, ``t > 0``
        waits at most ``t`` seconds.
    :param key_prefix: a namespace put before the name. Default:
        ``ADVISORY_LOCKS["KEY_PREFIX"]``, else ``$ADVISORY_LOCKS_PREFIX``.
    :param skip_if_locked: as a decorator, return ``None`` without calling the function
        when the lease is held elsewhere, instead of raising ``LockNotAcquired``.
    :returns: a [DjangoLeaseLock][advisory_locks_django.DjangoLeaseLock].
    :raises TypeError: a name, alias or option of the wrong type, before any SQL.
    :raises ValueError: an empty name, ``ttl <= 0``, NaN, or ``renew_every`` not below
        ``ttl`` minus its safety margin, before any SQL.
    """
    return DjangoLeaseLock(
        name,
        using=using,
        ttl=ttl,
        renew_every=renew_every,
        timeout=timeout,
        key_prefix=key_prefix,
        skip_if_locked=skip_if_locked,
    )


def prune_leases(*, older_than: float | datetime.timedelta, using: str = DEFAULT_DB_ALIAS) -> int:
    """Clear the holders of leases on ``using`` that expired more than ``older_than``
    ago, by the database server's clock; return how many were cleared.

    Rows are never deleted, so a pruned name's next acquire gets the next fencing token;
    a lease that has not expired is never pruned, whatever the age. The command line
    equivalent is ``manage.py advisory_locks leases --prune AGE``.

    :param older_than: seconds (or a ``datetime.timedelta``) from 0 (every expired
        lease) to 100 years.
    :param using: the database alias that holds the leases.
    :raises TypeError: ``older_than`` is not a number or timedelta, before any SQL.
    :raises ValueError: ``older_than`` is negative, NaN, infinite or over 100 years, or
        ``using`` is not an alias, before any SQL.
    :raises LeaseTableMissing: the alias's database has no lease table (run ``migrate``).
    """
    seconds = prune_age(older_than)
    return prune(lease_site(using), seconds)


class DjangoLeaseLock:
    """A lease lock on a Django database alias, made by ``lease_lock()``.

    ``with`` acquires (``LockNotAcquired`` / ``LockTimeout`` when busy) and releases at
    the end, raising ``LockStolen`` / ``LockLost`` there if the lease was lost inside the
    block. ``token`` is the fencing token, ``lost`` a ``threading.Event`` set when this
    process learns of a loss, ``ensure_held()`` raises unless the lease is still ours, and
    ``fence()`` proves it inside the caller's ``atomic()``. One object is one holder: not
    re-entrant; two objects for one name exclude each other, also in one thread.
    """

    __slots__ = ("_lock", "_name", "_options", "key_prefix", "skip_if_locked", "using")

    def __init__(
        self,
        name: str | Callable[..., str],
        *,
        using: str = DEFAULT_DB_ALIAS,
        ttl: float | _Default = DEFAULT,
        renew_every: float | None = None,
        timeout: Timeout = None,
        key_prefix: str | int | None = None,
        skip_if_locked: bool = False,
    ) -> None:
        if not isinstance(using, str):
            raise TypeError(f"using must be a database alias (str), not {type(using).__name__}")
        if not isinstance(skip_if_locked, bool):
            raise TypeError("skip_if_locked must be True or False")
        configured = lock_settings()
        self._options = LeaseOptions(
            ttl=configured.lease_ttl if isinstance(ttl, _Default) else ttl,
            renew_every=renew_every,
            timeout=timeout,
        )
        self.using = using
        self.key_prefix = configured.key_prefix if key_prefix is None else key_prefix
        self.skip_if_locked = skip_if_locked
        self._name = name
        self._lock: LeaseLock | None = None
        if isinstance(name, str) and not _has_fields(name):
            self._lock = self._core_lock(name)
        elif not isinstance(name, str) and not callable(name):
            raise TypeError(f"lease name must be str, not {type(name).__name__}")

    # -- the lease ------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._core().name

    @property
    def ttl(self) -> float:
        return self._options.ttl

    @property
    def token(self) -> int | None:
        """The fencing token of the current (or last) holding; None before the first."""
        return self._core().token

    @property
    def lost(self) -> threading.Event:
        """Set as soon as this process learns that the lease it holds was lost."""
        return self._core().lost

    @property
    def held(self) -> bool:
        return self._core().held

    def acquire(self) -> bool:
        """Take the lease; False when it stayed held elsewhere for the whole timeout."""
        return self._core().acquire()

    def release(self) -> None:
        """Give the lease back; ``LockStolen`` / ``LockLost`` if it was lost meanwhile."""
        self._core().release()

    def ensure_held(self) -> None:
        """Raise ``LockStolen`` / ``LockLost`` unless the lease is still ours (one query)."""
        self._core().ensure_held()

    async def __aenter__(self) -> DjangoLeaseLock:
        raise UnsupportedFeature(_NOT_ASYNC)

    async def __aexit__(self, *exc_info: object) -> None:  # pragma: no cover - never entered
        return None

    def fence(self) -> None:
        """Inside the caller's ``atomic()`` on ``using``, prove the lease is still ours and
        keep any other holder from taking it over until that transaction ends.

        Call it before the writes the lease protects, in the same ``atomic()`` block:
        they commit only if this holder still held the lease. Raises ``LockStolen`` /
        ``LockLost`` otherwise (leaving the block by the exception rolls back).
        """
        self._core().fence(self.using)

    def __enter__(self) -> DjangoLeaseLock:
        if self.skip_if_locked:
            raise TypeError("skip_if_locked=True only works when decorating a function")
        if not self.acquire():
            raise self._core()._not_acquired()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _release(self._core(), exc)

    # -- decorator ------------------------------------------------------------------------

    def __call__(self, function: F) -> F:
        """Decorate ``function``: each call runs under its own lease."""
        if inspect.iscoroutinefunction(function):
            raise UnsupportedFeature(_NOT_ASYNC)
        name_for = _name_factory(self._name, function)
        skip = self.skip_if_locked

        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            name = name_for(args, kwargs)
            if not isinstance(name, str):
                raise TypeError(f"lease name must be str, not {type(name).__name__}")
            lock = self._core_lock(name)
            if not lock.acquire():
                if skip:
                    return None
                raise lock._not_acquired()
            try:
                result = function(*args, **kwargs)
            except BaseException as error:
                _release(lock, error)
                raise
            _release(lock, None)
            return result

        return cast(F, run)

    # -- helpers --------------------------------------------------------------------------

    def _core(self) -> LeaseLock:
        if self._lock is None:
            raise TypeError(
                "this lease's name is computed from a function's arguments; use it as a decorator"
            )
        return self._lock

    def _core_lock(self, name: str) -> LeaseLock:
        stored = lease_name(name, self.key_prefix)
        return LeaseLock(lease_site(self.using), name, stored, self._options)

    def __repr__(self) -> str:
        if self._lock is None:
            return f"<DjangoLeaseLock {self._name!r} using={self.using!r}>"
        state = "held" if self.held else "not held"
        return f"<DjangoLeaseLock {self.name!r} using={self.using!r} {state}>"


def _release(lock: LeaseLock, exc: BaseException | None) -> None:
    try:
        lock.release()
    except LockLost:
        if not reported_inside(exc, lock.name):
            raise


def _has_fields(name: str) -> bool:
    import string

    return any(field is not None for _, field, _, _ in string.Formatter().parse(name))


# -- the lease site ------------------------------------------------------------------------


def _create_hint(alias: str) -> str:
    return (
        f"the table {LEASE_TABLE} does not exist in database {alias!r}. Create it with "
        f"`manage.py migrate advisory_locks_django --database {alias}` (add "
        '"advisory_locks_django" to INSTALLED_APPS); SQLAlchemy projects: '
        "advisory_locks.sqlalchemy.create_lease_table(engine)"
    )


class _ThreadBorrow:
    """The calling thread's Django connection, in autocommit, for a lease statement."""

    __slots__ = ("_broken", "executor", "wrapper")

    def __init__(self, wrapper: BaseDatabaseWrapper) -> None:
        self.wrapper = wrapper
        self._broken: BaseException | None = None
        self.executor: Any = DjangoExecutor(wrapper, wrapper.connection, _state_of(wrapper))

    def done(self) -> None:
        pass

    def broken(self, error: BaseException) -> None:
        self._broken = error

    def settle(self) -> None:
        if self._broken is not None:
            # Outside atomic(): Django opens a new connection at the next query.
            try:
                self.wrapper.close()
            except DatabaseError:
                logger.debug("closing a broken connection failed", exc_info=True)

    async def asettle(self) -> None:
        self.settle()


class _OwnConnection:
    """A connection of its own to an alias's database (Django's connect(), autocommit),
    usable and closable from any thread: the renewer's, the listener's, or one lease
    statement's inside the caller's atomic().

    Never one of Django's pool (``OPTIONS["pool"]``): the renewer and the listener keep
    theirs while leases are held or awaited, which would take it from the requests, and
    a statement's beside the thread's own would wait for the pool behind that thread
    (for the pool's whole timeout with a pool of one, or once every pooled connection is
    a thread's inside atomic()). After a restart, every idle pooled one is dead too."""

    __slots__ = ("driver", "executor", "wrapper")

    def __init__(self, alias: str) -> None:
        wrapper = new_wrapper(alias, pooled=False)
        wrapper.inc_thread_sharing()
        try:
            wrapper.ensure_connection()
            if not wrapper.get_autocommit():
                wrapper.set_autocommit(True)
        except BaseException:
            self._close(wrapper)
            raise
        self.wrapper = wrapper
        self.driver = wrapper.connection
        self.executor: Any = DBAPIExecutor(wrapper.connection, {})

    # The Borrowed protocol, for a statement run inside the caller's atomic().
    def done(self) -> None:
        pass

    def broken(self, error: BaseException) -> None:
        pass

    def settle(self) -> None:
        self.close()

    async def asettle(self) -> None:
        self.close()

    def close(self) -> None:
        self._close(self.wrapper)

    @staticmethod
    def _close(wrapper: BaseDatabaseWrapper) -> None:
        try:
            wrapper.close()
        except DatabaseError:
            logger.debug("closing a lease connection failed", exc_info=True)
        finally:
            wrapper.dec_thread_sharing()


def _state_of(wrapper: BaseDatabaseWrapper) -> dict[str, Any]:
    """The lease backend's scratch space for the wrapper's current DB-API connection."""
    dbapi = wrapper.connection
    found = wrapper.__dict__.get(STATE_ATTRIBUTE)
    if found is None or found[0] is not dbapi:
        found = (dbapi, {})
        wrapper.__dict__[STATE_ATTRIBUTE] = found
    state: dict[str, Any] = found[1]
    return state


class DjangoLeaseSite:
    """The leases of one database alias (one per alias, so they renew together)."""

    binding = "django"

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.backend: LeaseBackend = lease_backend_for_dialect(connections[alias].vendor)
        self.create_hint = _create_hint(alias)
        self._listener: ReleaseListener | None = None

    @property
    def database(self) -> str:
        """The alias, as lock events name the database."""
        return self.alias

    def borrow(self, *, transaction: bool) -> _ThreadBorrow | _OwnConnection:
        wrapper = connections[self.alias]
        if health_check_due(wrapper):
            # A persistent connection's first use in a request (CONN_HEALTH_CHECKS): one
            # the server ended between requests is replaced, as for Django's first query.
            run_health_check(wrapper)
        # A lease statement must commit on its own, not with the caller's transaction:
        # one is open inside atomic(), and always with autocommit turned off.
        if wrapper.in_atomic_block or not wrapper.get_autocommit():
            return _OwnConnection(self.alias)
        return _ThreadBorrow(wrapper)

    def borrow_anew(self) -> _OwnConnection:
        """A connection of its own, opened for the statements and closed after them."""
        return _OwnConnection(self.alias)

    def renewal_connection(self) -> _OwnConnection:
        return _OwnConnection(self.alias)

    def release_listener(self) -> ReleaseListener | None:
        """PostgreSQL waiters are woken by NOTIFY, unless the alias is declared behind a
        transaction pooler (``ADVISORY_LOCKS["POOLERS"]``); elsewhere they poll."""
        if self.backend.listen_sql is None:
            return None
        if lock_settings().poolers.get(self.alias) in SESSION_UNSAFE_POOLERS:
            return None
        driver: Any = cast(Any, connections[self.alias]).Database
        module = str(driver.__name__).split(".")[0]
        if module not in LISTENING_DRIVERS:
            return None
        with _sites_lock:
            if self._listener is None:
                self._listener = ReleaseListener(
                    lambda: _OwnConnection(self.alias), self.backend.listen_sql
                )
            return self._listener

    def fence_executor(self, bind: object) -> DjangoExecutor:
        alias = self.alias if bind is None else bind
        if alias != self.alias:
            raise UnsupportedFeature(
                f"fence() must run on the lease's own database {self.alias!r}, not {alias!r}"
            )
        wrapper = connections[self.alias]
        if not wrapper.in_atomic_block:
            raise UnsupportedFeature(
                "fence() runs inside your transaction: call it inside "
                f"transaction.atomic(using={self.alias!r}), before the writes it guards"
            )
        wrapper.ensure_connection()
        return DjangoExecutor(wrapper, wrapper.connection, _state_of(wrapper))


_sites: dict[tuple[str, str], DjangoLeaseSite] = {}
_sites_lock = threading.RLock()


def lease_site(alias: str) -> DjangoLeaseSite:
    if alias not in connections:
        raise ValueError(f"unknown database alias {alias!r}")
    settings = connections.settings[alias]
    # A changed alias (tests re-aim them) is a new site: its leases renew elsewhere.
    identity = (alias, repr(sorted((k, str(v)) for k, v in settings.items() if k != "TEST")))
    with _sites_lock:
        site = _sites.get(identity)
        if site is None:
            site = _sites[identity] = DjangoLeaseSite(alias)
        return site


# Django's lease signals are sent for this app's leases, from the core's lock events.
signals.forward_lease_events(DjangoLeaseLock)
