"""psycopg 3 ``Connection`` and ``psycopg_pool.ConnectionPool`` as binds (blocking).

The asyncio ones (``AsyncConnection``, ``AsyncConnectionPool``) are in ``psycopg_async``.
What a raw bind means (transactions, pools, poolers) is in ``_raw``.
"""

from __future__ import annotations

from typing import Any

from psycopg import Connection

from advisory_locks._bindings._raw import RawBinding, RawDriver
from advisory_locks._core.dispatch import register_binding

__all__ = ["PsycopgDriver", "pool_of"]

OPEN_TRANSACTION = (
    "open one with `with conn.transaction():`, or use a connection that is not in "
    "autocommit mode (its first statement begins a transaction)"
)


def pool_of(connection: Any) -> Any:
    # psycopg_pool records the pool on a connection while it is checked out (checked
    # with psycopg_pool 3.1 to 3.3); None for other connections.
    return getattr(connection, "_pool", None)


class PsycopgDriver(RawDriver):
    """psycopg 3's blocking connections; libpq tells the transaction status."""

    open_transaction = OPEN_TRANSACTION

    def is_closed(self, connection: Any) -> bool:
        return bool(connection.closed)

    def status(self, connection: Any) -> int:
        return int(connection.pgconn.transaction_status)

    def autocommit(self, connection: Any) -> bool:
        return bool(connection.autocommit)

    def set_autocommit(self, connection: Any, value: bool) -> None:
        connection.autocommit = value

    def pool_of(self, connection: Any) -> Any:
        return pool_of(connection)

    def checkout(self, pool: Any) -> Any:
        return pool.getconn()

    def checkin(self, pool: Any, bind: Any) -> None:
        # A closed connection is replaced by the pool.
        pool.putconn(bind)


def _register() -> None:
    types: list[type] = [Connection]
    try:
        from psycopg_pool import ConnectionPool
    except ImportError:  # psycopg_pool is optional
        pool_types: tuple[type, ...] = ()
    else:
        pool_types = (ConnectionPool,)
        types.append(ConnectionPool)
    register_binding(
        types,
        RawBinding(PsycopgDriver(), is_pool=lambda bind: isinstance(bind, pool_types)),
    )


_register()
