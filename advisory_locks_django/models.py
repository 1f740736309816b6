"""The app's one model: no table, only the admin's "Database locks" page and its permission.

Django's admin lists an app's pages by model, and its permissions are per model: the
model gives the page its place under "Advisory locks" and a ``view_databaselock``
permission to grant to the staff who may see other sessions' queries. ``managed = False``
and no field but the implicit id: nothing is ever created, read or written.
"""

from __future__ import annotations

from django.db import models

__all__ = ["DatabaseLock"]


class DatabaseLock(models.Model):
    """An advisory lock a database server holds or awaits (listed live, never stored)."""

    class Meta:
        managed = False
        default_permissions = ("view",)
        verbose_name = "database lock"
        verbose_name_plural = "database locks"
