"""Lease rows on SQLite: every piece of lease SQL sent to SQLite.

SQLite has no server: its clock is the clock of the host that runs the process opening
the database file, and every process using one database file runs on that host (SQLite
over a network filesystem is not safe anyway). So "the database's clock" is the host's,
read by SQLite itself (``strftime(..., 'now')``), never by Python.

Times are stored as UTC text ``YYYY-MM-DD HH:MM:SS.SSS``, which compares in time order
and is what SQLAlchemy's and Django's DateTime columns read on SQLite.

Fencing: SQLite runs one writer at a time. ``fence()`` makes a (no-op) write to the
lease row inside the caller's transaction, which takes the database's write lock until
that transaction ends; no takeover, renewal or other write can happen meanwhile, so keep
fenced transactions short (well under the ttl). Waits for the write lock are bounded by
``busy_timeout``, set per statement from the lock's timeout.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence
from typing import Any, Final

from advisory_locks._core.contract import Timeout
from advisory_locks._core.steps import ROWS, SCRIPT, VALUE, Statement
from advisory_locks._dialects.lease.base import LEASE_TABLE, Attempt, LeaseRow, StatementSteps
from advisory_locks.errors import UnsupportedFeature

__all__ = ["SQLiteLeaseBackend"]

NOW: Final = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
LATER: Final = "strftime('%Y-%m-%d %H:%M:%f', 'now', ?)"  # ? = '+30.000 seconds'
MAX_BUSY_MS: Final = 2**31 - 1
DATABASE_CHECKED: Final = "sqlite.lease_database_checked"

CREATE_TABLE_SQL: Final = f"""
CREATE TABLE IF NOT EXISTS {LEASE_TABLE} (
    name varchar(255) NOT NULL PRIMARY KEY,
    holder varchar(255) NULL,
    token bigint NOT NULL,
    acquired_at datetime NOT NULL,
    renewed_at datetime NOT NULL,
    expires_at datetime NOT NULL
)
"""

ACQUIRE_SQL: Final = f"""
INSERT INTO {LEASE_TABLE} (name, holder, token, acquired_at, renewed_at, expires_at)
VALUES (?, ?, 1, {NOW}, {NOW}, {LATER})
ON CONFLICT (name) DO UPDATE
SET holder = excluded.holder, token = {LEASE_TABLE}.token + 1,
    acquired_at = excluded.acquired_at, renewed_at = excluded.renewed_at,
    expires_at = excluded.expires_at
WHERE {LEASE_TABLE}.holder IS NULL OR {LEASE_TABLE}.expires_at <= {NOW}
RETURNING token
"""

RELEASE_SQL: Final = f"""
UPDATE {LEASE_TABLE} SET holder = NULL, expires_at = {NOW}
WHERE name = ? AND holder = ? AND token = ?
RETURNING token
"""

# A write, so that the caller's transaction takes SQLite's write lock (the sqlite3
# module opens its transaction before a write, not before a read).
FENCE_SQL: Final = f"""
UPDATE {LEASE_TABLE} SET token = token
WHERE name = ? AND holder = ? AND token = ? AND expires_at > {NOW}
RETURNING token
"""

ROW_COLUMNS: Final = f"""
SELECT name, holder, token, (julianday('now') - julianday(acquired_at)) * 86400.0,
       CASE WHEN holder IS NULL THEN NULL
            ELSE (julianday(expires_at) - julianday('now')) * 86400.0 END
