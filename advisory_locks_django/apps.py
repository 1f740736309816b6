"""The Django app: registers system checks, signal receivers and the close hook."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core import checks
from django.core.signals import request_finished, request_started
from django.db.backends.signals import connection_created


class AdvisoryLocksConfig(AppConfig):
    name = "advisory_locks_django"
    verbose_name = "Advisory locks"

    def ready(self) -> None:
        """Register the checks, the signal receivers, and the one private-API hook.

        Django sends no signal when it closes a connection or gives it back to its pool,
        and a connection must never go back holding a lock this library took, so
        ``BaseDatabaseWrapper.close`` is wrapped once (see ``_compat.install_close_hook``
        for why there, and the Django versions it was checked against).
        """
        from advisory_locks_django._binding import connection_closing
        from advisory_locks_django._compat import install_close_hook
        from advisory_locks_django.checks import check_databases, check_settings

        checks.register(check_settings)
        checks.register(check_databases)
        install_close_hook(connection_closing)
        connection_created.connect(_connection_created, dispatch_uid="advisory_locks_django")
        request_started.connect(_request_started, dispatch_uid="advisory_locks_django")
        request_finished.connect(_request_finished, dispatch_uid="advisory_locks_django")


def _connection_created(sender: Any, connection: Any, **kwargs: Any) -> None:
    # A new DB-API connection holds nothing: drop (and report) what the old one held.
    from advisory_locks_django._binding import REGISTRY_ATTRIBUTE, connection_locks

    if REGISTRY_ATTRIBUTE in connection.__dict__:
        connection_locks(connection)


def _request_started(sender: Any, **kwargs: Any) -> None:
    from advisory_locks_django._binding import request_started as started

    started()


def _request_finished(sender: Any, **kwargs: Any) -> None:
    # Runs after Django's own close_old_connections(): unlock what the request left held
    # on connections that stay open, report what rollbacks and closed connections
    # released, and finish unlocks a failed transaction postponed.
    from advisory_locks_django._binding import request_finished as finished

    finished()
