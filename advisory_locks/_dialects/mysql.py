"""MySQL and MariaDB named locks: every piece of MySQL SQL the library sends.

``GET_LOCK(name, timeout)`` takes a session-scoped exclusive lock, waiting in the server;
``RELEASE_LOCK(name)`` gives it back. The server knows locks by a text name of at most
64 characters, so each lock name maps to a server-side name (``server_lock_name()``).
Names are always sent as parameters.

What MySQL cannot do is refused before any SQL: shared locks (there are none) and
transaction locks (``COMMIT`` does not release a ``GET_LOCK`` lock, and releasing from
client-side transaction events could not be exact).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Hashable
from typing import Any, Final

from advisory_locks._core.contract import Timeout
from advisory_locks._core.executors import protocol_session_id
from advisory_locks._core.steps import ROWS, SCRIPT, VALUE, Statement
from advisory_locks._dialects.base import (
    SERVER_SESSION_STATE,
    SERVER_VERSION_STATE,
    WAIT_CANCELLED_STATE,
    LockedRow,
    StatementSteps,
)
from advisory_locks.errors import (
    LockDeadlock,
    LockTimeout,
    UnsupportedDatabase,
    UnsupportedFeature,
)
from advisory_locks.keys import LockKey

__all__ = ["MySQLBackend", "server_lock_name"]

MARIADB_STATE: Final = "mysql.is_mariadb"

MAX_NAME_CHARS: Final = 64
HASH_HEX_CHARS: Final = 32
# Text made only of these characters reaches the server unchanged. Upper-case letters are
# left out on purpose: MySQL compares lock names case-insensitively, so "Job" and "job"
# would be one lock there but two on PostgreSQL. Any other text is hashed.
READABLE: Final = re.compile(r"[a-z0-9_.:/@-]{1,64}")
UNREADABLE_CHAR: Final = re.compile(r"[^A-Za-z0-9_.:/@-]")

# GET_LOCK waits at most this long on MySQL; larger timeouts are refused up front.
MAX_TIMEOUT_SECONDS: Final = 2**31 - 1

ER_LOCK_DEADLOCK: Final = 1213  # MariaDB's answer to a user-lock deadlock
ER_USER_LOCK_DEADLOCK: Final = 3058  # MySQL's
ER_USER_LOCK_WRONG_NAME: Final = 3057
# A wait ended by the server with an error rather than GET_LOCK's NULL. MySQL's own
# handler for GET_LOCK's wait (Lock_wait_timeout_handler) turns ER_QUERY_INTERRUPTED
# (1317, a KILL QUERY) into NULL but lets ER_QUERY_TIMEOUT (3024) through: the timer of
# max_execution_time, which applies to every SELECT, GET_LOCK's too, ends the wait with
# it. MariaDB's max_statement_time answers NULL (10.11, measured), but its code for that
# limit is 1969 (ER_STATEMENT_TIMEOUT), and 1317 is kept in case a kill arrives where no
# handler turns it into NULL.
INTERRUPTED_WAIT: Final = frozenset({1317, 1969, 3024})
# A statement error can come after GET_LOCK granted the lock (a kill or the timer firing
# between the grant and the reply): give back the lock if this session holds it.
RELEASE_LATE_GRANT_SQL: Final = (
    "SELECT IF(IS_USED_LOCK(%s) = CONNECTION_ID(), RELEASE_LOCK(%s), NULL)"
)
# The session is gone (or the protocol is past saving): ER_SERVER_SHUTDOWN 1053,
# ER_ABORTING_CONNECTION 1152, ER_NET_READ_ERROR .. ER_NET_WRITE_INTERRUPTED 1158-1161,
# ER_NEW_ABORTING_CONNECTION 1184, ER_CONNECTION_KILLED 1927 (MariaDB), ER_SESSION_WAS_KILLED
# 3169 (MySQL), ER_CLIENT_INTERACTION_TIMEOUT 4031 (MySQL 8.0.24+ wait_timeout); client side
# CR_SERVER_GONE_ERROR 2006, CR_SERVER_LOST 2013, CR_COMMANDS_OUT_OF_SYNC 2014,
# CR_NAMEDPIPEOPEN_ERROR 2045 (SQLAlchemy counts these two as disconnects too),
# CR_SERVER_LOST_EXTENDED 2055. Errors of opening a connection (2002, 2003) are not here:
# no session existed, and the caller's own connect reports them.
CONNECTION_GONE: Final = frozenset(
    {1053, 1152, 1158, 1159, 1160, 1161, 1184, 1927, 3169, 4031, 2006, 2013, 2014, 2045, 2055}
)

SHARED_REFUSED: Final = (
    "MySQL and MariaDB have no shared named locks (GET_LOCK is exclusive only): take an "
    "exclusive lock (shared=False) instead, or PostgreSQL for reader/writer locks"
)
TRANSACTION_REFUSED: Final = (
    "MySQL and MariaDB have no transaction-scoped named locks: COMMIT and ROLLBACK do not "
    "release GET_LOCK. Take a session lock (transaction=False) that spans the whole "
    "transaction instead: acquire it before the transaction begins and release it after "
    "the commit or rollback"
)

# performance_schema lists user locks on MySQL 5.7+ and on MariaDB with it switched on;
# MariaDB's metadata_lock_info plugin lists granted ones otherwise.
PERFORMANCE_SCHEMA_SQL: Final = """
SELECT t.PROCESSLIST_ID, m.OBJECT_NAME, m.LOCK_STATUS = 'GRANTED', p.TIME,
       COALESCE(p.USER, ''), p.HOST, p.COMMAND, COALESCE(p.INFO, '')
