"""Where a Django database connection becomes the core's LockSite and Lease.

This module is the only place that looks inside Django's connection objects. The lock
logic is the core's ``AdvisoryLock``, and the SQL is the dialect
backend's (``backend_for_dialect(connection.vendor)``), so every backend the core gains
works here unchanged.

What one Django connection holds is recorded in a ``DjangoConnectionLocks`` kept on
the ``DatabaseWrapper`` (which Django keeps per thread and alias) together with the DB-API
connection it describes.

No connection is closed, or given back to Django 5.1+'s pool, holding a lock this library
took: ``connection_closing`` runs just before Django closes one (``_compat``'s close hook),
unlocks what is still held on the server, logs a warning naming each lock, and marks the
holders' locks lost (their ``ensure_held()``/``release()`` raise ``LockLost``). Without it a
pooled connection would carry its locks to the next borrower, who would be "granted" them
again (the server counts them re-entrant) while the first holder still believed it held
them. Likewise a request's end (``request_finished``) unlocks the session locks taken
during that request and not released by its end, so a persistent connection
(``CONN_MAX_AGE``) never carries them into the next request; locks taken outside any
request (a command, a worker thread) live until released or until their connection closes.

In a forked child (``ConnectionState.inherited``) none of this unlocks anything: the locks
are the parent's, and the child's copy of a connection is cut off the server before Django
closes it, so that closing it cannot end the parent's session either.

Transaction locks follow Django's own bookkeeping of a transaction's fate: each one puts a
callback in ``connection.run_on_commit``. Django calls it after the outermost commit and
drops it when the transaction, or an ``atomic()`` savepoint the lock was taken in, rolls
back -- which is exactly when PostgreSQL releases the lock. A weakref finalizer notices
the drop at once on CPython; the registry also checks the list each time it is used, so
it stays right on interpreters that collect later. Django drops nothing when it rolls
back to a savepoint of ``transaction.savepoint()``, so every savepoint rollback is also
watched (``_compat``'s savepoint-rollback hook): a transaction lock granted after the
savepoint was made is forgotten there, as PostgreSQL lets go of it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from django.core.signals import setting_changed
from django.db import connections

from advisory_locks._core.connection import (
    ConnectionState,
    Holding,
    check_server,
    current_process_id,
    finish_pending_releases,
    opened_before_fork,
    release_session_locks,
    server_checked,
)
from advisory_locks._core.executors import (
    DBAPIExecutor,
    detach_inherited_connection,
    from_psycopg3,
)
from advisory_locks._core.steps import Executor, on, run_steps
from advisory_locks._dialects import Backend, backend_for_dialect
from advisory_locks.errors import UnsupportedFeature
from advisory_locks_django import conf
from advisory_locks_django._compat import (
    autocommit,
    django_errors,
    health_check_due,
    new_wrapper,
    on_commit_callbacks,
    refuse_broken_transaction,
    run_health_check,
    savepoint_number,
    savepoints_made,
    uses_pool,
)
from advisory_locks_django.conf import SESSION_UNSAFE_POOLERS, lock_settings

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from advisory_locks.keys import LockKey, LockName

__all__ = [
    "DjangoBorrow",
    "DjangoConnectionLocks",
    "DjangoExecutor",
    "DjangoSite",
    "backend_for_alias",
    "connection_closing",
    "connection_locks",
    "held_keys",
    "observe_connection",
    "open_other_connection",
    "own_connection",
    "request_finished",
    "request_started",
    "savepoint_rolled_back",
    "site_for_alias",
]

logger = logging.getLogger("advisory_locks_django")

REGISTRY_ATTRIBUTE: Final = "_advisory_locks"

# Why a lock ended without its holder releasing it, as the holder's LockLost tells it.
CLOSED_HOLDING: Final = (
    "Django closed its connection (connection.close(), CONN_MAX_AGE, a request's end, "
    "close_old_connections()) or gave it back to its pool while the lock was held"
)
REQUEST_ENDED: Final = "the request it was taken in ended before it was released"


class _RequestState(threading.local):
    """Whether this thread is inside a request (between request_started and
    request_finished). Django's connections are per thread, and so is this."""

    # A class default, so that a thread that never saw a request reads False without
    # an AttributeError being raised and caught on every session lock.
    active = False


