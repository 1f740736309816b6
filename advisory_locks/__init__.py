"""Database-held named locks for SQLAlchemy, Django and the raw database drivers.

Public API: ``advisory_lock()``, ``advisory_lock_set()``, ``current_advisory_locks()``,
``declare_pooler()`` (raw driver pools and connections), ``lease_lock()``,
``prune_leases()``, ``lock_key()``,
the lock objects and the errors below. Importing this package loads no ORM and no driver:
the binding for a bind is imported the first time such a bind is used (``import
advisory_locks.sqlalchemy`` early to register SQLAlchemy's listeners before the first
connection, see docs/concepts/architecture.md).
"""

from __future__ import annotations

from advisory_locks._bindings._raw import declare_pooler
from advisory_locks._core.advisory import (
    AdvisoryLock,
    AdvisoryLockSet,
    AsyncAdvisoryLock,
    AsyncAdvisoryLockSet,
)
from advisory_locks._core.dispatch import (
    advisory_lock,
    advisory_lock_set,
    current_advisory_locks,
    lease_lock,
    prune_leases,
)
from advisory_locks._core.lease import AsyncLeaseLock, LeaseLock
from advisory_locks.errors import (
    AdvisoryLockError,
    LeaseTableMissing,
    LockConnectionLost,
    LockDeadlock,
    LockLost,
    LockNotAcquired,
    LockStolen,
    LockTimeout,
    LockUsageError,
    UnsupportedDatabase,
    UnsupportedFeature,
)
from advisory_locks.keys import LockName, lock_key

__all__ = [
    "AdvisoryLock",
    "AdvisoryLockError",
    "AdvisoryLockSet",
    "AsyncAdvisoryLock",
    "AsyncAdvisoryLockSet",
    "AsyncLeaseLock",
    "LeaseLock",
    "LeaseTableMissing",
    "LockConnectionLost",
    "LockDeadlock",
    "LockLost",
    "LockName",
    "LockNotAcquired",
    "LockStolen",
    "LockTimeout",
    "LockUsageError",
    "UnsupportedDatabase",
    "UnsupportedFeature",
    "advisory_lock",
    "advisory_lock_set",
    "current_advisory_locks",
    "declare_pooler",
    "lease_lock",
    "lock_key",
    "prune_leases",
]

__version__ = "0.1.0.dev0"
