"""Every use of a private SQLAlchemy API by this library, in one place.

Each function names the SQLAlchemy versions it was checked against. When one of these
breaks on a new SQLAlchemy release, this is the file to change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["adapter_begin_if_needed", "transaction_connections"]


def transaction_connections(transaction: Any) -> list[Any]:
    """The Connections a SessionTransaction has already checked out (without connecting).

    SQLAlchemy 2.1.7 made them public as ``SessionTransaction.connections`` (a frozenset);
    before that, ``_connections`` maps each bind to ``(connection, transaction,
    should_commit, autoclose)``. Checked against SQLAlchemy 2.0.0-2.0.44 and 2.1.0-2.1.9.
    """
    public = getattr(type(transaction), "connections", None)
    if isinstance(public, property):
        return list(transaction.connections)
    return [entry[0] for entry in transaction._connections.values()]


def adapter_begin_if_needed(adapter: Any, await_: Callable[[Any], Any]) -> None:
    """Open the transaction SQLAlchemy's asyncpg adapter believes is open.

    The adapter sends BEGIN lazily, before its own first statement. Statements sent
    straight to asyncpg would run outside the transaction SQLAlchemy thinks is open, so
    open it the way the adapter's cursor would (``AsyncAdapt_asyncpg_connection
    ._start_transaction``). Checked against SQLAlchemy 2.0.0-2.0.44 and 2.1.0b1-2.1.7.
    """
    if not adapter.autocommit and adapter._transaction is None:
        await_(adapter._start_transaction())
