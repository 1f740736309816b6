"""Database-held named locks for SQLAlchemy and Django.

Public API: ``advisory_lock()``, ``AdvisoryLock``, ``lock_key()``,
``current_advisory_locks()`` and the errors below.
"""

from __future__ import annotations

import importlib.util
from typing import Any

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
from advisory_locks.lock import (
    AdvisoryLock,
    AdvisoryLockSet,
    AsyncAdvisoryLock,
    AsyncAdvisoryLockSet,
)

if importlib.util.find_spec("sqlalchemy") is not None:
    # Imported eagerly: the binding registers its transaction and pool listeners, which
    # must exist before the application makes its first connection.
    from advisory_locks.sqlalchemy import (
        advisory_lock,
        advisory_lock_set,
        current_advisory_locks,
    )


def __getattr__(name: str) -> Any:
    if name in ("advisory_lock", "advisory_lock_set", "current_advisory_locks"):
        raise UnsupportedDatabase(
            f"advisory_locks.{name} needs SQLAlchemy: pip install 'advisory-locks[sqlalchemy]'"
        )
    raise AttributeError(f"module 'advisory_locks' has no attribute {name!r}")


__all__ = [
    "AdvisoryLock",
    "AdvisoryLockError",
    "AdvisoryLockSet",
    "AsyncAdvisoryLock",
    "AsyncAdvisoryLockSet",
    "LockDeadlock",
    "LockLost",
    "LockName",
    "LockNotAcquired",
    "LockTimeout",
    "UnsupportedDatabase",
    "UnsupportedFeature",
    "advisory_lock",
    "advisory_lock_set",
    "current_advisory_locks",
    "lock_key",
]

__version__ = "0.1.0.dev0"
