"""Where a Django database connection becomes the core's LockSite and Lease.

This module is the only place that looks inside Django's connection objects. The lock
logic is the core's ``AdvisoryLock``, and the SQL is the dialect
backend's (``backend_for_dialect(connection.vendor)``), so every backend the core gains
works here unchanged.

What one Django connection holds is recorded in a ``DjangoConnectionLocks`` kept on
the ``DatabaseWrapper`` (which Django keeps per thread and alias) together with the DB-API
connection it describes. When Django closes or reconnects (``CONN_MAX_AGE``,
``close_old_connections()``, ``connection.close()``) the DB-API connection changes, the
server has released everything, and the record is replaced at the next look.

Transaction locks follow Django's own bookkeeping of a transaction's fate: each one puts a
callback in ``connection.run_on_commit``. Django calls it after the outermost commit and
drops it when the transaction, or a savepoint the lock was taken in, rolls back -- which
is exactly when PostgreSQL releases the lock. A weakref finalizer notices the drop at once
on CPython; the registry also checks the list each time it is used, so it stays right on
interpreters that collect later.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from django.db import connections

from advisory_locks._core.connection import (
    ConnectionState,
    Holding,
    check_server,
    finish_pending_releases,
)
from advisory_locks._core.executors import DBAPIExecutor
from advisory_locks._core.steps import Statement, run_steps
from advisory_locks._dialects import Backend, backend_for_dialect
from advisory_locks.errors import UnsupportedFeature
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
    "connection_locks",
    "held_keys",
    "observe_connection",
]

REGISTRY_ATTRIBUTE: Final = "_advisory_locks"

# Every registry alive in this process, so the management command can name the keys of
# locks this process holds, whichever thread holds them.
_registries: weakref.WeakSet[DjangoConnectionLocks] = weakref.WeakSet()

# Told of every lock the server gave back, with the reason (the app's signals subscribe;
# the bookkeeping itself sends nothing).
ReleaseListener = Callable[["DjangoConnectionLocks", Holding, float, str], None]
release_listeners: list[ReleaseListener] = []


def backend_for_alias(alias: str) -> Backend:
    """The dialect backend for a database alias (raises UnsupportedDatabase)."""
    return backend_for_dialect(connections[alias].vendor)


@dataclass(eq=False)
class DjangoConnectionLocks(ConnectionState):
    """What one DB-API connection of one Django alias holds through this library."""

    alias: str = "default"
    dbapi_connection: Any = None
    wrapper: weakref.ReferenceType[BaseDatabaseWrapper] | None = None
    granted_at: dict[Holding, float] = field(default_factory=dict)
    executor: DjangoExecutor | None = None
    # The run_on_commit callback that watches each transaction lock.
    commit_hooks: dict[Holding, weakref.ReferenceType[Callable[[], None]]] = field(
        default_factory=dict
    )

    def add(self, key: LockKey, *, shared: bool, transaction: bool) -> Holding:
        holding = super().add(key, shared=shared, transaction=transaction)
        self.granted_at[holding] = time.monotonic()
        if transaction:
            self._watch_transaction(holding)
        return holding

    def forget(self, holding: Holding) -> None:
        super().forget(holding)
        self.commit_hooks.pop(holding, None)

    def released(self, holding: Holding, reason: str) -> None:
        """The server no longer holds ``holding``: forget it and say so."""
        if holding.active:
            self.forget(holding)
        granted_at = self.granted_at.pop(holding, None)
        if granted_at is None:
            return  # already reported
        held = time.monotonic() - granted_at
        for listener in release_listeners:
            listener(self, holding, held, reason)

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

    def reconcile(self, wrapper: BaseDatabaseWrapper) -> None:
        """Forget transaction locks whose transaction or savepoint has ended."""
        if not self.commit_hooks:
            return
        pending = {id(entry[1]) for entry in wrapper.run_on_commit}
        for holding, hook in list(self.commit_hooks.items()):
            callback = hook()
            if callback is None or id(callback) not in pending or not wrapper.in_atomic_block:
                self.released(holding, "rollback")

    def django_connection_gone(self) -> None:
        """Django closed or replaced the DB-API connection; the server let go of all."""
        for holding in self.connection_gone():
            self.released(holding, "connection_closed")


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
            alias=wrapper.alias, dbapi_connection=dbapi, wrapper=weakref.ref(wrapper)
        )
        setattr(wrapper, REGISTRY_ATTRIBUTE, locks)
        _registries.add(locks)
    else:
        locks.reconcile(wrapper)
    if backend is not None:
        locks.backend = backend
    return locks


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


def release_pending(locks: DjangoConnectionLocks, executor: DjangoExecutor) -> None:
    """Unlock the session locks whose release waited for a failed transaction to end."""
    for holding in run_steps(finish_pending_releases(locks, executor)):
        locks.released(holding, "unlock")


def held_keys(alias: str) -> list[LockKey]:
    """The keys (with their names) of every lock this process holds on ``alias``'s database."""
    return [
        holding.key
        for locks in list(_registries)
        if locks.alias == alias
        for holding in list(locks.holdings.values())
    ]