FROM performance_schema.metadata_locks AS m
JOIN performance_schema.threads AS t ON t.THREAD_ID = m.OWNER_THREAD_ID
LEFT JOIN information_schema.PROCESSLIST AS p ON p.ID = t.PROCESSLIST_ID
WHERE m.OBJECT_TYPE = 'USER LEVEL LOCK'
ORDER BY m.OBJECT_NAME, m.LOCK_STATUS = 'GRANTED' DESC, t.PROCESSLIST_ID
"""
METADATA_LOCK_INFO_SQL: Final = """
SELECT m.THREAD_ID, m.TABLE_SCHEMA, 1, p.TIME,
       COALESCE(p.USER, ''), p.HOST, p.COMMAND, COALESCE(p.INFO, '')
FROM information_schema.METADATA_LOCK_INFO AS m
LEFT JOIN information_schema.PROCESSLIST AS p ON p.ID = m.THREAD_ID
WHERE m.LOCK_TYPE = 'User lock'
ORDER BY m.TABLE_SCHEMA, m.THREAD_ID
"""
LOCK_SOURCES_SQL: Final = """
SELECT @@performance_schema,
       (SELECT COUNT(*) FROM information_schema.PLUGINS
        WHERE PLUGIN_NAME = 'METADATA_LOCK_INFO' AND PLUGIN_STATUS = 'ACTIVE')
