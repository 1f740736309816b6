"""The exceptions advisory-locks raises; all derive from AdvisoryLockError."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from advisory_locks.keys import LockName

__all__ = [
    "AdvisoryLockError",
    "LeaseTableMissing",
    "LockConnectionLost",
    "LockDeadlock",
    "LockLost",
    "LockNotAcquired",
    "LockStolen",
    "LockTimeout",
    "LockUsageError",
    "UnsupportedDatabase",
    "UnsupportedFeature",
]


class AdvisoryLockError(Exception):
    """Base class of every error this library raises on purpose."""


class LockNotAcquired(AdvisoryLockError):
    """The lock is held elsewhere and was not granted within the timeout."""

    def __init__(self, message: str, *, name: LockName | None = None) -> None:
        super().__init__(message)
        self.name = name


class LockTimeout(LockNotAcquired, TimeoutError):
    """The server gave up waiting after the requested timeout (or a statement timeout)."""


class LockDeadlock(AdvisoryLockError):
    """The server detected a deadlock and chose this wait as its victim."""

    def __init__(self, message: str, *, name: LockName | None = None) -> None:
        super().__init__(message)
        self.name = name


class LockLost(AdvisoryLockError):
    """The lock was held, but the server no longer holds it for us.

    Raised on release when the connection died (backend terminated, failover) or the
    server reports that the lock was not held.
    """

    def __init__(self, message: str, *, name: LockName | None = None) -> None:
        super().__init__(message)
        self.name = name


class LockConnectionLost(AdvisoryLockError, ConnectionError):
    """The connection a lock was being taken on is gone; nothing was acquired.

    Raised by an acquire (``with``, ``acquire()``) when the server ended the session
    (restart, failover, ``pg_terminate_backend``, ``KILL CONNECTION``, an idle timeout) or
    the network dropped it; ``__cause__`` is the driver's error. Not ``LockNotAcquired``:
    nobody else holds the lock as far as anyone knows, so skipping the work as "already
    being done" would be wrong. Through a pool (an Engine, a Session, a driver's pool) the
    dead connection has been discarded the way the pool discards one after a disconnect,
    so trying again takes a fresh connection. Also a ``ConnectionError``, so retry
    policies written for connection failures apply. A lock already *held* when its
    connection dies is reported as ``LockLost`` instead.
    """

    def __init__(self, message: str, *, name: LockName | None = None) -> None:
        super().__init__(message)
        self.name = name


class LockStolen(LockLost):
    """A lease lock was taken over: another holder acquired it after ours expired.

    ``holder`` and ``token`` describe the holding that took it over, as the database
    reported them when the loss was learnt (``None`` where it could not be asked).
    """

    def __init__(
        self,
        message: str,
        *,
        name: LockName | None = None,
        holder: str | None = None,
        token: int | None = None,
    ) -> None:
        super().__init__(message, name=name)
        self.holder = holder
        self.token = token


class LeaseTableMissing(AdvisoryLockError):
    """The database has no ``advisory_locks_lease`` table; the message says how to create it."""


class LockUsageError(AdvisoryLockError, RuntimeError):
    """The lock object was used in a way its contract forbids: released by a thread or
    task that does not hold it, shared between threads or tasks, released when not held,
    a sync lock used with ``async with`` (and the other way round), or taken, released or
    checked while its psycopg 3 connection is in pipeline mode (nothing is sent then, and
    a refused release leaves the lock held, to be released after the pipeline)."""


class UnsupportedDatabase(AdvisoryLockError):
    """The bind's database or driver has no backend in this library."""


class UnsupportedFeature(AdvisoryLockError):
    """The database cannot honour the requested mode (for example a shared lock)."""


for _error in (
    AdvisoryLockError,
    LockNotAcquired,
    LockTimeout,
    LockDeadlock,
    LockLost,
    LockStolen,
    LeaseTableMissing,
    LockConnectionLost,
    LockUsageError,
    UnsupportedDatabase,
    UnsupportedFeature,
):
    _error.__module__ = "advisory_locks"
del _error
