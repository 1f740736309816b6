from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.backends.signals import connection_created


def use_sqlite_wal(sender: Any, connection: Any, **kwargs: Any) -> None:
    # WAL lets readers and one writer run at the same time; in SQLite's default journal
    # mode every reader blocks the writer, and concurrent buyers would mostly wait on
    # each other instead of racing. The mode is stored in the file: this is a no-op
    # after the first connection.
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")


class ShopConfig(AppConfig):
    name = "shop"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        connection_created.connect(use_sqlite_wal, dispatch_uid="shop.use_sqlite_wal")