class DjangoExecutor:
    """Runs the backend's SQL on the wrapper's DB-API connection.

    Not through Django's cursor: a release must reach the server even when Django
    refuses queries (a broken ``atomic()`` block), and execute wrappers must not see or
    alter lock statements. Driver errors are still turned into ``django.db`` errors, and
    Django learns of them for its end-of-request health check.
    """

    __slots__ = ("_executor", "wrapper")

    def __init__(
        self, wrapper: BaseDatabaseWrapper, dbapi_connection: Any, state: dict[str, Any]
    ) -> None:
        self.wrapper = wrapper
        self._executor = DBAPIExecutor(dbapi_connection, state)

    @property
    def state(self) -> dict[str, Any]:
        return self._executor.state

    def execute(self, statement: Statement) -> object:
        with self.wrapper.wrap_database_errors:
            return self._executor.execute(statement)


class DjangoSite:
    """Locks on one database alias, on the connection of the thread that takes them."""

    __slots__ = ("alias", "backend", "last_borrow")

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.backend = backend_for_alias(alias)
        # The borrow of the latest acquire, so the caller can find what it was granted.
        self.last_borrow: DjangoBorrow | None = None

    def borrow(self, *, transaction: bool) -> DjangoBorrow:
        self.last_borrow = DjangoBorrow(self, connections[self.alias], transaction=transaction)
        return self.last_borrow

    def locks(self) -> DjangoConnectionLocks:
        """This thread's registry for the alias, connecting first if needed."""
        wrapper = connections[self.alias]
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


class DjangoBorrow:
    """The Django connection a lock runs on; never closed by the lock unless broken."""

    __slots__ = ("dbapi_connection", "executor", "in_transaction", "registry", "state", "wrapper")

    executor: DjangoExecutor
    state: DjangoConnectionLocks

    def __init__(
        self, site: DjangoSite, wrapper: BaseDatabaseWrapper, *, transaction: bool
    ) -> None:
        pooler = lock_settings().poolers.get(site.alias)
        if not transaction and pooler in SESSION_UNSAFE_POOLERS:
            raise UnsupportedFeature(
                f"database {site.alias!r} is behind a {pooler} pooler, where a session "
                "lock can end up on another client's server connection; use "
                "transaction=True"
            )
        if transaction and not wrapper.in_atomic_block:
            raise UnsupportedFeature(
                "transaction=True needs atomic(): manual transaction management "
                "(set_autocommit(False)) gives Django no transaction end to tie the lock to"
            )
        if wrapper.connection is None:
            # Raises SynchronousOnlyOperation in async code, like any Django query would
            # (async code has no connection of its own to find here).
            wrapper.ensure_connection()
        # Like a query, taking a lock in a transaction Django knows is broken is refused.
        wrapper.validate_no_broken_transaction()
        self.wrapper = wrapper
        self.dbapi_connection = wrapper.connection
        self.registry = self.state = connection_locks(wrapper, site.backend)
        # Django's autocommit is the driver's: off means the statements join a
        # transaction (atomic(), or set_autocommit(False)) that the backend must protect.
        self.in_transaction = not wrapper.get_autocommit()
        if self.registry.executor is None:
            self.registry.executor = DjangoExecutor(
                wrapper, self.dbapi_connection, self.registry.driver_state
            )
        self.executor = self.registry.executor
        run_steps(
            check_server(
                self.registry,
                self.executor,
                self.dbapi_connection,
                # Transaction poolers were refused above with Django's own wording.
                pooler=None if pooler is None else "session",
                session_lock=not transaction,
                declare_pooler=(
                    f"ADVISORY_LOCKS['POOLERS'] = {{{site.alias!r}: 'pgbouncer-session'}}"
                ),
            )
        )
        if self.registry.pending_release and not self.in_transaction:
            release_pending(self.registry, self.registry.executor)

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