"""
NO_LOCK_SOURCE: Final = (
    "this server does not expose its named locks: MySQL needs performance_schema=ON (the "
    "default); on MariaDB either start the server with performance_schema=ON or load the "
    "metadata_lock_info plugin (INSTALL SONAME 'metadata_lock_info')"
)


def server_lock_name(key: LockKey) -> str:
    """The name ``GET_LOCK`` sees for a lock name (and its prefix); at most 64 characters.

    - a text name under the ``rails`` key scheme: prefix + name, as is, the name the Ruby
      ``with_advisory_lock`` gem sends, so the gem and this library take one lock for
      every name the gem can lock. The server's rules apply as they do to the gem's
      names (MySQL compares them case-insensitively, MariaDB case-sensitively). Text
      over MySQL's 64-character limit, which the gem cannot lock there, raises
      ``ValueError`` before any SQL, on MariaDB too;
    - other text (prefix + name) of lower-case ASCII letters, digits and ``_.:/@-``, at
      most 64 characters: itself, so other MySQL clients can use the same lock;
    - any other text: its first 31 characters with unusual characters replaced by ``_``,
      ``#``, and the first 32 hex digits of SHA-256 of the UTF-8 text. A readable name
      never contains ``#``, so the two forms cannot collide, and the hash keeps names
      that differ only in case apart even on a server that ignores case;
    - an integer: ``#int:<n>``; a pair: ``#pair:<a>:<b>`` (whatever the scheme).
    """
    name = key.name
    if isinstance(name, tuple):
        return f"#pair:{name[0]}:{name[1]}"
    if isinstance(name, int):
        return f"#int:{name}"
    text = key.prefix + name
    if key.scheme == "rails":
        return _rails_lock_name(text)
    if READABLE.fullmatch(text):
        return text
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:HASH_HEX_CHARS]
    readable = UNREADABLE_CHAR.sub("_", text[: MAX_NAME_CHARS - HASH_HEX_CHARS - 1])
    return f"{readable}#{digest}"


def _rails_lock_name(text: str) -> str:
    # MySQL refuses longer names (error 3057), so the gem fails on them; MariaDB takes up
    # to 192 bytes, but one limit on both servers keeps a name that works on one working
    # on the other. Hashing instead would take a lock the gem never could, silently.
    if len(text) > MAX_NAME_CHARS:
        raise ValueError(
            f"the rails key scheme sends {text[:20]!r}... to GET_LOCK as is, as the "
            f"with_advisory_lock gem does, and it is {len(text)} characters long: MySQL "
            f"takes at most {MAX_NAME_CHARS}, so the gem cannot lock it either. Use a "
            "shorter name, or another key scheme (which hashes long names)"
        )
    return text


class MySQLBackend:
    """Session-scoped exclusive locks (``GET_LOCK``) with server-side waits."""

    dialect_name = "mysql"
    locks_on_server = True
    locks_by_ints = False  # GET_LOCK names (see lock_identity)

    def system_name(self, state: dict[str, Any]) -> str:
        mariadb = state.get(MARIADB_STATE)
        if mariadb is None:
            version = state.get(SERVER_VERSION_STATE)
            mariadb = isinstance(version, str) and "mariadb" in version.lower()
        return "mariadb" if mariadb else "mysql"

    def check_options(self, *, shared: bool, transaction: bool, timeout: Timeout) -> None:
        if shared:
            raise UnsupportedFeature(SHARED_REFUSED)
        if transaction:
            raise UnsupportedFeature(TRANSACTION_REFUSED)
        if timeout is not None and timeout > MAX_TIMEOUT_SECONDS:
            raise ValueError(
                f"timeout {timeout} s is longer than GET_LOCK accepts; pass timeout=None "
                "to wait without limit"
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
        # GET_LOCK neither needs nor disturbs a transaction, and a failed wait leaves
        # the caller's transaction usable, so in_transaction needs no care here.
        self.check_options(shared=shared, transaction=transaction, timeout=timeout)
        seconds = yield from _server_timeout(state, timeout)
        name = server_lock_name(key)
        try:
            granted = yield Statement(VALUE, "SELECT GET_LOCK(%s, %s)", (name, seconds))
        except Exception as error:
            code = error_code(error)
            if code in (ER_LOCK_DEADLOCK, ER_USER_LOCK_DEADLOCK):
                raise LockDeadlock(
                    f"deadlock detected while waiting for named lock {key.name!r}",
                    name=key.name,
                ) from error
            if code not in INTERRUPTED_WAIT:
                raise
            # This library records no hold of this name on this connection (else it
            # would not have asked the server), so any hold is a grant the error hid,
            # which would otherwise stay with a connection whose caller was told no.
            yield Statement(VALUE, RELEASE_LATE_GRANT_SQL, (name, name))
            raise LockTimeout(
                f"waiting for named lock {key.name!r} was interrupted ({error})",
                name=key.name,
            ) from error
        if granted is None:
            # NULL: the wait was interrupted without an error (a KILL QUERY, or MariaDB's
            # max_statement_time), and the lock was not granted. Reported as PostgreSQL's
            # statement_timeout and cancel requests are.
            cancelled = state.get(WAIT_CANCELLED_STATE)
            if cancelled is not None and cancelled.is_set():
                raise LockTimeout(
                    f"waiting for named lock {key.name!r} was canceled", name=key.name
                )
            raise LockTimeout(
                f"waiting for named lock {key.name!r} was interrupted (MariaDB's "
                "max_statement_time, or a KILL QUERY)",
                name=key.name,
            )
        return bool(granted)

    def lock_statement(
        self,
        key: LockKey,
        *,
        shared: bool,
        transaction: bool,
        timeout: Timeout,
        in_transaction: bool,
    ) -> Statement | None:
        # GET_LOCK answers 0 for a wait that timed out, and NULL for an interrupted one.
        return None

    def lock_statements(
        self,
        key: LockKey,
        shared: bool,
        transaction: bool,
        timeout: Timeout,
        in_transaction: bool,
    ) -> tuple[Statement | None, Statement | None]:
        return None, None if transaction else self.unlock_statement(key, shared=shared)

    def lock_identity(self, key: LockKey) -> Hashable:
        # GET_LOCK locks names, not keys: two names whose keys collide (easy with the
        # rails scheme's CRC32) are two different locks here.
        return server_lock_name(key)

    def release(self, state: dict[str, Any], key: LockKey, *, shared: bool) -> StatementSteps[bool]:
        released = yield self.unlock_statement(key, shared=shared)
        return bool(released)

    def unlock_statement(self, key: LockKey, *, shared: bool) -> Statement:
        # 0: another session holds it; NULL: nobody does. Either way it was not ours.
        return Statement(VALUE, "SELECT RELEASE_LOCK(%s)", (server_lock_name(key),))

    def is_held(self, state: dict[str, Any], key: LockKey, *, shared: bool) -> StatementSteps[bool]:
        held = yield Statement(
            VALUE, "SELECT IS_USED_LOCK(%s) = CONNECTION_ID()", (server_lock_name(key),)
        )
        return bool(held)

    def inspect_server(self, state: dict[str, Any]) -> StatementSteps[int]:
        connection_id = yield Statement(VALUE, "SELECT CONNECTION_ID()")
        return int(str(connection_id))

    def list_locks(self, state: dict[str, Any]) -> StatementSteps[list[LockedRow]]:
        sources = yield Statement(ROWS, LOCK_SOURCES_SQL)
        performance_schema, metadata_lock_info = sources[0]
        if _truthy(performance_schema):
            sql = PERFORMANCE_SCHEMA_SQL
        elif _truthy(metadata_lock_info):
            sql = METADATA_LOCK_INFO_SQL
        else:
            raise UnsupportedFeature(NO_LOCK_SOURCE)
        rows = yield Statement(ROWS, sql)
        return [_locked_row(row) for row in rows]

    def cancel_wait(self, state: dict[str, Any], driver_connection: Any) -> StatementSteps[None]:
        # MySQL has no cancel request in its protocol: another session kills the waiting
        # statement (GET_LOCK then returns NULL). KILL QUERY reaching a session that has
        # already finished the statement does nothing to its next one (MariaDB 10.11).
        connection_id = state.get(SERVER_SESSION_STATE) or protocol_session_id(driver_connection)
        if connection_id is None:
            raise UnsupportedDatabase(
                f"cannot tell which server session {type(driver_connection).__name__} "
                "waits in, so its wait cannot be cancelled"
            )
        # The id is the server's integer, never caller text; KILL takes no parameters.
        yield Statement(SCRIPT, f"KILL QUERY {int(connection_id)}")

    def is_connection_failure(self, error: BaseException) -> bool:
        if error_code(error) in CONNECTION_GONE or isinstance(error, ConnectionError):
            return True
        # PyMySQL and mysqlclient raise InterfaceError (0, '') on a closed connection.
        names = {cls.__name__ for cls in type(error).__mro__}
        return "InterfaceError" in names

    def is_failed_transaction(self, error: BaseException) -> bool:
        # MySQL has no "transaction aborted, awaiting rollback" state.
        return False


def error_code(error: BaseException) -> int | None:
    """The MySQL error number of a driver error, looking through SQLAlchemy wrappers."""
    seen: BaseException | None = error
    for _ in range(4):
        if seen is None:
            return None
        arguments = getattr(seen, "args", ())
        if arguments and isinstance(arguments[0], int) and not isinstance(arguments[0], bool):
            return arguments[0]
        seen = getattr(seen, "orig", None) or seen.__cause__
    return None


def _server_timeout(state: dict[str, Any], timeout: Timeout) -> StatementSteps[float | int]:
    if timeout == 0:
        return 0
    mariadb = yield from _is_mariadb(state)
    if timeout is None:
        # MySQL waits without limit for a negative timeout; MariaDB (10.11) answers NULL
        # with warning 1411 "Incorrect timeout value" instead, so it gets 68 years.
        return MAX_TIMEOUT_SECONDS if mariadb else -1
    if mariadb:
        return timeout  # MariaDB waits for fractions of a second
    # MySQL reads the timeout as whole seconds. Round up, never down: 0.3 s becomes 1 s
    # rather than 0, which would mean "do not wait" and fail where the caller would wait.
    return max(1, math.ceil(timeout))


def _is_mariadb(state: dict[str, Any]) -> StatementSteps[bool]:
    cached = state.get(MARIADB_STATE)
    if cached is None:
        # Executors of drivers that learn the version in the handshake (PyMySQL,
        # mysqlclient) put it in the state; otherwise ask once per connection.
        version = state.get(SERVER_VERSION_STATE)
        if not isinstance(version, str):
            version = str((yield Statement(VALUE, "SELECT VERSION()")))
        cached = state[MARIADB_STATE] = "mariadb" in version.lower()
    return bool(cached)


def _truthy(value: object) -> bool:
    return value not in (None, 0, "0", "OFF", b"0") and bool(value)


def _locked_row(row: tuple[object, ...]) -> LockedRow:
    pid, name, granted, seconds, user, host, command, query = row
    name_text = name.decode() if isinstance(name, bytes) else str(name)
    return LockedRow(
        pid=int(pid),  # type: ignore[call-overload]
        key=name_text,
        mode="exclusive",
        granted=bool(granted),
        # TIME is how long the thread has been in its current state: the wait, for a
        # waiter; for a holder it says nothing about when the lock was granted.
        waiting_seconds=None if granted else _seconds(seconds),
        held_at_most_seconds=None,
        application_name=str(user),
        client_addr=None if host is None else str(host),
        state=None if command is None else str(command),
        query=str(query),
    )


def _seconds(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]
