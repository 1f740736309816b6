"""``Model.objects.with_advisory_lock(name, ...)``: a lock on the manager's database.

The database is the one Django would write to: ``.using()`` / ``db_manager()`` when
given, else the routers' ``db_for_write``. A lock on a read replica would not exclude
writers on the primary.
"""

from __future__ import annotations

from typing import Any, TypeVar

from django.db import models, router

from advisory_locks.keys import LockName
from advisory_locks_django.locks import DjangoAdvisoryLock, NameSpec, advisory_lock

__all__ = [
    "AdvisoryLockManager",
    "AdvisoryLockManagerMixin",
    "AdvisoryLockQuerySet",
    "AdvisoryLockQuerySetMixin",
]

M = TypeVar("M", bound=models.Model)


def _lock_for(
    source: Any, name: NameSpec | LockName, options: dict[str, Any]
) -> DjangoAdvisoryLock:
    if "using" in options:
        raise TypeError("with_advisory_lock() uses the manager's database; call .using() first")
    using = source._db or router.db_for_write(source.model, **source._hints)
    return advisory_lock(name, using=using, **options)


class AdvisoryLockQuerySetMixin:
    """Adds ``with_advisory_lock()`` to a QuerySet class of your own."""

    def with_advisory_lock(self, name: NameSpec, **options: Any) -> DjangoAdvisoryLock:
        """[advisory_lock][advisory_locks_django.advisory_lock] on this queryset's database.

        The database is the one Django would write this queryset's model to: the alias
        given to ``.using()``, else the routers' ``db_for_write``.

        :param name: the lock name, as for ``advisory_lock()``.
        :param options: ``timeout``, ``shared``, ``transaction``, ``skip_if_locked``,
            ``key_scheme`` and ``key_prefix``, as for ``advisory_lock()``; not ``using``.
        :returns: a [DjangoAdvisoryLock][advisory_locks_django.DjangoAdvisoryLock].
        :raises TypeError: when ``using`` is passed (call ``.using(alias)`` first).
        """
        return _lock_for(self, name, options)


class AdvisoryLockManagerMixin:
    """Adds ``with_advisory_lock()`` to a Manager class of your own."""

    def with_advisory_lock(self, name: NameSpec, **options: Any) -> DjangoAdvisoryLock:
        """[advisory_lock][advisory_locks_django.advisory_lock] on this manager's database.

        The database is the one Django would write this manager's model to: the alias
        given to ``.db_manager()`` or ``.using()``, else the routers' ``db_for_write``.

        :param name: the lock name, as for ``advisory_lock()``.
        :param options: ``timeout``, ``shared``, ``transaction``, ``skip_if_locked``,
            ``key_scheme`` and ``key_prefix``, as for ``advisory_lock()``; not ``using``.
        :returns: a [DjangoAdvisoryLock][advisory_locks_django.DjangoAdvisoryLock].
        :raises TypeError: when ``using`` is passed (call ``.using(alias)`` first).
        """
        return _lock_for(self, name, options)


class AdvisoryLockQuerySet(AdvisoryLockQuerySetMixin, models.QuerySet[M]):
    """A QuerySet with ``with_advisory_lock()``; ``AdvisoryLockQuerySet.as_manager()`` works."""


class AdvisoryLockManager(AdvisoryLockManagerMixin, models.Manager[M]):
    """A Manager with ``with_advisory_lock()``.

    Its querysets are [AdvisoryLockQuerySet][advisory_locks_django.AdvisoryLockQuerySet]s.
    """

    def get_queryset(self) -> AdvisoryLockQuerySet[M]:
        hints: dict[str, Any] = getattr(self, "_hints", {})
        return AdvisoryLockQuerySet(self.model, using=self._db, hints=hints)
