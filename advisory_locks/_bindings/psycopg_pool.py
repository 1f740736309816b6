"""psycopg_pool's refusals to lend a lock a connection, as the library's errors.

A lock on a ``ConnectionPool`` or ``AsyncConnectionPool`` checks a connection out with
``getconn()``, which waits at most the pool's ``timeout`` and then raises ``PoolTimeout``,
and raises ``PoolClosed`` on a pool that is closed or not open yet. Each becomes an error
of the library that is also the pool's class, so that a handler for either catches it.
The psycopg bindings import this module when psycopg_pool is installed; the public names
are in ``advisory_locks.psycopg_pool``.
"""

from __future__ import annotations

from typing import Any

from psycopg_pool import PoolClosed, PoolTimeout

from advisory_locks._bindings._raw import locks_named
from advisory_locks.errors import AdvisoryLockError, LockUsageError
from advisory_locks.keys import LockName

__all__ = ["LockConnectionTimeout", "LockPoolClosed", "pool_refusal"]


class LockConnectionTimeout(AdvisoryLockError, PoolTimeout):
    """A lock on a ``psycopg_pool`` pool needed a connection and none came free within
    the pool's ``timeout``; nothing was acquired and nothing was taken from the pool.

    Raised instead of psycopg_pool's ``PoolTimeout``, which it also is (handlers for that
    keep working), with a message that says how to size the pool; ``__cause__`` is the
    pool's error. Not a ``LockNotAcquired``: the lock itself was never asked for. ``name``
    is the lock's name (None for a lock set, whose names the message gives).
    """

    def __init__(self, message: str, *, name: LockName | None = None) -> None:
        super().__init__(message)
        self.name = name


class LockPoolClosed(LockUsageError, PoolClosed):
    """A lock was taken on a ``psycopg_pool`` pool that is closed or not open yet.

    Raised instead of psycopg_pool's ``PoolClosed``, which it also is; ``__cause__`` is
    the pool's error. ``name`` as in ``LockConnectionTimeout``.
    """

    def __init__(self, message: str, *, name: LockName | None = None) -> None:
        # psycopg's Error.__init__ sets what its properties (diag, pgconn) read; in this
        # class's order of bases RuntimeError's would run instead of it.
        PoolClosed.__init__(self, message)
        self.name = name


LockConnectionTimeout.__module__ = "advisory_locks.psycopg_pool"
LockPoolClosed.__module__ = "advisory_locks.psycopg_pool"


def pool_refusal(
    pool: Any, error: Exception, names: tuple[LockName, ...], *, lease: bool = False
) -> Exception | None:
    """The library's error for what ``pool.getconn()`` raised for the locks ``names``, or
    for a statement of a lease lock (``RawDriver.pool_refusal``); None for any other
    error."""
    name = names[0] if len(names) == 1 else None
    what = "a lease lock" if lease else locks_named(names)
    if isinstance(error, PoolTimeout):
        if lease:
            holding = (
                "A held lease keeps no connection, but each of its acquire, release and "
                "ensure_held() borrows one for a statement: make max_size at least the "
                "number of threads or tasks that use connections at once."
            )
        else:
            holding = (
                "A lock on a pool holds one of its connections for as long as it is held, "
                "besides the connections the application has checked out: make max_size "
                "at least the number of threads or tasks that hold connections at once, "
                "locks included, or take the lock on a connection you have checked out "
                "already."
            )
        return LockConnectionTimeout(
            f"{what} needed a connection from the psycopg_pool pool {pool.name!r} and "
            f"none came free within its timeout ({_status(pool)}). {holding} A pool that "
            "cannot reach its server times out the same way; its log says so.",
            name=name,
        )
    if isinstance(error, PoolClosed):
        return LockPoolClosed(
            f"{what} needs a connection from the psycopg_pool pool "
            f"{pool.name!r}, which lends none: {error}. Take locks on a pool while it is "
            "open, between its open() and close() (or inside `with ConnectionPool(...) as "
            "pool:`, `async with` for an AsyncConnectionPool).",
            name=name,
        )
    return None


def _status(pool: Any) -> str:
    """The pool's limits and its connections, as ``get_stats()`` counts them (not its
    waiting requests: one that timed out stays counted until a connection comes free)."""
    stats = pool.get_stats()
    return (
        f"timeout={pool.timeout:g} s, max_size={pool.max_size}; "
        f"{stats.get('pool_size', '?')} open, {stats.get('pool_available', '?')} idle"
    )
