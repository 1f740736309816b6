"""Every private asyncpg API the asyncpg binding uses, each with the versions it was
checked against (asyncpg 0.29, 0.30, 0.31 and 0.32).

asyncpg's pool hands out ``PoolConnectionProxy`` objects and runs ``Connection.reset()``
(which includes ``pg_advisory_unlock_all()``) when one comes back; nothing public tells
that a connection went back, or which connection a proxy stands for. Nor does anything
but its message tell a busy connection's refusal from a closed one's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

from asyncpg.connection import Connection
from asyncpg.exceptions import InterfaceError
from asyncpg.pool import Pool, PoolConnectionProxy

__all__ = [
    "CHECKED_VERSIONS",
    "busy_refusal",
    "guard_own_reset",
    "missing_private_apis",
    "new_pool_connection",
    "physical_connection",
    "pool_initialized",
    "pool_of",
    "pool_of_connection",
    "release_count",
    "socket_of",
]

CHECKED_VERSIONS: Final = ("0.29", "0.30", "0.31", "0.32")


def physical_connection(bind: Any) -> Any:
    """The ``Connection`` a pool proxy stands for (None once released), or ``bind``.

    ``PoolConnectionProxy._con``: set at ``pool.acquire()``, None after release.
    """
    if isinstance(bind, PoolConnectionProxy):
        return bind._con
    return bind


def socket_of(connection: Any) -> int | None:
    """The file descriptor of the connection's socket (None: closed, or not a socket).

    ``Connection._transport``: the asyncio transport it talks to the server on, whose
    ``get_extra_info("socket")`` is the socket.
    """
    transport = getattr(connection, "_transport", None)
    sock = None if transport is None else transport.get_extra_info("socket")
    return None if sock is None else int(sock.fileno())


def release_count(connection: Any) -> int:
    """How many times the connection went back to its pool.

    ``Connection._pool_release_ctr``: ``Pool.release()`` increments it (through
    ``Connection._on_release()``) before the pool resets the session.
    """
    count: int = connection._pool_release_ctr
    return count


# asyncpg's words when a connection refuses an operation, before sending anything,
# because another one (another task's) is still running on it: InterfaceError, the class
# it also raises for a closed connection (protocol.pyx and connection.py).
_BUSY: Final = "another operation is in progress"


def busy_refusal(error: BaseException, connection: Any) -> bool:
    """Whether ``error`` is an open connection refusing an operation while another runs."""
    return isinstance(error, InterfaceError) and _BUSY in str(error) and not connection.is_closed()


def pool_of(bind: Any) -> Any:
    """The pool a proxy was checked out of (``PoolConnectionProxy._holder._pool``)."""
    if isinstance(bind, PoolConnectionProxy):
        holder = bind._holder
        return getattr(holder, "_pool", None)
    return None


def pool_of_connection(connection: Any) -> Any:
    """The pool a checked-out ``Connection`` belongs to, else None.

    ``Connection._proxy``: the proxy its pool sets at check-out and clears at release.
    """
    proxy = getattr(connection, "_proxy", None)
    return None if proxy is None else pool_of(proxy)


# Marks the reset callable that already runs the guard.
_GUARD_MARK: Final = "_advisory_locks_checkin_guard"


def guard_own_reset(pool: Any, guard: Callable[[Any, Any], Awaitable[None]]) -> None:
    """Where ``pool`` was made with a ``reset=`` of the application's, make it await
    ``guard(connection, reset)`` instead, which awaits ``reset`` after its own work;
    installed once per pool.

    ``Pool._reset``: the callable given as ``reset=`` (asyncpg >= 0.30), which the pool
    awaits in place of ``Connection.reset()``, and so of its ``pg_advisory_unlock_all()``,
    for every connection that comes back. Without one, nothing is needed.
    """
    reset = getattr(pool, "_reset", None)
    if reset is None or getattr(reset, _GUARD_MARK, False):
        return

    async def guarded(connection: Any) -> None:
        await guard(connection, reset)

    setattr(guarded, _GUARD_MARK, True)
    pool._reset = guarded


async def new_pool_connection(pool: Any) -> Any:
    """A new connection made the way ``pool`` makes its own (same connect arguments,
    ``connect=`` callback, ``init``), not taken from it and never returned to it.

    ``Pool._get_new_connection()``: asyncpg has no public way to read a pool's connect
    arguments.
    """
    return await pool._get_new_connection()


def pool_initialized(pool: Any) -> bool:
    """Whether ``await pool`` (or ``await create_pool()``) has finished.

    ``Pool._initialized``: set at the end of ``Pool._async__init__``; ``Pool.acquire()``
    raises ``InterfaceError`` until then.
    """
    return bool(getattr(pool, "_initialized", True))


def missing_private_apis() -> list[str]:
    """The private names above that this asyncpg does not have (tested empty)."""
    missing = []
    if "_con" not in getattr(PoolConnectionProxy, "__slots__", ()):
        missing.append("PoolConnectionProxy._con")
    if "_holder" not in getattr(PoolConnectionProxy, "__slots__", ()):
        missing.append("PoolConnectionProxy._holder")
    if not callable(getattr(Pool, "_get_new_connection", None)):
        missing.append("Pool._get_new_connection")
    if "_pool_release_ctr" not in getattr(Connection, "__slots__", ()):
        missing.append("Connection._pool_release_ctr")
    if "_proxy" not in getattr(Connection, "__slots__", ()):
        missing.append("Connection._proxy")
    if "_transport" not in getattr(Connection, "__slots__", ()):
        missing.append("Connection._transport")
    if "_initialized" not in getattr(Pool, "__slots__", ()):
        missing.append("Pool._initialized")
    return missing
