"""The ``Lease`` model: the rows of ``advisory_locks_lease``, where lease locks live; and
``DatabaseLock``, the table-less model of the admin's "Database locks" page.

The table is the one SQLAlchemy's ``advisory_locks.sqlalchemy.lease_table()`` describes,
created by this app's migration with the very DDL ``create_lease_table()`` runs, so a
Django worker and a SQLAlchemy worker on one database exclude each other by name. The
library writes the rows; treat the model as read-only (the admin shows it that way).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.checks import CheckMessage
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections, models

from advisory_locks._dialects.lease import LEASE_TABLE

__all__ = ["DatabaseLock", "Lease"]


class Lease(models.Model):
    """One lease lock: who holds a name, its fencing token, and until when.

    Times are written by the database server's clock. ``token`` counts every acquisition
    of the name and never goes back; rows are never deleted (a free lease has no holder).
    """

    name: models.CharField[str, str] = models.CharField(max_length=255, primary_key=True)
    holder: models.CharField[str | None, str | None] = models.CharField(
        max_length=255, null=True, blank=True
    )
    token: models.BigIntegerField[int, int] = models.BigIntegerField()
    acquired_at: models.DateTimeField[datetime, datetime] = models.DateTimeField()
    renewed_at: models.DateTimeField[datetime, datetime] = models.DateTimeField()
    expires_at: models.DateTimeField[datetime, datetime] = models.DateTimeField()

    class Meta:
        db_table = LEASE_TABLE
        ordering = ("name",)
        verbose_name = "lease"
        verbose_name_plural = "leases"

    def __str__(self) -> str:
        return str(self.name)

    @classmethod
    def check(cls, **kwargs: Any) -> list[CheckMessage]:
        # A database whose backend cannot load (no MySQL driver) is what the app's own
        # check E008 explains; the model's field checks would crash on it first (the
        # integer field asks the default database for its range).
        if not _backend_loads(DEFAULT_DB_ALIAS):
            return []
        databases = [alias for alias in kwargs.get("databases") or () if _backend_loads(alias)]
        return super().check(**{**kwargs, "databases": databases})

    def save(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "lease rows are written by lease_lock() only: saving one by hand would break "
            "the fencing token's promise"
        )

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("lease rows are never deleted: the token of a name must never reset")


def _backend_loads(alias: str) -> bool:
    try:
        connections[alias]
    except ImproperlyConfigured:
        return False
    return True


class DatabaseLock(models.Model):
    """An advisory lock a database server holds or awaits: listed live, never stored.

    Django's admin lists an app's pages by model, and its permissions are per model, so
    the admin's "Database locks" page (``admin.py``) has one, without a table
    (``managed = False``). ``db_table`` is spelt out because deriving it would ask the
    default database's backend for its longest name, and a model must not load a backend
    that may be missing (the app's check E008 explains a missing MySQL driver).
    """

    class Meta:
        managed = False
        db_table = "advisory_locks_django_databaselock"
        default_permissions = ("view",)
        verbose_name = "database lock"
        verbose_name_plural = "database locks"

    @classmethod
    def check(cls, **kwargs: Any) -> list[CheckMessage]:
        # As Lease's: its id field's checks would load a backend that cannot load.
        if not _backend_loads(DEFAULT_DB_ALIAS):
            return []
        databases = [alias for alias in kwargs.get("databases") or () if _backend_loads(alias)]
        return super().check(**{**kwargs, "databases": databases})