_request = _RequestState()

# Every registry alive in this process, so the management command can name the keys of
# locks this process holds, whichever thread holds them.
_registries: weakref.WeakSet[DjangoConnectionLocks] = weakref.WeakSet()


# Each alias's dialect backend, found once: an alias's database never changes its vendor
# (Django reads DATABASES once too; overriding it in tests empties this).
_backends: dict[str, Backend] = {}


def backend_for_alias(alias: str) -> Backend:
    """The dialect backend for a database alias (raises UnsupportedDatabase)."""
    backend = _backends.get(alias)
    if backend is None:
        backend = _backends[alias] = backend_for_dialect(connections[alias].vendor)
    return backend


def site_for_alias(alias: str) -> DjangoSite:
    """The lock site of a database alias (raises UnsupportedDatabase): one per alias,
    shared by every thread, since a site keeps nothing of a thread's."""
    site = _sites.get(alias)
    if site is None:
        site = _sites[alias] = DjangoSite(alias)
    return site


_sites: dict[str, DjangoSite] = {}


def _databases_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == "DATABASES":
        _backends.clear()
        _sites.clear()


setting_changed.connect(_databases_changed)


@dataclass(eq=False)
class DjangoConnectionLocks(ConnectionState):
    """What one DB-API connection of one Django alias holds through this library."""

    alias: str = "default"
    dbapi_connection: Any = None
    wrapper: weakref.ReferenceType[BaseDatabaseWrapper] | None = None
    executor: DjangoExecutor | None = None
    # The run_on_commit callback that watches each transaction lock.
    commit_hooks: dict[Holding, weakref.ReferenceType[Callable[[], None]]] = field(
        default_factory=dict
    )
    # How many savepoints Django had made on the connection when each transaction lock
    # was granted: rolling back to a savepoint numbered at most that releases the lock.
    savepoints_before: dict[Holding, int] = field(default_factory=dict)
    # Session locks granted while this thread was inside a request.
    request_holdings: list[Holding] = field(default_factory=list)
    # Locks this library let go of without their holder's release, and why.
    ended: dict[Holding, str] = field(default_factory=dict)
    # The borrow every lock on this connection gets outside a transaction and inside one
    # (they depend on nothing else, so each is made once). The one outside, once lent
    # under settings that declare no pooler for the alias, is what a session lock's fast
    # path returns while those settings last (DjangoSite.borrow).
    outside_borrow: DjangoBorrow | None = None
    inside_borrow: DjangoBorrow | None = None

    def insert(self, holding: Holding) -> Holding:
        # The base class named rather than super(): a granted waiter runs this before its
        # acquire returns.
        ConnectionState.insert(self, holding)
        if holding.transaction:
            self._watch_transaction(holding)
        elif _request.active:
            self.request_holdings.append(holding)
        return holding

    def end_reason(self, holding: Holding) -> str | None:
        """Why ``holding`` was let go of by this library, if it was."""
        return self.ended.get(holding)

    def forget(self, holding: Holding) -> None:
        ConnectionState.forget(self, holding)
        if self.commit_hooks:
            self.commit_hooks.pop(holding, None)
            self.savepoints_before.pop(holding, None)

    def released(self, holding: Holding, reason: str) -> None:
        """The server no longer holds ``holding``: forget it, and report its end (once;
        ``reason`` as the ``released`` lock event says it)."""
        if self.request_holdings and holding in self.request_holdings:
            self.request_holdings.remove(holding)
        self.end(holding, reason)

    def _watch_transaction(self, holding: Holding) -> None:
        wrapper = self.wrapper() if self.wrapper is not None else None
        if wrapper is None or not wrapper.in_atomic_block:
            raise UnsupportedFeature("a transaction lock was granted outside atomic()")
        registry = weakref.ref(self)

        def ended(reason: str) -> None:
            locks = registry()
            if locks is not None:
                locks.released(holding, reason)

        def advisory_lock_committed() -> None:
            ended("commit")

        # robust: a failing signal receiver must not stop the application's own hooks.
        wrapper.on_commit(advisory_lock_committed, robust=True)
        finalizer = weakref.finalize(advisory_lock_committed, ended, "rollback")
        finalizer.atexit = False
        self.commit_hooks[holding] = weakref.ref(advisory_lock_committed)
        self.savepoints_before[holding] = savepoints_made(wrapper)

    def savepoint_rolled_back(self, name: str) -> None:
        """Django rolled back to savepoint ``name``: forget the transaction locks granted
        since it was made, which PostgreSQL has just released."""
        wrapper = self.wrapper() if self.wrapper is not None else None
        if not self.savepoints_before or wrapper is None:
            return
        number = savepoint_number(name)
        made = savepoints_made(wrapper)
        for holding, before in list(self.savepoints_before.items()):
            # Savepoints are numbered in the order they are made. Where that cannot tell
            # (an id of another form, or the counter set back by clean_savepoints()
            # since the grant), the lock is forgotten: one still held is then taken
            # again with SQL, while one kept after the server let go would be counted
            # as re-entered while another connection takes it.
            if number is None or number <= before or made < before:
                self.released(holding, "rollback")

    def reconcile(self, wrapper: BaseDatabaseWrapper) -> None:
        """Forget transaction locks whose transaction or savepoint has ended."""
        if not self.commit_hooks:
            return
        pending = {id(callback) for callback in on_commit_callbacks(wrapper)}
        for holding, hook in list(self.commit_hooks.items()):
            callback = hook()
            if callback is None or id(callback) not in pending or not wrapper.in_atomic_block:
                self.released(holding, "rollback")

    def django_connection_gone(self) -> None:
        """Django closed or replaced the DB-API connection; the server let go of all."""
        for holding in self.connection_gone():
            self.released(holding, "connection_closed")


