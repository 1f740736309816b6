"""PostgreSQL advisory locks: every piece of PostgreSQL SQL the library sends.

Keys are computed client-side (``hashtext()`` is internal to PostgreSQL and changed across
versions) and sent as integer literals or parameters; lock names never reach the server.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Hashable
from functools import cache, lru_cache
from typing import Any, Final, TypeVar

from advisory_locks._core.contract import Timeout
from advisory_locks._core.executors import protocol_session_id
from advisory_locks._core.steps import ROWS, SCRIPT, VALUE, Statement
from advisory_locks._dialects.base import SERVER_SESSION_STATE, LockedRow, StatementSteps
from advisory_locks.errors import (
    AdvisoryLockError,
    LockDeadlock,
    LockTimeout,
    UnsupportedDatabase,
)
from advisory_locks.keys import LockKey

__all__ = ["PostgresBackend"]

T = TypeVar("T")

# lock_timeout is an int GUC in milliseconds; 0 would mean "wait forever".
MAX_TIMEOUT_MS: Final = 2**31 - 1

LOCK_NOT_AVAILABLE: Final = "55P03"
DEADLOCK_DETECTED: Final = "40P01"
QUERY_CANCELED: Final = "57014"
OUT_OF_SHARED_MEMORY: Final = "53200"
IN_FAILED_TRANSACTION: Final = "25P02"
# SQLSTATEs after which the server has ended (or never began) the session, besides class
# 08 (connection exception): admin_shutdown (pg_terminate_backend, fast shutdown),
# crash_shutdown, cannot_connect_now (starting up, recovering), database_dropped,
# idle_session_timeout (PostgreSQL 14+), idle_in_transaction_session_timeout, and
# transaction_timeout (PostgreSQL 17+ ends the session too).
CONNECTION_GONE: Final = frozenset({"57P01", "57P02", "57P03", "57P04", "57P05", "25P03", "25P04"})
CONNECTION_FAILURE_CLASSES: Final = frozenset(
    {"OperationalError", "InterfaceError", "ConnectionDoesNotExistError", "InternalClientError"}
)

SAVEPOINT: Final = "advisory_locks_acquire"
TIMEOUT_LOCK_SQL: Final = (
    "SELECT pg_{}({}) FROM (SELECT pg_catalog.set_config('lock_timeout', %s, true)) AS timeout"
)
SAVED_TIMEOUT_SETTING: Final = "advisory_locks.saved_lock_timeout"

# pg_locks does not say when a lock was granted. The holder's connection start bounds it
# from above; its transaction start does not: a session lock outlives the transaction
# that took it, and a later BEGIN moves xact_start past the grant.
LIST_LOCKS_SQL: Final = """
SELECT l.pid, l.classid::int8, l.objid::int8, l.objsubid::int4, l.mode, l.granted,
       EXTRACT(EPOCH FROM now() - l.waitstart)::float8,
       EXTRACT(EPOCH FROM now() - a.backend_start)::float8,
       COALESCE(a.application_name, ''), host(a.client_addr), a.state,
       COALESCE(a.query, '')
FROM pg_catalog.pg_locks AS l
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
ORDER BY l.classid, l.objid, l.objsubid, l.granted DESC, l.waitstart NULLS FIRST, l.pid
"""

# pg_locks cannot tell a session lock from a transaction lock of the same key and mode;
# either one means the lock is still ours. Keys are compared as the oid columns hold them.
IS_HELD_SQL: Final = """
SELECT EXISTS (
  SELECT 1 FROM pg_catalog.pg_locks
  WHERE locktype = 'advisory' AND pid = pg_catalog.pg_backend_pid() AND granted
    AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
    AND classid::int8 = %s AND objid::int8 = %s AND objsubid::int4 = %s AND mode = '{mode}'
)
"""

# version() comes first: servers that speak the PostgreSQL protocol but stub advisory
# locks (CockroachDB answers pg_advisory_lock() without locking anything) say who they are.
INSPECT_SERVER_SQL: Final = (
    "SELECT pg_catalog.version(), pg_catalog.pg_backend_pid(), pg_catalog.pg_is_in_recovery()"
)
# Only products known to stub the functions: refusing a working server would be worse.
IMITATIONS: Final = ("CockroachDB",)

# Errors after which the backend may hold the lock anyway (see _give_back_late_grant).
GRANT_MAY_SURVIVE: Final = frozenset({LOCK_NOT_AVAILABLE, QUERY_CANCELED})
RELEASE_LATE_GRANT_SQL: Final = """
SELECT pg_catalog.pg_{function}({placeholders}) FROM pg_catalog.pg_locks
WHERE locktype = 'advisory' AND pid = pg_catalog.pg_backend_pid() AND granted
  AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
  AND classid::int8 = %s AND objid::int8 = %s AND objsubid::int4 = %s AND mode = '{mode}'
