"""Which kind of lock makes "read, decide, write" safe on the shop's database.

The lock must be released only after the transaction that wrote the data has committed;
released earlier, the next holder could read the stock before this write is visible.

- PostgreSQL has transaction locks (``pg_advisory_xact_lock``): the server releases them
  at COMMIT or ROLLBACK, so ``transaction=True`` is exactly right, and cannot leak.
- MySQL/MariaDB (``GET_LOCK``) and SQLite (OS file locks) have no lock that the commit
  releases; advisory-locks refuses ``transaction=True`` there (``UnsupportedFeature``)
  rather than pretend. The equivalent is a session lock taken *before* the transaction
  begins and released *after* it commits: ``with lock: ... with transaction.atomic():``.

The shop's code is written in that second shape (the lock outside, ``atomic()`` inside),
which is correct in both modes: on PostgreSQL the lock's own transaction wraps the block
and the inner ``atomic()`` becomes a savepoint in it.
"""

from __future__ import annotations

from django.db import connections, router

from shop.models import Product

__all__ = ["has_transaction_locks", "shop_database"]


def shop_database() -> str:
    """The database alias the shop writes to (``default`` unless a router says otherwise)."""
    return router.db_for_write(Product)


def has_transaction_locks(using: str) -> bool:
    """Whether ``transaction=True`` locks exist on this database (PostgreSQL only)."""
    return connections[using].vendor == "postgresql"
