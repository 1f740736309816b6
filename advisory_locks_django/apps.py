"""The Django app: registers system checks, signal receivers and the close hook (its admin
page is registered by Django's admin autodiscovery, from ``admin.py``).

Besides that, the app does one thing: on a project with a MySQL/MariaDB
database, no mysqlclient and PyMySQL installed (the ``mysql`` extra), it registers
PyMySQL as ``MySQLdb`` for Django's MySQL backend (``advisory_locks_django._mysql_driver``).
That happens when Django creates the app config, not in ``ready()``: defining any model
class loads the default database's backend (for its maximum name length), and model
modules are imported after every app config is created but before any ``ready()``.
"""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core import checks
from django.core.signals import request_finished, request_started
from django.db.backends.signals import connection_created


class AdvisoryLocksConfig(AppConfig):
    name = "advisory_locks_django"
    verbose_name = "Advisory locks"
    # Pinned, so that a project's DEFAULT_AUTO_FIELD never changes the table-less
    # DatabaseLock model of the admin page.
    default_auto_field = "django.db.models.AutoField"

    def __init__(self, app_name: str, app_module: Any) -> None:
        super().__init__(app_name, app_module)
        from advisory_locks_django._mysql_driver import install_pymysql_if_needed

        install_pymysql_if_needed(settings.DATABASES)

    def ready(self) -> None:
        """Register the checks, the signal receivers, and the two private-API hooks.

        Django sends no signal when it closes a connection or gives it back to its pool,
        and a connection must never go back holding a lock this library took, so
        ``BaseDatabaseWrapper.close`` is wrapped once (see ``_compat.install_close_hook``
        for why there, and the Django versions it was checked against). Nor does it
        track the savepoints of ``transaction.savepoint()``, whose rollback releases the
        transaction locks taken since, so ``BaseDatabaseWrapper.savepoint_rollback`` is
        wrapped once too (``_compat.install_savepoint_rollback_hook``).
        """
        from advisory_locks_django._binding import connection_closing, savepoint_rolled_back
        from advisory_locks_django._compat import (
            install_close_hook,
            install_savepoint_rollback_hook,
        )
        from advisory_locks_django.checks import (
            check_databases,
            check_mysql_driver,
            check_settings,
            check_sqlite_files,
        )

        checks.register(check_settings)
        checks.register(check_databases)
        checks.register(check_mysql_driver)
        checks.register(check_sqlite_files)
        install_close_hook(connection_closing)
        install_savepoint_rollback_hook(savepoint_rolled_back)
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