FROM {LEASE_TABLE}
"""

PRUNE_SQL: Final = f"""
UPDATE {LEASE_TABLE} SET holder = NULL
WHERE holder IS NOT NULL AND expires_at < strftime('%Y-%m-%d %H:%M:%f', 'now', ?)
RETURNING name
"""


class SQLiteLeaseBackend:
    """Lease rows in a SQLite database file."""

    dialect_name = "sqlite"
    # SQLite allows 32,766 parameters per statement; three per lease.
    renew_batch_size = 1_000
    # No LISTEN/NOTIFY: waiters sleep until the expiry they read.
    listen_sql: str | None = None

    def create_table(self) -> list[str]:
        return [CREATE_TABLE_SQL]

    def system_name(self, state: dict[str, Any]) -> str:
        return self.dialect_name

    def check_database(self, state: dict[str, Any]) -> StatementSteps[None]:
        if state.get(DATABASE_CHECKED):
            return
        databases = yield Statement(ROWS, "PRAGMA database_list")
        for _sequence, schema, file in databases:
            if schema == "main" and not file:
                raise UnsupportedFeature(
                    "a lease must be seen by every connection, and each connection to an "
                    "in-memory or temporary SQLite database has a database of its own: "
                    "use a database file"
                )
        state[DATABASE_CHECKED] = True

    def renewer_setup(self, renew_every: float) -> list[str]:
        # The renewer waits for another writer at most half a period, then tries again
        # at the next one, instead of sqlite3's default of 5 s.
        return [f"PRAGMA busy_timeout = {max(1, math.ceil(renew_every * 500))}"]

    def acquire(
        self, state: dict[str, Any], name: str, holder: str, ttl: float, *, lock_wait: Timeout
    ) -> StatementSteps[Attempt]:
        previous = yield Statement(VALUE, "PRAGMA busy_timeout")
        yield Statement(SCRIPT, f"PRAGMA busy_timeout = {_busy_ms(lock_wait)}")
        try:
            rows = yield Statement(ROWS, ACQUIRE_SQL, (name, holder, _modifier(ttl)))
        except Exception as error:
            # Raised as the driver raised it, or wrapped (Django's OperationalError,
            # SQLAlchemy's): the driver's error is in the chain either way.
            if not self.is_busy(error):
                raise
            return Attempt(None)  # another connection (a fence) holds the write lock
        finally:
            yield Statement(SCRIPT, f"PRAGMA busy_timeout = {int(previous)}")
        if rows:
            return Attempt(int(rows[0][0]))
        current = yield from self.rows([name])
        # Freed since the attempt (expires_in None): worth trying again at once.
        return Attempt(None, (current[0].expires_in or 0.0) if current else 0.0)

    def renew(self, leases: Sequence[tuple[str, str, int]], ttl: float) -> StatementSteps[set[str]]:
        triples = ", ".join(["(?, ?, ?)"] * len(leases))
        parameters: list[object] = [_modifier(ttl)]
        for lease in leases:
            parameters += lease
        rows = yield Statement(
            ROWS,
            f"UPDATE {LEASE_TABLE} SET renewed_at = {NOW}, expires_at = {LATER} "
            f"WHERE expires_at > {NOW} AND (name, holder, token) IN (VALUES {triples}) "
            "RETURNING name",
            parameters,
        )
        return {str(row[0]) for row in rows}

    def release(self, name: str, holder: str, token: int) -> StatementSteps[bool]:
        rows = yield Statement(ROWS, RELEASE_SQL, (name, holder, token))
        return bool(rows)

    def fence(self, name: str, holder: str, token: int) -> StatementSteps[bool]:
        rows = yield Statement(ROWS, FENCE_SQL, (name, holder, token))
        return bool(rows)

    def rows(self, names: Sequence[str]) -> StatementSteps[list[LeaseRow]]:
        marks = ", ".join(["?"] * len(names))
        found = yield Statement(ROWS, f"{ROW_COLUMNS} WHERE name IN ({marks})", tuple(names))
        return [_lease_row(row) for row in found]

    def list_leases(self) -> StatementSteps[list[LeaseRow]]:
        found = yield Statement(ROWS, f"{ROW_COLUMNS} ORDER BY name")
        return [_lease_row(row) for row in found]

    def prune(self, expired_for: float) -> StatementSteps[int]:
        rows = yield Statement(ROWS, PRUNE_SQL, (_modifier(-expired_for),))
        return len(rows)

    def is_missing_table(self, error: BaseException) -> bool:
        return _sqlite_error_says(error, f"no such table: {LEASE_TABLE}")

    def is_connection_failure(self, error: BaseException) -> bool:
        return _sqlite_error_says(error, "closed")

    def is_busy(self, error: BaseException) -> bool:
        return _is_busy(error)


def _modifier(seconds: float) -> str:
    return f"{seconds:+.3f} seconds"


def _busy_ms(lock_wait: Timeout) -> int:
    if lock_wait is None:
        return MAX_BUSY_MS
    # Capped before rounding: a huge finite wait's milliseconds overflow a float.
    return min(MAX_BUSY_MS, math.ceil(min(lock_wait, MAX_BUSY_MS / 1000) * 1000))


def _is_busy(error: BaseException) -> bool:
    """Whether SQLite gave up waiting for another connection's lock on the database
    (SQLITE_BUSY "database is locked", SQLITE_LOCKED "database table is locked")."""
    for seen in _sqlite_error_chain(error):
        if isinstance(seen, sqlite3.OperationalError):
            return "locked" in str(seen) or "busy" in str(seen)
    return False


def _sqlite_error_says(error: BaseException, text: str) -> bool:
    return any(
        isinstance(seen, sqlite3.Error) and text in str(seen) for seen in _sqlite_error_chain(error)
    )


def _sqlite_error_chain(error: BaseException) -> list[BaseException]:
    """``error`` and what it wraps: SQLAlchemy's ``orig``, Django's ``__cause__``."""
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and len(chain) < 3:
        chain.append(seen)
        seen = getattr(seen, "orig", None) or getattr(seen, "__cause__", None)
    return chain


def _lease_row(row: Sequence[Any]) -> LeaseRow:
    name, holder, token, held_for, expires_in = row
    return LeaseRow(
        name=str(name),
        holder=None if holder is None else str(holder),
        token=int(token),
        held_for=None if held_for is None else float(held_for),
        expires_in=None if expires_in is None else float(expires_in),
    )
