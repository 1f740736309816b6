"""psycopg2 connections as binds (blocking). psycopg2's own pools hand out these
connections; pass the connection. A session lock still held on a connection given back to
a ``psycopg2.pool`` pool is unlocked on its way in (``_psycopg2_compat``)."""

from __future__ import annotations

from typing import Any

from psycopg2.extensions import connection as Psycopg2Connection

from advisory_locks._bindings._psycopg2_compat import guard_pool_checkins
from advisory_locks._bindings._raw import (
    RawBinding,
    RawDriver,
    holds_at_checkin,
    release_at_checkin,
)
from advisory_locks._bindings.raw_lease import LeaseDriver
from advisory_locks._core.dispatch import register_binding
from advisory_locks._core.steps import run_steps
from advisory_locks.errors import UnsupportedDatabase

__all__ = ["Psycopg2Driver"]


class Psycopg2Driver(RawDriver):
    """psycopg2's connections; libpq tells the transaction status."""

    name = "psycopg2"

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

    def refuse(self, connection: Any) -> None:
        if connection.async_:
            # execute() returns before the server answers, and the caller polls: a lock
            # statement would be read before its answer came.
            raise UnsupportedDatabase(
                "psycopg2's asynchronous connections (async_=True) cannot hold advisory "
                "locks: the library reads each lock statement's answer before returning. "
                "Use a blocking psycopg2 connection, "
                "or psycopg 3's AsyncConnection or asyncpg for asyncio"
            )


_DRIVER = Psycopg2Driver()


def _checked_in(connection: Any) -> bool:
    """Unlock what a connection given back to a psycopg2 pool still holds (see
    ``release_at_checkin``); False when that failed, and the pool must close it."""
    try:
        if holds_at_checkin(_DRIVER, connection):
            run_steps(release_at_checkin(_DRIVER, connection))
    except Exception:
        return False
    return True


guard_pool_checkins(_checked_in)
register_binding(
    [Psycopg2Connection],
    RawBinding(_DRIVER, lease=LeaseDriver(_DRIVER, "postgresql", notifies=True)),
)
