"""The ``Lease`` model in the admin: read-only, with each lease's holder, token and how
long until it expires by the database server's clock."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

from django.apps import apps
from django.contrib import admin
from django.db.models import DurationField, ExpressionWrapper, F, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest

from advisory_locks_django.models import Lease


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
            return f"expired {_shown(-seconds)} ago"
        return _shown(seconds)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


if apps.is_installed("django.contrib.admin"):  # imported by hand without it: no site
    admin.site.register(Lease, LeaseAdmin)


def _shown(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 600 else f"{seconds / 60:.0f}min"