"""


class PostgresBackend:
    """Session and transaction advisory locks, exclusive or shared, server-side waits."""

    dialect_name = "postgresql"
    locks_on_server = True
    locks_by_ints = True

    def system_name(self, state: dict[str, Any]) -> str:
        return "postgresql"

    def check_options(self, *, shared: bool, transaction: bool, timeout: Timeout) -> None:
        # Compared before rounding: a huge finite timeout's milliseconds overflow a float.
        if timeout is not None and timeout * 1000 > MAX_TIMEOUT_MS:
            raise ValueError(
                f"timeout {timeout} s exceeds PostgreSQL's lock_timeout limit of "
                f"{MAX_TIMEOUT_MS / 1000:.0f} s; pass timeout=None to wait without limit"
            )

    def acquire(
        self,
        state: dict[str, Any],
        key: LockKey,
        *,
        shared: bool,
        transaction: bool,
        timeout: Timeout,
        in_transaction: bool,
    ) -> StatementSteps[bool]:
        # The statement outside a transaction block, and for the try_ variants anywhere.
        statement = self.lock_statement(
            key,
            shared=shared,
            transaction=transaction,
            timeout=timeout,
            in_transaction=in_transaction,
        )
        if timeout == 0:
            # The try_ variants never wait and never raise for a busy lock, so there is
            # nothing to protect the caller's transaction from.
            assert statement is not None
            granted = yield statement
            return bool(granted)
        try:
            if statement is None:
                function = _LOCK_FUNCTIONS[shared, transaction]
                call = f"SELECT pg_{function}({_literals(key)})"
                yield Statement(SCRIPT, _acquire_in_transaction_script(call, timeout))
            else:
                yield statement
        except Exception as error:
            if in_transaction and not self.is_connection_failure(error):
                # The failed wait aborted the caller's transaction; rolling back to our
                # savepoint makes it usable again and also undoes our SET LOCAL.
                yield Statement(
                    SCRIPT, f"ROLLBACK TO SAVEPOINT {SAVEPOINT}; RELEASE SAVEPOINT {SAVEPOINT}"
                )
            if not transaction and sqlstate_of(error) in GRANT_MAY_SURVIVE:
                yield _give_back_late_grant(key, shared=shared)
            return _granted_or_raise(error, key, timeout)
        return True

    def lock_statement(
        self,
        key: LockKey,
        *,
        shared: bool,
        transaction: bool,
        timeout: Timeout,
        in_transaction: bool,
    ) -> Statement | None:
        if in_transaction and timeout != 0:
            return None  # a savepoint around the wait: a script, and its own rollback
        made = (key.ints, shared, transaction, timeout)
        statement = _lock_statements.get(made)
        if statement is None:
            statement = _lock_statement(key.ints, shared, transaction, timeout)
            _remember(_lock_statements, made, statement)
        return statement

    def lock_statements(
        self,
        key: LockKey,
        shared: bool,
        transaction: bool,
        timeout: Timeout,
        in_transaction: bool,
    ) -> tuple[Statement | None, Statement | None]:
        # lock_statement() answers None inside a transaction unless timeout=0.
        made = (key.ints, shared, transaction, timeout, in_transaction and timeout != 0)
        statements = _statement_pairs.get(made)
        if statements is None:
            statements = (
                self.lock_statement(
                    key,
                    shared=shared,
                    transaction=transaction,
                    timeout=timeout,
                    in_transaction=in_transaction,
                ),
                None if transaction else self.unlock_statement(key, shared=shared),
            )
            _remember(_statement_pairs, made, statements)
        return statements

    def lock_identity(self, key: LockKey) -> Hashable:
        return key.ints

    def release(self, state: dict[str, Any], key: LockKey, *, shared: bool) -> StatementSteps[bool]:
        released = yield self.unlock_statement(key, shared=shared)
        return bool(released)

    def unlock_statement(self, key: LockKey, *, shared: bool) -> Statement:
        made = (key.ints, shared)
        statement = _unlock_statements.get(made)
        if statement is None:
            function = "advisory_unlock_shared" if shared else "advisory_unlock"
            statement = Statement(
                VALUE, _statement_for("SELECT pg_{}({})", function, len(key.ints)), key.ints
            )
            _remember(_unlock_statements, made, statement)
        return statement

    def is_held(self, state: dict[str, Any], key: LockKey, *, shared: bool) -> StatementSteps[bool]:
        # The mode is one of two constants, never caller text.
        sql = IS_HELD_SQL.format(mode="ShareLock" if shared else "ExclusiveLock")
        held = yield Statement(VALUE, sql, key.pg_locks_ids())
        return bool(held)

    def inspect_server(self, state: dict[str, Any]) -> StatementSteps[int]:
        rows = yield Statement(ROWS, INSPECT_SERVER_SQL)
        version, pid, in_recovery = rows[0]
        for product in IMITATIONS:
            if product.lower() in str(version).lower():
                raise UnsupportedDatabase(
                    f"{product} speaks PostgreSQL's protocol but does not implement "
                    f"advisory locks (its pg_advisory_lock() excludes nothing): {version}"
                )
        if in_recovery:
            warnings.warn(
                "advisory locks taken on a hot standby exclude only other clients of that "
                "standby, never the primary or other replicas; take them on the primary",
                RuntimeWarning,
                stacklevel=2,
            )
        if not isinstance(pid, int):
            raise UnsupportedDatabase(f"pg_backend_pid() returned {pid!r}, not a process id")
        return pid

    def list_locks(self, state: dict[str, Any]) -> StatementSteps[list[LockedRow]]:
        found = yield Statement(ROWS, LIST_LOCKS_SQL)
        rows = []
        for (
            pid,
            classid,
            objid,
            objsubid,
            mode,
            granted,
            waiting,
            age,
            application,
            client,
            state,
            query,
        ) in found:
            rows.append(
                LockedRow(
                    pid=int(pid),
                    key=_key_from_pg_locks(int(classid), int(objid), int(objsubid)),
                    mode="shared" if mode == "ShareLock" else "exclusive",
                    granted=bool(granted),
                    waiting_seconds=None if granted else _seconds(waiting),
                    held_at_most_seconds=_seconds(age) if granted else None,
                    application_name=str(application),
                    client_addr=None if client is None else str(client),
                    state=None if state is None else str(state),
                    query=str(query),
                )
            )
        return rows

    def cancel_wait(self, state: dict[str, Any], driver_connection: Any) -> StatementSteps[None]:
        # The protocol's cancel request (a separate short connection libpq opens with the
        # session's secret key): it reaches the right backend through a session pooler
        # too. The wait fails with 57014, which acquire() turns into LockTimeout after
        # giving back a grant made in the same instant.
        cancel = getattr(driver_connection, "cancel_safe", None)  # psycopg >= 3.2
        if not callable(cancel) or inspect.iscoroutinefunction(cancel):
            cancel = getattr(driver_connection, "cancel", None)  # psycopg2, older psycopg
        if callable(cancel) and not inspect.iscoroutinefunction(cancel):
            cancel()
            return
        # Drivers without a blocking cancel call: ask the server from another connection.
        backend_pid = state.get(SERVER_SESSION_STATE) or protocol_session_id(driver_connection)
        if backend_pid is None:
            raise UnsupportedDatabase(
                f"cannot tell which server session {type(driver_connection).__name__} "
                "waits in, so its wait cannot be cancelled"
            )
        yield Statement(VALUE, "SELECT pg_catalog.pg_cancel_backend(%s)", (backend_pid,))

    def is_connection_failure(self, error: BaseException) -> bool:
        code = sqlstate_of(error)
        if code is not None:
            return code.startswith("08") or code in CONNECTION_GONE
        # Drivers report a socket that closed under them without any SQLSTATE: psycopg 3
        # and psycopg2 as OperationalError (psycopg2 also InterfaceError, "connection
        # already closed"), asyncpg as InterfaceError ("connection is closed", or released
        # back to its pool), ConnectionDoesNotExistError (08003, caught above) or a bare
        # ConnectionResetError from its transport. asyncpg's InternalClientError says its
        # protocol is out of step with the server ("cannot switch to state ...": the
        # server's last words arrived between operations): like MySQL's "commands out of
        # sync", no statement can run on that connection again. A binding may have
        # wrapped it (SQLAlchemy's DBAPIError keeps it in ``orig``, the raw bindings raise
        # a typed error from it).
        return any(
            isinstance(seen, ConnectionError)
            or bool({cls.__name__ for cls in type(seen).__mro__} & CONNECTION_FAILURE_CLASSES)
            for seen in _error_chain(error)
        )

    def is_failed_transaction(self, error: BaseException) -> bool:
        return sqlstate_of(error) == IN_FAILED_TRANSACTION


def sqlstate_of(error: BaseException) -> str | None:
    """The SQLSTATE of a driver error, looking through SQLAlchemy/adapter wrappers."""
    for seen in _error_chain(error):
        for attribute in ("sqlstate", "pgcode"):
            code = getattr(seen, attribute, None)
            if isinstance(code, str) and code:
                return code
    return None


def _error_chain(error: BaseException) -> list[BaseException]:
    """``error`` and what it wraps (``orig`` of SQLAlchemy's errors, ``__cause__``)."""
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and len(chain) < 4:
        chain.append(seen)
        seen = getattr(seen, "orig", None) or seen.__cause__
    return chain


def _give_back_late_grant(key: LockKey, *, shared: bool) -> Statement:
    # PostgreSQL can grant the lock in the instant lock_timeout (or a cancel) fires:
    # the statement fails, yet the backend keeps the lock (LockErrorCleanup records
    # the grant). A transaction lock ends with the failed (sub)transaction; a session
    # lock would stay with a connection whose caller was told it did not get it, and
    # go back to the pool with it. This library records no hold of this key on this
    # connection (else it would not have asked the server), so any hold is that grant.
    # One more round trip, only after a wait that failed.
    sql = RELEASE_LATE_GRANT_SQL.format(
        function="advisory_unlock_shared" if shared else "advisory_unlock",
        placeholders=", ".join(["%s"] * len(key.ints)),
        mode="ShareLock" if shared else "ExclusiveLock",
    )
    return Statement(VALUE, sql, [*key.ints, *key.pg_locks_ids()])


def _granted_or_raise(error: Exception, key: LockKey, timeout: Timeout) -> bool:
    code = sqlstate_of(error)
    if code == LOCK_NOT_AVAILABLE:
        if timeout is None:
            # Not our limit: the caller's lock_timeout (connection, role or database)
            # bounds a wait without a timeout, as its statement_timeout does. acquire()
            # without a timeout never answers False, which a caller need not look at.
            raise LockTimeout(
                f"waiting for advisory lock {key.name!r} was ended by the connection's "
                "lock_timeout",
                name=key.name,
            ) from error
        return False
    if code == DEADLOCK_DETECTED:
        raise LockDeadlock(
            f"deadlock detected while waiting for advisory lock {key.name!r}", name=key.name
        ) from error
    if code == QUERY_CANCELED:
        raise LockTimeout(
            f"waiting for advisory lock {key.name!r} was canceled "
            "(statement_timeout or a cancel request)",
            name=key.name,
        ) from error
    if code == OUT_OF_SHARED_MEMORY:
        raise AdvisoryLockError(
            f"PostgreSQL's lock table is full while taking {key.name!r}; raise "
            "max_locks_per_transaction or hold fewer locks at once"
        ) from error
    raise error


def _acquire_in_transaction_script(call: str, timeout: Timeout) -> str:
    # Inside the caller's transaction a failed wait would abort it, so the wait runs in a
    # savepoint. SET LOCAL would outlive RELEASE SAVEPOINT, so the caller's lock_timeout
    # is saved in a custom setting first and put back after the grant. One round trip.
    if timeout is None:
        return f"SAVEPOINT {SAVEPOINT}; {call}; RELEASE SAVEPOINT {SAVEPOINT}"
    return (
        f"SAVEPOINT {SAVEPOINT}; "
        f"SELECT set_config('{SAVED_TIMEOUT_SETTING}', current_setting('lock_timeout'), true); "
        f"SET LOCAL lock_timeout = {_timeout_ms(timeout)}; "
        f"{call}; "
        f"SELECT set_config('lock_timeout', current_setting('{SAVED_TIMEOUT_SETTING}'), true); "
        f"RELEASE SAVEPOINT {SAVEPOINT}"
    )


# (shared, transaction) -> the lock function's name, without its "pg_" prefix.
_LOCK_FUNCTIONS: Final = {
    (False, False): "advisory_lock",
    (True, False): "advisory_lock_shared",
    (False, True): "advisory_xact_lock",
    (True, True): "advisory_xact_lock_shared",
}


def _lock_statement(
    ints: tuple[int, ...], shared: bool, transaction: bool, timeout: Timeout
) -> Statement:
    """The lock statement outside a transaction block, and the try_ variants anywhere."""
    function = _LOCK_FUNCTIONS[shared, transaction]
    arity = len(ints)
    if timeout == 0:
        return Statement(VALUE, _statement_for("SELECT pg_try_{}({})", function, arity), ints)
    if timeout is None:
        return Statement(VALUE, _statement_for("SELECT pg_{}({})", function, arity), ints)
    # Outside a transaction block one statement is one implicit transaction, and
    # set_config(..., true) is local to it: the caller's lock_timeout is back in force as
    # soon as the lock is granted (a session lock outlives the implicit transaction). The
    # set_config sits in a FROM subquery so it runs before the wait starts: a subquery
    # with a volatile output is never flattened into its parent, and the parent's row
    # needs the subquery's. One parameterised statement, so drivers that prepare
    # statements (psycopg 3 after a few uses) reuse its plan, as they do the unlock's.
    return Statement(
        VALUE, _statement_for(TIMEOUT_LOCK_SQL, function, arity), (*ints, _timeout_text(timeout))
    )


# The lock and unlock statements of the keys locked lately, by key and options: an
# application takes the same few locks again and again, and finding a statement costs a
# third of making one. Statements are never changed once made, so every thread may share
# them. Emptied when full, which only costs the next few locks the making again.
_lock_statements: dict[tuple[object, ...], Statement] = {}
_unlock_statements: dict[tuple[object, ...], Statement] = {}
# lock_statements()' answers, one lookup per lock.
_statement_pairs: dict[tuple[object, ...], tuple[Statement | None, Statement | None]] = {}
STATEMENT_CACHE_LIMIT: Final = 1024


def _remember(
    statements: dict[tuple[object, ...], T], made: tuple[object, ...], statement: T
) -> None:
    if len(statements) >= STATEMENT_CACHE_LIMIT:
        statements.clear()
    statements[made] = statement


@cache
def _statement_for(template: str, function: str, arity: int) -> str:
    # A handful of distinct texts (function x key arity): built once, not per lock.
    return template.format(function, ", ".join(["%s"] * arity))


def _literals(key: LockKey) -> str:
    # Keys are validated Python ints (never text from the caller), so their decimal
    # form is safe to inline; scripts cannot carry parameters.
    return ", ".join(str(int(part)) for part in key.ints)


def _timeout_ms(timeout: float) -> int:
    return max(1, math.ceil(timeout * 1000))


@lru_cache(maxsize=64)
def _timeout_text(timeout: float) -> str:
    # lock_timeout as set_config() takes it; an application uses a few timeouts.
    return str(_timeout_ms(timeout))


def _seconds(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def _key_from_pg_locks(classid: int, objid: int, objsubid: int) -> int | tuple[int, int]:
    if objsubid == 2:
        return _signed32(classid), _signed32(objid)
    unsigned = (classid << 32) | objid
    return unsigned - 2**64 if unsigned >= 2**63 else unsigned


def _signed32(value: int) -> int:
    return value - 2**32 if value >= 2**31 else value