def savepoint_rolled_back(wrapper: BaseDatabaseWrapper, sid: str) -> None:
    """Django rolled ``wrapper``'s transaction back to savepoint ``sid`` (``atomic()``'s or
    ``transaction.savepoint()``'s; ``_compat``'s savepoint-rollback hook)."""
    locks = wrapper.__dict__.get(REGISTRY_ATTRIBUTE)
    if isinstance(locks, DjangoConnectionLocks) and locks.dbapi_connection is wrapper.connection:
        locks.savepoint_rolled_back(sid)


def own_connection(wrapper: BaseDatabaseWrapper) -> None:
    """Make sure ``wrapper`` has a DB-API connection of this process's own.

    A forked child still has its parent's connection: a lock taken through it would be
    taken in the parent's session. The child gets a new one (the close hook cuts the
    inherited one off without ending the parent's session).
    """
    locks = wrapper.__dict__.get(REGISTRY_ATTRIBUTE)
    dbapi = wrapper.connection
    if isinstance(locks, DjangoConnectionLocks) and locks.dbapi_connection is dbapi:
        inherited = locks.inherited
    else:
        # Not used by a lock yet: its socket, open at the fork or not, tells.
        inherited = bool(opened_before_fork(dbapi))
    if inherited:
        if wrapper.in_atomic_block:
            raise UnsupportedFeature(
                f"this process was forked from the one that opened its connection to "
                f"{wrapper.alias!r}, and is inside atomic() on that connection; leave "
                "atomic() before taking locks in the child"
            )
        wrapper.close()
    if health_check_due(wrapper):
        # A persistent connection's first use in a request (CONN_HEALTH_CHECKS): one the
        # server ended between requests is replaced, as for Django's own first query.
        run_health_check(wrapper)
    if wrapper.connection is None:
        # Raises SynchronousOnlyOperation in async code, like any Django query would
        # (async code has no connection of its own to find here).
        wrapper.ensure_connection()


