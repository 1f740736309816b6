"""psycopg 3 ``Connection`` and ``psycopg_pool.ConnectionPool`` as binds (blocking).

The asyncio ones (``AsyncConnection``, ``AsyncConnectionPool``) are in ``psycopg_async``.
What a raw bind means (transactions, pools, poolers) is in ``_raw``.
"""

from __future__ import annotations

from typing import Any

from psycopg import Connection

from advisory_locks._bindings import _psycopg_pool_compat
from advisory_locks._bindings._psycopg_pool_compat import pool_of
from advisory_locks._bindings._raw import RawBinding, RawDriver, release_at_checkin
from advisory_locks._bindings.raw_lease import LeaseDriver
from advisory_locks._core.dispatch import register_binding
from advisory_locks._core.steps import run_steps

__all__ = ["PsycopgDriver"]

OPEN_TRANSACTION = (
    "open one with `with conn.transaction():`, or use a connection that is not in "
    "autocommit mode (its first statement begins a transaction)"
)


class PsycopgDriver(RawDriver):
    """psycopg 3's blocking connections; libpq tells the transaction status."""

    name = "psycopg"

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

    def guard_checkin(self, connection: Any) -> None:
        pool = pool_of(connection)
        if pool is not None:
            _psycopg_pool_compat.guard_checkin(pool, self._checked_in)

    def _checked_in(self, connection: Any, reset: Any) -> None:
        run_steps(release_at_checkin(self, connection))
        if reset is not None:
            reset(connection)


def _register() -> None:
    types: list[type] = [Connection]
    try:
        from psycopg_pool import ConnectionPool
    except ImportError:  # psycopg_pool is optional
        pool_types: tuple[type, ...] = ()
    else:
        pool_types = (ConnectionPool,)
        types.append(ConnectionPool)

    def is_pool(bind: object) -> bool:
        return isinstance(bind, pool_types)

    driver = PsycopgDriver()
    lease = LeaseDriver(driver, "postgresql", is_pool=is_pool, open_like=_open_like, notifies=True)
    register_binding(types, RawBinding(driver, is_pool=is_pool, lease=lease))


def _open_like(pool: Any) -> Any:
    """A connection made the way ``pool`` makes its own (psycopg_pool's public
    ``connection_class``, ``conninfo`` and ``kwargs``), in autocommit."""
    return pool.connection_class.connect(
        pool.conninfo, **{**(pool.kwargs or {}), "autocommit": True}
    )


_register()
