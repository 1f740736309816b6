"""Database-held named locks for SQLAlchemy and Django.

Public API: :func:`advisory_lock`, :class:`AdvisoryLock`, :func:`lock_key`,
:func:`current_advisory_locks` and the errors below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from advisory_locks.errors import (
    AdvisoryLockError,
    LockDeadlock,
    LockLost,
    LockNotAcquired,
    LockTimeout,
    UnsupportedDatabase,
    UnsupportedFeature,
)
from advisory_locks.keys import LockName, lock_key
from advisory_locks.lock import AdvisoryLock, AsyncAdvisoryLock

try:
    # Imported eagerly when SQLAlchemy is installed: the binding registers its
    # transaction and pool listeners, which must exist before connections are made.
    from advisory_locks.sqlalchemy import advisory_lock, current_advisory_locks
except ImportError as error:  # pragma: no cover - exercised only without SQLAlchemy
    _missing = error

    def advisory_lock(bind: Any, name: LockName, **options: Any) -> Any:  # type: ignore[misc]
        raise UnsupportedDatabase(
            "advisory_lock(bind, ...) needs SQLAlchemy: pip install 'advisory-locks[sqlalchemy]'"
        ) from _missing

    def current_advisory_locks(bind: Any) -> list[LockName]:  # type: ignore[misc]
        raise UnsupportedDatabase(
            "current_advisory_locks(bind) needs SQLAlchemy: "
            "pip install 'advisory-locks[sqlalchemy]'"
        ) from _missing

if TYPE_CHECKING:
    pass

__all__ = [
    "AdvisoryLock",
    "AdvisoryLockError",
    "AsyncAdvisoryLock",
    "LockDeadlock",
    "LockLost",
    "LockName",
    "LockNotAcquired",
    "LockTimeout",
    "UnsupportedDatabase",
    "UnsupportedFeature",
    "advisory_lock",
    "current_advisory_locks",
    "lock_key",
]

__version__ = "0.1.0.dev0"