def connection_locks(
    wrapper: BaseDatabaseWrapper, backend: Backend | None = None
) -> DjangoConnectionLocks:
    """The registry of the wrapper's current DB-API connection, brought up to date."""
    dbapi = wrapper.connection
    locks = wrapper.__dict__.get(REGISTRY_ATTRIBUTE)
    if not isinstance(locks, DjangoConnectionLocks) or locks.dbapi_connection is not dbapi:
        if isinstance(locks, DjangoConnectionLocks):
            locks.django_connection_gone()
        locks = DjangoConnectionLocks(
            alias=wrapper.alias,
            dbapi_connection=dbapi,
            wrapper=weakref.ref(wrapper),
            pid=opened_before_fork(dbapi) or current_process_id(),
        )
        setattr(wrapper, REGISTRY_ATTRIBUTE, locks)
        _registries.add(locks)
    else:
        locks.reconcile(wrapper)
    if backend is not None:
        locks.backend = backend
    return locks


def _cut_off_inherited(wrapper: BaseDatabaseWrapper, dbapi: Any) -> None:
    """Before Django closes a forked child's copy of its parent's connection: point the
    copy at a dead socket, so that the driver's goodbye does not end the parent's
    session."""
    try:
        detach_inherited_connection(dbapi)
    except OSError:
        # Out of descriptors, say: Django's close must still run; the parent's session
        # may end with it, which is what Django does without this app.
        logger.warning("could not cut an inherited connection off the server", exc_info=True)
    if uses_pool(wrapper):
        dbapi.close()  # so that the pool discards it rather than lend it out again


def observe_connection(wrapper: BaseDatabaseWrapper) -> None:
    """Catch up with what happened to a connection since the library last looked.

    Runs when a request finishes: it reports locks released by a rollback or a closed
    connection, and finishes unlocks that a failed transaction postponed.
    """
    if REGISTRY_ATTRIBUTE not in wrapper.__dict__:
        return
    locks = connection_locks(wrapper)
    if locks.pending_release and wrapper.connection is not None and wrapper.get_autocommit():
        release_pending(locks, DjangoExecutor(wrapper, wrapper.connection, locks.driver_state))


def connection_closing(wrapper: BaseDatabaseWrapper) -> None:
    """Django is about to close ``wrapper``'s DB-API connection or give it back to the pool.

    Unlock every session lock still held through it (a pooled connection would otherwise
    carry them to its next borrower), warn about each, and mark them lost for their
    holders. Where the unlock fails, a pooled connection is closed for real so that the
    pool discards it (closing ends the server session and its locks); Django closes an
    unpooled one right after. In a forked child nothing is unlocked, and the inherited
    connection is cut off first so that closing it does not end the parent's session.
    """
    locks = wrapper.__dict__.get(REGISTRY_ATTRIBUTE)
    dbapi = wrapper.connection
    if not isinstance(locks, DjangoConnectionLocks):
        # No lock used it; but a child's copy of a connection its parent opened is still
        # the parent's session, which closing it would end (the parent's locks with it).
        if dbapi is not None and opened_before_fork(dbapi):
            _cut_off_inherited(wrapper, dbapi)
        return
    # The next DB-API connection (a new one, or another from the pool) gets a new record.
    delattr(wrapper, REGISTRY_ATTRIBUTE)
    if locks.dbapi_connection is not dbapi:
        locks.django_connection_gone()
        return
    if locks.inherited:
        _cut_off_inherited(wrapper, dbapi)
        locks.django_connection_gone()
        return
    held = [h for h in locks.session_holdings() if not h.transaction]
    for holding in [*locks.holdings.values(), *locks.pending_release]:
        locks.ended.setdefault(holding, CLOSED_HOLDING)
    if held and locks.backend is not None:
        executor = locks.executor or DjangoExecutor(wrapper, dbapi, locks.driver_state)
        try:
            run_steps(release_session_locks(locks, executor))
        except Exception as error:
            logger.warning(
                "could not unlock the advisory locks on a connection to %r that Django is "
                "closing (%s); the connection is closed, which ends them",
                locks.alias,
                error,
            )
            if uses_pool(wrapper):
                dbapi.close()
        for holding in held:
            logger.warning(
                "advisory lock %r on database %r was still held when Django closed its "
                "connection; it was released, and its holder's ensure_held() and release() "
                "raise LockLost",
                holding.key.name,
                locks.alias,
            )
            locks.released(holding, "connection_closed")
    locks.django_connection_gone()


