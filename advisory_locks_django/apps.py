"""The Django app: registers system checks and signal receivers, and a MySQL driver.

Besides registering, the app does one thing: on a project with a MySQL/MariaDB
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
from django.core.signals import request_finished
from django.db import connections
from django.db.backends.signals import connection_created


class AdvisoryLocksConfig(AppConfig):
    name = "advisory_locks_django"
    verbose_name = "Advisory locks"

    def __init__(self, app_name: str, app_module: Any) -> None:
        super().__init__(app_name, app_module)
        from advisory_locks_django._mysql_driver import install_pymysql_if_needed

        install_pymysql_if_needed(settings.DATABASES)

    def ready(self) -> None:
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
