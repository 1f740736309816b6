"""psycopg_pool: the errors of a lock on a ``ConnectionPool`` or ``AsyncConnectionPool``.

A lock on a pool checks a connection out for as long as it is held. When the pool lends
none, the lock raises one of these, each also the pool's own exception class (so a
handler for either catches it), with the pool's error as ``__cause__``. Importing this
module needs psycopg_pool; ``advisory_lock(pool, ...)`` needs nothing from here.
"""

from __future__ import annotations

from advisory_locks._bindings.psycopg_pool import LockConnectionTimeout, LockPoolClosed

__all__ = ["LockConnectionTimeout", "LockPoolClosed"]