def request_started() -> None:
    """This thread starts handling a request: session locks granted from now on are its."""
    _request.active = True


def request_finished() -> None:
    """This thread's request ended: unlock the session locks it took and left held, report
    what rollbacks and closed connections released, and finish postponed unlocks.

    Runs after Django's own ``close_old_connections()``, so only connections that stay
    open into the next request (``CONN_MAX_AGE``) still have such locks; the close hook
    took care of the others.
    """
    _request.active = False
    for wrapper in connections.all(initialized_only=True):
        _unlock_request_leftovers(wrapper)
        observe_connection(wrapper)


def _unlock_request_leftovers(wrapper: BaseDatabaseWrapper) -> None:
    locks = wrapper.__dict__.get(REGISTRY_ATTRIBUTE)
    if not isinstance(locks, DjangoConnectionLocks):
        return
    leftover = [holding for holding in locks.request_holdings if holding.active]
    locks.request_holdings.clear()
    if not leftover or locks.inherited or wrapper.connection is not locks.dbapi_connection:
        return
    for holding in leftover:
        locks.ended[holding] = REQUEST_ENDED
        logger.warning(
            "advisory lock %r on database %r, taken during a request, was still held when "
            "the request ended; it is released, and its holder's ensure_held() and "
            "release() raise LockLost",
            holding.key.name,
            locks.alias,
        )
    if not wrapper.get_autocommit():
        # The request left a transaction open; unlocking inside it is fine, but Django
        # will not commit or roll back someone else's work here, so neither do we: the
        # close ends the transaction and, through the close hook, the locks.
        wrapper.close()
        return
    backend = locks.backend
    assert backend is not None
    executor = locks.executor or DjangoExecutor(wrapper, wrapper.connection, locks.driver_state)
    try:
        for holding in leftover:
            unlock = backend.release(locks.driver_state, holding.key, shared=holding.shared)
            run_steps(on(executor, unlock))
            locks.released(holding, "request_finished")
    except Exception:
        # The close hook tries once more and otherwise makes sure the connection ends.
        wrapper.close()


def open_other_connection(alias: str) -> tuple[Executor, Callable[[], None]]:
    """A new connection to ``alias``'s database beside this thread's, and how to close it
    (for statements the thread's own connection cannot run while it waits)."""
    other = new_wrapper(alias)
    other.ensure_connection()
    return DBAPIExecutor(other.connection), other.close


def release_pending(locks: DjangoConnectionLocks, executor: DjangoExecutor) -> None:
    """Unlock the session locks whose release waited for a failed transaction to end."""
    run_steps(finish_pending_releases(locks, executor))


def held_keys(alias: str) -> list[LockKey]:
    """The keys (with their names) of every lock this process holds on ``alias``'s database."""
    return [
        holding.key
        for locks in list(_registries)
        if locks.alias == alias
        for holding in list(locks.holdings.values())
    ]


