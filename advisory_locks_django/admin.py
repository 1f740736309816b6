"""The app's admin: the "Database locks" page, and the ``Lease`` rows.

"Database locks" (the table-less ``DatabaseLock``): staff with the ``view_databaselock``
permission (superusers have it) see, per configured database, the same listing as
``manage.py advisory_locks list`` and the leases held, refreshed every few seconds.

``Lease``: read-only, with each lease's holder, token and how long until it expires by the
database server's clock.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, cast

from django.apps import apps
from django.conf import settings
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db import connections
from django.db.models import DurationField, ExpressionWrapper, F, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils import timezone

from advisory_locks._monitoring import identify, lock_cells
from advisory_locks_django.listing import DatabaseLocks, database_locks
from advisory_locks_django.models import DatabaseLock, Lease

__all__ = ["DatabaseLockAdmin", "LeaseAdmin"]

TEMPLATE: Final = "admin/advisory_locks_django/database_locks.html"
REFRESH_SECONDS: Final = 5
MAX_REFRESH_SECONDS: Final = 3600


if TYPE_CHECKING:
    # django-stubs makes ModelAdmin generic; Django's own class cannot be subscripted.
    ModelAdmin = admin.ModelAdmin[DatabaseLock]
else:
    ModelAdmin = admin.ModelAdmin


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


class LeaseAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("name", "holder", "token", "acquired_at", "expires_in")
    search_fields = ("name", "holder")
    ordering = ("name",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Lease]:
        # The database's clock, as the library's: expires_at was written by it.
        return cast(
            "QuerySet[Lease]",
            super()
            .get_queryset(request)
            .annotate(
                expires_in_server=ExpressionWrapper(
                    F("expires_at") - Now(), output_field=DurationField()
                )
            ),
        )

    @admin.display(description="expires in", ordering="expires_at")
    def expires_in(self, lease: Any) -> str:
        if lease.holder is None:
            return "free"
        remaining: timedelta = lease.expires_in_server
        seconds = remaining.total_seconds()
        if seconds <= 0:
            return f"expired {_shown_seconds(-seconds)} ago"
        return _shown_seconds(seconds)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


if apps.is_installed("django.contrib.admin"):  # imported by hand without it: no site
    admin.site.register(DatabaseLock, DatabaseLockAdmin)
    admin.site.register(Lease, LeaseAdmin)


def _shown_seconds(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 600 else f"{seconds / 60:.0f}min"
