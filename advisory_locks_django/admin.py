"""The admin's "Database locks" page: the advisory locks held and awaited on each database.

A page of the app's admin: staff with the ``view_databaselock`` permission (superusers
have it) see, per configured database, the same listing as ``manage.py advisory_locks
list``, and the leases held, refreshed every few seconds.

Django's admin lists an app's pages by model, and its permissions are per model, so the
page has one: ``DatabaseLock``, without a table (``managed = False``) and without a
migration (the app has none: Django creates the permission of an unmigrated app's model
at ``migrate`` all the same). It is defined here rather than in ``models.py`` so that it
exists only where the admin is installed: defining a model loads the default database's
backend, which must not happen before the app's checks can say that a MySQL driver is
missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from django.conf import settings
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db import connections, models
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils import timezone

from advisory_locks._monitoring import identify, lock_cells
from advisory_locks_django.listing import DatabaseLocks, database_locks

__all__ = ["DatabaseLock", "DatabaseLockAdmin"]

TEMPLATE: Final = "admin/advisory_locks_django/database_locks.html"
REFRESH_SECONDS: Final = 5
MAX_REFRESH_SECONDS: Final = 3600


class DatabaseLock(models.Model):
    """An advisory lock a database server holds or awaits (listed live, never stored)."""

    class Meta:
        app_label = "advisory_locks_django"
        managed = False
        default_permissions = ("view",)
        verbose_name = "database lock"
        verbose_name_plural = "database locks"


if TYPE_CHECKING:
    # django-stubs makes ModelAdmin generic; Django's own class cannot be subscripted.
    ModelAdmin = admin.ModelAdmin[DatabaseLock]
else:
    ModelAdmin = admin.ModelAdmin


@admin.register(DatabaseLock)
class DatabaseLockAdmin(ModelAdmin):
    """Lists the database servers' advisory locks; nothing to add, change or delete."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        # Only the list: there are no rows to open, and no table behind the model.
        info = self.opts.app_label, self.opts.model_name
        view = self.admin_site.admin_view(self.changelist_view)
        return [path("", view, name="{}_{}_changelist".format(*info))]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        refresh = _refresh_seconds(request)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Database locks",
            "databases": [_shown(database_locks(alias)) for alias in connections],
            "refresh": refresh,
            "listed_at": timezone.localtime() if settings.USE_TZ else timezone.now(),
            **(extra_context or {}),
        }
        return TemplateResponse(request, TEMPLATE, context)


def _refresh_seconds(request: HttpRequest) -> int:
    """``?refresh=N`` sets the interval, 0 stops it."""
    try:
        seconds = int(request.GET.get("refresh", REFRESH_SECONDS))
    except ValueError:
        return REFRESH_SECONDS
    return max(0, min(seconds, MAX_REFRESH_SECONDS))


def _shown(listing: DatabaseLocks) -> dict[str, Any]:
    """A database's listing as the template shows it: one dict of texts per lock."""
    locks = []
    for row in listing.rows:
        identity = identify(row, listing.known)
        cells = lock_cells(row, identity)
        pid, status, mode, duration, key, scheme, _, pg_locks, application, client, state = cells
        name = identity.name
        if name is None and isinstance(row.key, str):
            name = row.key  # MySQL: the server knows the lock by its GET_LOCK name
        locks.append(
            {
                "pid": pid,
                "status": status,
                "mode": mode,
                "since": duration,
                "key": key,
                "scheme": scheme,
                "pg_locks": pg_locks,
                "name": "" if name is None else _name_text(name),
                "application": application,
                "client": client,
                "state": state,
                "query": " ".join(row.query.split()),
            }
        )
    leases = [
        {
            "name": row.name,
            "holder": row.holder or "",
            "token": row.token,
            "expires_in": _seconds(row.expires_in),
            "held_for": _seconds(row.held_for),
            "expired": not row.held,
        }
        for row in listing.leases or []
    ]
    return {
        "leases": leases,
        "has_lease_table": listing.leases is not None,
        "lease_problem": listing.lease_problem,
        "alias": listing.alias,
        "vendor": listing.vendor,
        "database_name": listing.database_name,
        "problem": listing.problem,
        "locks": locks,
        "held": sum(1 for row in listing.rows if row.granted),
        "waiting": sum(1 for row in listing.rows if not row.granted),
    }


def _seconds(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    shown = f"{seconds:.1f}s" if abs(seconds) < 600 else f"{seconds / 60:.0f}min"
    return shown if seconds >= 0 else f"expired {shown[1:]} ago"


def _name_text(name: object) -> str:
    return ", ".join(map(str, name)) if isinstance(name, tuple) else str(name)
