"""Every private psycopg2 API the psycopg2 binding uses, each with the versions it was
checked against (psycopg2 2.9).

``psycopg2.pool`` has no hook for a connection coming back: both of its pools
(``SimpleConnectionPool``, ``ThreadedConnectionPool``) return connections through
``AbstractConnectionPool._putconn(conn, key=None, close=False)``, which rolls back an
open transaction (ending no session lock) and keeps the connection for the next
``getconn()``, or closes it when ``close`` is true or the pool holds enough.
``SimpleConnectionPool`` binds that function as its ``putconn`` at class creation, so the
function is replaced wherever a pool class (or an application's subclass) refers to it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Final

__all__ = ["CHECKED_VERSIONS", "guard_pool_checkins"]

CHECKED_VERSIONS: Final = ("2.9",)

_guarding = threading.Lock()
_guarded = False


def guard_pool_checkins(guard: Callable[[Any], bool]) -> None:
    """Make every psycopg2 pool call ``guard(conn)`` on each connection it takes back, before
    it keeps it; a False answer makes the pool close that connection instead. Installed
    once per process."""
    global _guarded
    with _guarding:
        if _guarded:
            return
        from psycopg2.pool import AbstractConnectionPool

        original = AbstractConnectionPool._putconn

        def _putconn(self: Any, conn: Any, key: Any = None, close: bool = False) -> Any:
            if not close and not conn.closed and not guard(conn):
                close = True
            return original(self, conn, key, close)

        classes = [AbstractConnectionPool]
        while classes:
            pool_class = classes.pop()
            classes.extend(pool_class.__subclasses__())
            for attribute in ("_putconn", "putconn"):
                if pool_class.__dict__.get(attribute) is original:
                    setattr(pool_class, attribute, _putconn)
        _guarded = True
