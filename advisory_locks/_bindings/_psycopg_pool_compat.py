"""Every private psycopg_pool API the psycopg bindings use, each with the versions it was
checked against (psycopg_pool 3.2 and 3.3).

psycopg_pool has no check-in event: the one place where it runs code of the
application's on every returned connection is the ``reset`` callable given to the pool,
which it keeps as ``_reset`` and calls (awaits, on an ``AsyncConnectionPool``) once it
has rolled back an open transaction, before the connection can be handed out again. An
exception there makes the pool close the connection instead of reusing it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Final

__all__ = ["CHECKED_VERSIONS", "guard_checkin", "pool_of"]

CHECKED_VERSIONS: Final = ("3.2", "3.3")

# Marks a pool whose reset callable already runs the guard.
GUARDED_ATTRIBUTE: Final = "_advisory_locks_checkin_guard"

_guarding = threading.Lock()


def pool_of(connection: Any) -> Any:
    """The pool ``connection`` is checked out of, None for other connections.

    ``Connection._pool``: set at check-out, None once the connection is back in its pool.
    """
    return getattr(connection, "_pool", None)


def guard_checkin(pool: Any, guard: Callable[[Any, Any], Any]) -> None:
    """Make ``pool`` call ``guard(connection, reset)`` for every connection that comes
    back, where ``reset`` is the application's own reset callable (or None): the guard
    runs it (awaits it, for an async pool) after its own work. Installed once per pool.
    """
    if getattr(pool, GUARDED_ATTRIBUTE, False):
        return
    with _guarding:
        if getattr(pool, GUARDED_ATTRIBUTE, False):
            return
        reset = pool._reset

        def guarded(connection: Any) -> Any:
            return guard(connection, reset)

        pool._reset = guarded
        setattr(pool, GUARDED_ATTRIBUTE, True)
