"""Every private psycopg_pool API the psycopg bindings use, each with the versions it was
checked against (psycopg_pool 3.2 and 3.3).

psycopg_pool has no check-in event: the one place where it runs code of the
application's on every returned connection is the ``reset`` callable given to the pool,
which it keeps as ``_reset`` and calls (awaits, on an ``AsyncConnectionPool``) once it
has rolled back an open transaction, before the connection can be handed out again. An
exception there makes the pool close the connection instead of reusing it.

A pool that has a reset callable returns every connection through a worker (``_putconn``
queues a ``ReturnConnection`` task when ``_reset`` is set; without one it calls
``_return_connection`` in the caller's thread or task). Installing the guard as the reset
would make every check-in of a pool that had none a hand-off to the worker and every
check-out after it a wait for that worker: a thread switch per lock. So where the
application gave the pool no reset of its own, the pool's ``_putconn`` is replaced by one
that returns the connection at once, as the pool does without a reset, the guard included
(``_return_connection`` runs ``_reset``): a lock left on the connection is unlocked before
``putconn()`` returns.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final

__all__ = ["CHECKED_VERSIONS", "aconnect_like", "connect_like", "guard_checkin", "pool_of"]

CHECKED_VERSIONS: Final = ("3.2", "3.3")

# Marks a pool whose reset callable already runs the guard.
GUARDED_ATTRIBUTE: Final = "_advisory_locks_checkin_guard"

_guarding = threading.Lock()


def pool_of(connection: Any) -> Any:
    """The pool ``connection`` is checked out of, None for other connections.

    ``Connection._pool``: set at check-out, None once the connection is back in its pool.
    """
    return getattr(connection, "_pool", None)


def guard_checkin(pool: Any, guard: Callable[[Any, Any], Any]) -> None:
    """Make ``pool`` call ``guard(connection, reset)`` for every connection that comes
    back, where ``reset`` is the application's own reset callable (or None): the guard
    runs it (awaits it, for an async pool) after its own work. Installed once per pool.
    """
    if getattr(pool, GUARDED_ATTRIBUTE, False):
        return
    with _guarding:
        if getattr(pool, GUARDED_ATTRIBUTE, False):
            return
        reset = pool._reset

        def guarded(connection: Any) -> Any:
            return guard(connection, reset)

        pool._reset = guarded
        if reset is None:
            pool._putconn = _return_at_once(pool)
        setattr(pool, GUARDED_ATTRIBUTE, True)


def _return_at_once(pool: Any) -> Callable[[Any, bool], Any]:
    """A ``_putconn`` for ``pool`` that returns a connection without its worker, as the
    pool itself does when it has no reset callable (``pool._return_connection``:
    rollback of an open transaction, the reset, the check of a broken or expired
    connection, then back to the pool or to a waiting client). Refers to the pool weakly:
    an attribute of the pool must not keep it alive."""
    pool_ref = weakref.ref(pool)
    if inspect.iscoroutinefunction(type(pool)._putconn):

        async def areturn(connection: Any, from_getconn: bool) -> None:
            owner = pool_ref()
            if owner is not None:
                await owner._return_connection(connection, from_getconn=from_getconn)

        return areturn

    def return_now(connection: Any, from_getconn: bool) -> None:
        owner = pool_ref()
        if owner is not None:
            owner._return_connection(connection, from_getconn=from_getconn)

    return return_now


def connect_like(pool: Any) -> Any:
    """A new connection made as ``pool`` makes its own (``ConnectionPool._connect``), then
    switched to autocommit, never handed to the pool: its public ``connection_class``,
    ``conninfo`` and ``kwargs``, each of the last two called first where it is a function
    (psycopg_pool 3.3: credentials fetched per connection), and the pool's ``configure``
    callable, which it keeps as ``_configure``, run on it."""
    conninfo = pool.conninfo() if callable(pool.conninfo) else pool.conninfo or ""
    kwargs = pool.kwargs() if callable(pool.kwargs) else pool.kwargs or {}
    connection = pool.connection_class.connect(conninfo, **kwargs)
    try:
        configure = getattr(pool, "_configure", None)
        if configure is not None:
            configure(connection)
        # After configure, which may set its own mode; a transaction it left open
        # refuses the switch, as the pool refuses such a connection.
        connection.autocommit = True
    except BaseException:
        connection.close()
        raise
    return connection


async def aconnect_like(pool: Any) -> Any:
    """``connect_like`` for an ``AsyncConnectionPool`` (whose functions may be
    coroutine functions, and whose ``configure`` is one)."""
    conninfo = pool.conninfo
    if callable(conninfo):
        conninfo = conninfo()
        if inspect.isawaitable(conninfo):
            conninfo = await conninfo
    kwargs = pool.kwargs
    if callable(kwargs):
        kwargs = kwargs()
        if inspect.isawaitable(kwargs):
            kwargs = await kwargs
    connection = await pool.connection_class.connect(conninfo or "", **(kwargs or {}))
    try:
        configure = getattr(pool, "_configure", None)
        if configure is not None:
            await configure(connection)
        await connection.set_autocommit(True)  # after configure (see connect_like)
    except BaseException:
        await connection.close()
        raise
    return connection