class DjangoExecutor(DBAPIExecutor):
    """Runs the backend's SQL on the wrapper's DB-API connection.

    Not through Django's cursor: a release must reach the server even when Django
    refuses queries (a broken ``atomic()`` block), and execute wrappers must not see or
    alter lock statements. Driver errors are still turned into ``django.db`` errors, and
    Django learns of them for its end-of-request health check.

    Django makes its psycopg 3 connections with ``cursor_factory`` set to a
    ``ClientCursor`` (unless ``OPTIONS["server_side_binding"]``), which renders every
    parameter into the statement text on the client. The lock statements are written for
    server-side binding (the SQLAlchemy and raw psycopg binds send them so), which costs
    the client less per statement, so the executor's cursor is psycopg's own
    ``Cursor``. Django's ``prepare_threshold=None`` still applies, so they are not
    prepared (transaction poolers) unless the application's OPTIONS ask.
    """

    __slots__ = ("wrapper",)

    def __init__(
        self, wrapper: BaseDatabaseWrapper, dbapi_connection: Any, state: dict[str, Any]
    ) -> None:
        super().__init__(dbapi_connection, state)
        self.wrapper = wrapper

    def new_cursor(self) -> Any:
        connection = self.connection
        if from_psycopg3(type(connection)):
            import psycopg
            from psycopg.rows import tuple_row

            return psycopg.Cursor(connection, row_factory=tuple_row)
        return super().new_cursor()

    def failed(self) -> None:
        # Raised again inside Django's wrapper, which turns it into its own error.
        with django_errors(self.wrapper):
            raise


class DjangoSite:
    """Locks on one database alias, on the connection of the thread that takes them."""

    __slots__ = ("alias", "backend")
    binding = "django"
    # A lock's connection is the connection of the thread that took it (Django's
    # connections are per thread): only that thread may release it.
    thread_connections = True

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.backend = backend_for_alias(alias)

    @property
    def database(self) -> str:
        """The alias, as lock events name the database."""
        return self.alias

    def borrow(self, *, transaction: bool) -> DjangoBorrow:
        """The thread's connection to the alias, checked as a lock on it needs."""
        wrapper = connections[self.alias]
        if not transaction:
            registry = wrapper.__dict__.get(REGISTRY_ATTRIBUTE)
            # The usual session lock: on the DB-API connection this library lent before,
            # in this process, in autocommit (so outside atomic()), with nothing for the
            # full path below to refuse, reconcile, check or finish first. It asks the
            # full path's questions of attributes, without the calls that ask them there;
            # the borrow remembers the settings under which the alias declared no pooler
            # (ADVISORY_LOCKS["POOLERS"]), which are the settings of the moment until
            # they change.
            if (
                registry is not None  # only this module sets it: a DjangoConnectionLocks
                and registry.dbapi_connection is wrapper.connection
                and (borrow := registry.outside_borrow) is not None
                and borrow.without_pooler is conf._cached
                and registry.behind_proxy is False
                and not registry.commit_hooks
                and not registry.pending_release
                and not registry.inherited
                and wrapper.autocommit
                and not wrapper.needs_rollback
                # Not at a persistent connection's first use in a request, when
                # CONN_HEALTH_CHECKS asks Django's health check (own_connection runs it).
                and (wrapper.health_check_done or not wrapper.health_check_enabled)  # type: ignore[attr-defined]
                and _running_loop() is None  # Django refuses queries there
            ):
                return borrow  # type: ignore[no-any-return]
        return self._borrow(wrapper, transaction)

    def _borrow(self, wrapper: BaseDatabaseWrapper, transaction: bool) -> DjangoBorrow:
        alias = self.alias
        settings = lock_settings()
        pooler = settings.poolers.get(alias)
        if not transaction and pooler in SESSION_UNSAFE_POOLERS:
            raise UnsupportedFeature(
                f"database {alias!r} is behind a {pooler} pooler, where a session "
                "lock can end up on another client's server connection; use "
                "transaction=True"
            )
        if transaction and not wrapper.in_atomic_block:
            raise UnsupportedFeature(
                "transaction=True needs atomic(): manual transaction management "
                "(set_autocommit(False)) gives Django no transaction end to tie the lock to"
            )
        own_connection(wrapper)
        # Like a query, taking a lock in a transaction Django knows is broken is refused.
        refuse_broken_transaction(wrapper)
        registry = connection_locks(wrapper, self.backend)
        # Django's autocommit is the driver's: off means the statements join a
        # transaction (atomic(), or set_autocommit(False)) that the backend must protect.
        # (Async code is refused here, as every query is.)
        in_transaction = not autocommit(wrapper)
        borrow = registry.inside_borrow if in_transaction else registry.outside_borrow
        if borrow is None:
            borrow = DjangoBorrow(wrapper, registry, in_transaction=in_transaction)
            if in_transaction:
                registry.inside_borrow = borrow
            else:
                registry.outside_borrow = borrow
        executor = borrow.executor
        # Transaction poolers were refused above with Django's own wording.
        declared = None if pooler is None else "session"
        if not server_checked(registry, declared):
            run_steps(
                check_server(
                    registry,
                    executor,
                    borrow.dbapi_connection,
                    pooler=declared,
                    session_lock=not transaction,
                    declare_pooler=(
                        f"ADVISORY_LOCKS['POOLERS'] = {{{alias!r}: 'pgbouncer-session'}}"
                    ),
                )
            )
        if registry.pending_release and not in_transaction:
            release_pending(registry, executor)
        if not in_transaction and pooler is None:
            borrow.without_pooler = settings
        return borrow

    def locks(self) -> DjangoConnectionLocks:
        """This thread's registry for the alias, connecting first if needed."""
        wrapper = connections[self.alias]
        if health_check_due(wrapper):
            run_health_check(wrapper)
        wrapper.ensure_connection()
        return connection_locks(wrapper, self.backend)

    def held_names(self) -> list[LockName]:
        wrapper = connections[self.alias]
        if wrapper.connection is None:
            return []
        return connection_locks(wrapper).names()

    def holds_anywhere(self, key: LockKey) -> bool:
        """Whether any thread of this process holds ``key`` on this alias's database."""
        return any(held.ints == key.ints for held in held_keys(self.alias))


