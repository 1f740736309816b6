"""Django integration for advisory-locks: add ``"advisory_locks_django"`` to INSTALLED_APPS.

Public API: ``advisory_lock()``, ``DjangoAdvisoryLock``, ``current_advisory_locks()``,
``lease_lock()`` / ``DjangoLeaseLock`` and ``prune_leases()`` (lease locks; the ``Lease``
model is in ``advisory_locks_django.models``), the managers and querysets, and the signals
``lock_acquired``, ``lock_released`` and ``lock_failed``. See docs/django.md.
"""

from advisory_locks.errors import (
    AdvisoryLockError,
    LeaseTableMissing,
    LockDeadlock,
    LockLost,
    LockNotAcquired,
    LockStolen,
    LockTimeout,
    UnsupportedDatabase,
    UnsupportedFeature,
)
from advisory_locks_django.leases import DjangoLeaseLock, lease_lock, prune_leases
from advisory_locks_django.locks import DjangoAdvisoryLock, advisory_lock, current_advisory_locks
from advisory_locks_django.managers import (
    AdvisoryLockManager,
    AdvisoryLockManagerMixin,
    AdvisoryLockQuerySet,
    AdvisoryLockQuerySetMixin,
)
from advisory_locks_django.signals import (
    lease_acquired,
    lease_failed,
    lease_lost,
    lease_released,
    lease_renewal_failed,
    lock_acquired,
    lock_failed,
    lock_released,
)

__all__ = [
    "AdvisoryLockError",
    "AdvisoryLockManager",
    "AdvisoryLockManagerMixin",
    "AdvisoryLockQuerySet",
    "AdvisoryLockQuerySetMixin",
    "DjangoAdvisoryLock",
    "DjangoLeaseLock",
    "LeaseTableMissing",
    "LockDeadlock",
    "LockLost",
    "LockNotAcquired",
    "LockStolen",
    "LockTimeout",
    "UnsupportedDatabase",
    "UnsupportedFeature",
    "advisory_lock",
    "current_advisory_locks",
    "lease_acquired",
    "lease_failed",
    "lease_lock",
    "lease_lost",
    "lease_released",
    "lease_renewal_failed",
    "lock_acquired",
    "lock_failed",
    "lock_released",
    "prune_leases",
]
