"""The Django app: registers system checks and signal receivers, nothing else (its admin
page is registered by Django's admin autodiscovery, from ``admin.py``)."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core import checks
from django.core.signals import request_finished
from django.db import connections
from django.db.backends.signals import connection_created


class AdvisoryLocksConfig(AppConfig):
    name = "advisory_locks_django"
    verbose_name = "Advisory locks"
    # Pinned, so that a project's DEFAULT_AUTO_FIELD never asks for a migration of the
    # table-less DatabaseLock model.
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        from advisory_locks_django.checks import check_databases, check_settings

        checks.register(check_settings)
        checks.register(check_databases)
        connection_created.connect(_connection_created, dispatch_uid="advisory_locks_django")
        request_finished.connect(_request_finished, dispatch_uid="advisory_locks_django")


def _connection_created(sender: Any, connection: Any, **kwargs: Any) -> None:
    # A new DB-API connection holds nothing: drop (and report) what the old one held.
    from advisory_locks_django._binding import REGISTRY_ATTRIBUTE, connection_locks

    if REGISTRY_ATTRIBUTE in connection.__dict__:
        connection_locks(connection)


def _request_finished(sender: Any, **kwargs: Any) -> None:
    # Runs after Django's own close_old_connections(): report what rollbacks and closed
    # connections released, and finish unlocks a failed transaction postponed.
    from advisory_locks_django._binding import observe_connection

    for connection in connections.all(initialized_only=True):
        observe_connection(connection)