_NOT_FOUND: Final = object()
# Read by every session lock's borrow, without the module attribute lookup.
_running_loop = asyncio._get_running_loop


class DjangoBorrow:
    """The Django connection a lock runs on; never closed by the lock unless broken.

    Made once per DB-API connection (and per in/outside a transaction) by the site, which
    checks the connection for each lock before it lends it.
    """

    __slots__ = (
        "dbapi_connection",
        "executor",
        "in_transaction",
        "registry",
        "state",
        "without_pooler",
        "wrapper",
    )

    executor: DjangoExecutor
    state: DjangoConnectionLocks
    settled_by_done = True  # done() and settle() do nothing: the connection stays Django's

    def __init__(
        self,
        wrapper: BaseDatabaseWrapper,
        registry: DjangoConnectionLocks,
        *,
        in_transaction: bool,
    ) -> None:
        self.wrapper = wrapper
        self.dbapi_connection = registry.dbapi_connection
        self.registry = self.state = registry
        self.in_transaction = in_transaction
        # The settings under which the site found that the alias declares no pooler (a
        # value that is never conf's cached settings until then).
        self.without_pooler: object = _NOT_FOUND
        if registry.executor is None:
            registry.executor = DjangoExecutor(
                wrapper, registry.dbapi_connection, registry.driver_state
            )
        self.executor = registry.executor

    def done(self) -> None:
        pass

    def settle(self) -> None:
        pass

    async def asettle(self) -> None:
        pass

    def broken(self, error: BaseException) -> None:
        # The connection failed, or a wait was interrupted and the server may still grant
        # the lock to it: no one may go on using it. Inside atomic() Django marks the
        # block as failed and reconnects after it.
        if self.wrapper.connection is self.dbapi_connection:
            self.wrapper.close()
