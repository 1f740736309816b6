"""SQLAlchemy: Session classes with ``session.advisory_lock()``, and the binding.

Importing this module registers the SQLAlchemy binding and its pool and transaction
listeners. ``advisory_locks.advisory_lock()`` imports it on first use of a SQLAlchemy
bind; import it at application start-up (or use ``AdvisoryLockSession``) so that the
listeners exist before the first connection is made.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from advisory_locks._bindings.sqlalchemy import (
    POOLER_OPTION,
    AsyncBind,
    LockConnectionTimeout,
    SyncBind,
)
from advisory_locks._bindings.sqlalchemy_lease import create_lease_table, lease_table
from advisory_locks._core.advisory import AdvisoryLock, AsyncAdvisoryLock
from advisory_locks._core.contract import Timeout
from advisory_locks._core.dispatch import (
    advisory_lock,
    advisory_lock_set,
    current_advisory_locks,
    lease_lock,
    prune_leases,
)
from advisory_locks.keys import KeyScheme, LockName

__all__ = [
    "POOLER_OPTION",
    "AdvisoryLockSession",
    "AdvisoryLockSessionMixin",
    "AsyncAdvisoryLockSession",
    "AsyncBind",
    "LockConnectionTimeout",
    "SyncBind",
    "advisory_lock",
    "advisory_lock_set",
    "create_lease_table",
    "current_advisory_locks",
    "lease_lock",
    "lease_table",
    "prune_leases",
]


class AdvisoryLockSessionMixin:
    """Adds ``advisory_lock()`` to a Session class of your own."""

    def advisory_lock(
        self,
        name: LockName,
        *,
        timeout: Timeout = None,
        shared: bool = False,
        transaction: bool = False,
        key_scheme: KeyScheme | None = None,
        key_prefix: str | int | None = None,
    ) -> AdvisoryLock:
        """[advisory_lock][advisory_locks.advisory_lock] with this Session as the bind.

        :param name: the lock name.
        :param timeout: ``None`` waits, ``0`` never waits, ``t`` waits at most ``t`` seconds.
        :param shared: a shared (reader) lock.
        :param transaction: held until this Session's transaction ends.
        :param key_scheme: how a ``str`` name becomes a key.
        :param key_prefix: a namespace for ``str`` names.
        """
        assert isinstance(self, Session), "AdvisoryLockSessionMixin needs a Session subclass"
        return advisory_lock(
            self,
            name,
            timeout=timeout,
            shared=shared,
            transaction=transaction,
            key_scheme=key_scheme,
            key_prefix=key_prefix,
        )


class AdvisoryLockSession(AdvisoryLockSessionMixin, Session):
    """A Session with ``advisory_lock()``; use ``sessionmaker(class_=AdvisoryLockSession)``."""


class AsyncAdvisoryLockSession(AsyncSession):
    """An AsyncSession with ``advisory_lock()``; use ``async_sessionmaker(class_=...)``."""

    sync_session_class = AdvisoryLockSession

    def advisory_lock(
        self,
        name: LockName,
        *,
        timeout: Timeout = None,
        shared: bool = False,
        transaction: bool = False,
        key_scheme: KeyScheme | None = None,
        key_prefix: str | int | None = None,
    ) -> AsyncAdvisoryLock:
        """[advisory_lock][advisory_locks.advisory_lock] with this AsyncSession as the bind.

        :param name: the lock name.
        :param timeout: ``None`` waits, ``0`` never waits, ``t`` waits at most ``t`` seconds.
        :param shared: a shared (reader) lock.
        :param transaction: held until this Session's transaction ends.
        :param key_scheme: how a ``str`` name becomes a key.
        :param key_prefix: a namespace for ``str`` names.
        """
        return advisory_lock(
            self,
            name,
            timeout=timeout,
            shared=shared,
            transaction=transaction,
            key_scheme=key_scheme,
            key_prefix=key_prefix,
        )
