"""asyncpg: the error of a lock on a ``Pool`` that is closed.

A lock on an asyncpg pool checks a connection out for as long as it is held. On a pool
that is closed or closing, or not initialized yet (``create_pool()`` not awaited), it
raises ``LockPoolClosed``, also asyncpg's ``InterfaceError``, with asyncpg's error as
``__cause__``. Importing this module needs asyncpg; ``advisory_lock(pool, ...)`` needs
nothing from here.
"""

from __future__ import annotations

from advisory_locks._bindings.asyncpg import LockPoolClosed

__all__ = ["LockPoolClosed"]
