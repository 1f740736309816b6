"""psycopg2 connections as binds (blocking). psycopg2's own pools hand out these
connections; pass the connection."""

from __future__ import annotations

from typing import Any

from psycopg2.extensions import connection as Psycopg2Connection

from advisory_locks._bindings._raw import RawBinding, RawDriver
from advisory_locks._core.dispatch import register_binding

__all__ = ["Psycopg2Driver"]


class Psycopg2Driver(RawDriver):
    """psycopg2's connections; libpq tells the transaction status."""

    open_transaction = (
        "use a connection that is not in autocommit mode (its first statement begins a "
        "transaction), or `with conn:` blocks on one"
    )

    def is_closed(self, connection: Any) -> bool:
        return bool(connection.closed)

    def status(self, connection: Any) -> int:
        return int(connection.get_transaction_status())

    def autocommit(self, connection: Any) -> bool:
        return bool(connection.autocommit)

    def set_autocommit(self, connection: Any, value: bool) -> None:
        connection.autocommit = value


register_binding([Psycopg2Connection], RawBinding(Psycopg2Driver()))
