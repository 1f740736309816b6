"""Every use of a private SQLAlchemy API by this library, in one place.

Each function names the SQLAlchemy versions it was checked against. When one of these
breaks on a new SQLAlchemy release, this is the file to change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from sqlalchemy.engine import Connection
from sqlalchemy.pool import StaticPool

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine
    from sqlalchemy.orm import Session
    from sqlalchemy.pool import Pool, PoolProxiedConnection

__all__ = [
    "adapter_begin_if_needed",
    "check_out_again",
    "connection_on",
    "cut_from_pool",
    "give_back_without_reset",
    "is_newest_checkout",
    "pool_entry",
    "raise_connect_error",
    "report_disconnect",
    "report_pooled_disconnect",
    "session_has_binds",
    "static_pool_checkout",
    "transaction_connections",
]


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


def raise_connect_error(engine: Engine, error: BaseException) -> NoReturn:
    """Raise what ``engine.connect()`` raises where ``engine.raw_connection()`` raised
    the driver's ``error``; called inside the ``except`` block (it reads
    ``sys.exc_info()``). The engine's ``handle_error`` hooks see it, a disconnect
    invalidates the pool, and the driver's error comes out wrapped in SQLAlchemy's
    (``OperationalError`` and the rest), its ``__cause__``: ``Connection.__init__``
    does this through ``Connection._handle_dbapi_exception_noconnection``. Checked
    against SQLAlchemy 2.0.0-2.0.44 and 2.1.0-2.1.9.
    """
    Connection._handle_dbapi_exception_noconnection(error, engine.dialect, engine)
    raise error  # pragma: no cover - the call above always raises


def adapter_begin_if_needed(adapter: Any, await_: Callable[[Any], Any]) -> None:
    """Open the transaction SQLAlchemy's asyncpg adapter believes is open.

    The adapter sends BEGIN lazily, before its own first statement. Statements sent
    straight to asyncpg would run outside the transaction SQLAlchemy thinks is open, so
    open it the way the adapter's cursor would (``AsyncAdapt_asyncpg_connection
    ._start_transaction``). Checked against SQLAlchemy 2.0.0-2.0.44 and 2.1.0b1-2.1.7.
    """
    if not adapter.autocommit and adapter._transaction is None:
        await_(adapter._start_transaction())


def check_out_again(fairy: PoolProxiedConnection) -> PoolProxiedConnection:
    """Count one more checkout of a connection that is checked out already.

    ``close()`` then gives back one checkout; the connection returns to its pool (and is
    reset) only when the last one is given back. This is what SingletonThreadPool does
    for a thread's second ``connect()`` (``_ConnectionFairy._checkout_existing``).
    Checked against SQLAlchemy 2.0.58 and 2.1.9.
    """
    again: PoolProxiedConnection = fairy._checkout_existing()
    return again


def static_pool_checkout(pool: Pool) -> PoolProxiedConnection | None:
    """The checkout that is using a StaticPool's one connection right now, if any.

    A StaticPool hands its connection to every checkout, each with its own proxy, and
    any proxy that goes back resets the connection under the others. Its one
    ``_ConnectionRecord`` is the pool's memoized ``connection`` attribute; the record's
    ``fairy_ref`` names the newest checkout. Checked against SQLAlchemy 2.0.58 and 2.1.9.
    """
    if not isinstance(pool, StaticPool):
        return None
    record = pool.__dict__.get("connection")
    reference = getattr(record, "fairy_ref", None)
    fairy = reference() if reference is not None else None
    if fairy is None or fairy.dbapi_connection is None:
        return None
    return fairy  # type: ignore[no-any-return]


def is_newest_checkout(fairy: PoolProxiedConnection) -> bool:
    """Whether ``fairy`` is its connection's newest checkout.

    Under a StaticPool a later checkout of the same connection supersedes an earlier one;
    SQLAlchemy never returns a superseded proxy to the pool (its finalizer sees that the
    record's ``fairy_ref`` names another proxy), so dropping it resets nothing. Checked
    against SQLAlchemy 2.0.58 and 2.1.9.
    """
    record = getattr(fairy, "_connection_record", None)
    reference = getattr(record, "fairy_ref", None)
    return reference is not None and reference() is fairy


def give_back_without_reset(fairy: PoolProxiedConnection) -> None:
    """Give back a checkout without the pool's reset (its rollback on return).

    ``_ConnectionFairy._close_special(transaction_reset=True)`` is what
    ``Connection.close()`` uses once it rolled back its own transaction. Only for a
    connection that another user's transaction is open on: the rollback would be theirs.
    Checked against SQLAlchemy 2.0.58 and 2.1.9.
    """
    fairy._close_special(transaction_reset=True)


def connection_on(engine: Engine, fairy: PoolProxiedConnection) -> Connection:
    """A Connection of ``engine`` on a checkout the caller already made.

    ``Connection(engine, connection=...)`` is how ``Engine.connect()`` builds one; the
    parameter is in the signature but documented only as internal use. Checked against
    SQLAlchemy 2.0.58 and 2.1.9.
    """
    connection_class: Any = engine._connection_cls
    connection: Connection = connection_class(engine, fairy)
    return connection


def session_has_binds(session: Session) -> bool:
    """Whether the Session routes some mappers or tables to binds of their own.

    SQLAlchemy 2.1 made the mapping public as ``Session.binds``; 2.0 keeps it in the
    name-mangled ``__binds``. Checked against SQLAlchemy 2.0.58 and 2.1.9.
    """
    binds = session.__dict__.get("binds", session.__dict__.get("_Session__binds"))
    return bool(binds)


def report_disconnect(connection: Any, error: Exception) -> None:
    """Let SQLAlchemy handle ``error`` as the disconnect it is, as if a statement of its own
    had raised it on ``connection`` (a ``Connection``).

    The library's statements run on the DB-API connection, below SQLAlchemy, which would
    otherwise never learn that the session is gone. ``Connection._handle_dbapi_exception``
    runs the ``handle_error`` events (which may still overrule the verdict), marks every
    pooled connection opened before this one stale (a restart leaves them all dead, and
    they are replaced at their next checkout) and invalidates this Connection. The
    verdict is set first through ``Connection._is_disconnect``, which that method reads
    before asking the dialect: the backend already recognised a lost session by its
    code. The method always raises (the wrapped error); that is the caller's to report.
    Checked against SQLAlchemy 2.0.0-2.0.44 and 2.1.0-2.1.9.
    """
    if connection.closed or connection.invalidated:
        return
    connection._is_disconnect = True
    # It always raises (the wrapped error): that is its way of reporting; ours follows.
    with contextlib.suppress(Exception):
        connection._handle_dbapi_exception(error, None, None, None, None)


def report_pooled_disconnect(engine: Any, fairy: Any, error: Exception) -> None:
    """``report_disconnect`` for a pooled connection checked out without a ``Connection``
    (``Engine.raw_connection()``).

    The ``handle_error`` events run as SQLAlchemy runs them for an error outside any
    Connection (``Connection._handle_dbapi_exception_noconnection``); then
    ``Pool._invalidate`` does what ``_handle_dbapi_exception`` does for a disconnect:
    every connection the pool opened before this one is replaced at its next checkout,
    and this one is invalidated (closed and checked in). Checked against SQLAlchemy
    2.0.0-2.0.44 and 2.1.0-2.1.9.
    """
    with contextlib.suppress(Exception):
        Connection._handle_dbapi_exception_noconnection(
            error, engine.dialect, engine, is_disconnect=True, invalidate_pool_on_disconnect=True
        )
    pool = getattr(fairy, "_pool", None) or engine.pool
    pool._invalidate(fairy, error)


def pool_entry(fairy: Any) -> Any:
    """The pool entry (``ConnectionPoolEntry``) of a checked-out connection, or None once
    it was checked in (``_ConnectionFairy._connection_record``). Checked against
    SQLAlchemy 2.0.0-2.0.44 and 2.1.0-2.1.9."""
    return getattr(fairy, "_connection_record", None)


def cut_from_pool(fairy_or_record: Any) -> None:
    """Take a DB-API connection away from SQLAlchemy's pool in this process without
    touching it: in a forked child, for a connection the parent opened.

    This is the recipe of SQLAlchemy's pooling docs for connections that crossed a fork
    (``connection_record.dbapi_connection = connection_proxy.dbapi_connection = None``):
    the pool neither resets (rolls back), nor closes, nor hands out that connection in
    this process again, and opens a fresh one in its place at the next checkout; the
    parent's socket is never written to. Given a pool entry, the connection it has
    checked out right now (``_ConnectionRecord.fairy_ref``) is cut too. Checked against
    SQLAlchemy 2.0.0-2.0.44 and 2.1.0-2.1.9.
    """
    record = getattr(fairy_or_record, "_connection_record", None)
    if record is None:
        record = fairy_or_record
        reference = getattr(record, "fairy_ref", None)
        fairy = reference() if reference is not None else None
    else:
        fairy = fairy_or_record
    if fairy is not None:
        fairy.dbapi_connection = None
    record.dbapi_connection = None
