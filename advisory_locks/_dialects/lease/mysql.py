"""Lease rows on MySQL and MariaDB: every piece of lease SQL sent to them.

Time is ``UTC_TIMESTAMP(6)`` stored in ``DATETIME(6)``: unlike ``NOW()`` it does not
depend on the session's ``time_zone``, so two clients configured differently agree.
Names are compared with ``utf8mb4_bin``: "Job" and "job" are two leases, as elsewhere.

MySQL has no ``INSERT ... RETURNING`` (MariaDB's does not cover ``ON DUPLICATE KEY
UPDATE``), so taking a lease is two statements: one conditional upsert that never resets
the token, then one read of the row that says whether this holder got it, with which
token, and otherwise when the current holding expires.

Fencing: ``fence()`` reads the row ``LOCK IN SHARE MODE`` in the caller's transaction.
A takeover's upsert needs an exclusive row lock, so it waits until that transaction ends.
Unlike PostgreSQL, InnoDB has no lock mode that lets the owner's renewal through a shared
lock, so a renewal skips a fenced row (``SKIP LOCKED``) and renews it at a later round:
keep fenced transactions shorter than the ttl.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

from advisory_locks._core.contract import Timeout
from advisory_locks._core.steps import ROWS, SCRIPT, Statement
from advisory_locks._dialects.lease.base import LEASE_TABLE, Attempt, LeaseRow, StatementSteps
from advisory_locks._dialects.mysql import (
    ER_LOCK_DEADLOCK,
    MySQLBackend,
    _is_mariadb,
    error_code,
)

__all__ = ["MySQLLeaseBackend"]

ER_NO_SUCH_TABLE: Final = 1146
ER_LOCK_WAIT_TIMEOUT: Final = 1205
# innodb_lock_wait_timeout is whole seconds; MariaDB takes 0 (do not wait), MySQL's
# minimum is 1.
MAX_LOCK_WAIT_SECONDS: Final = 1_073_741_824
NOW: Final = "UTC_TIMESTAMP(6)"

CREATE_TABLE_SQL: Final = f"""
CREATE TABLE IF NOT EXISTS {LEASE_TABLE} (
    name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL PRIMARY KEY,
    holder VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    token BIGINT NOT NULL,
    acquired_at DATETIME(6) NOT NULL,
    renewed_at DATETIME(6) NOT NULL,
    expires_at DATETIME(6) NOT NULL
) ENGINE=InnoDB
"""

# MySQL evaluates ON DUPLICATE KEY UPDATE assignments left to right, each seeing the
# columns assigned before it. The condition reads holder and expires_at, so they are
# assigned last: holder from the condition, then expires_at from whether holder is now
# ours (a holder string is unique to one acquire attempt).
FREE: Final = f"(holder IS NULL OR expires_at <= {NOW})"
UPSERT_SQL: Final = f"""
INSERT INTO {LEASE_TABLE} (name, holder, token, acquired_at, renewed_at, expires_at)
VALUES (%s, %s, 1, {NOW}, {NOW}, {NOW} + INTERVAL %s MICROSECOND)
ON DUPLICATE KEY UPDATE
    token = IF({FREE}, token + 1, token),
    acquired_at = IF({FREE}, VALUES(acquired_at), acquired_at),
    renewed_at = IF({FREE}, VALUES(renewed_at), renewed_at),
    holder = IF({FREE}, VALUES(holder), holder),
    expires_at = IF(holder <=> VALUES(holder), VALUES(expires_at), expires_at)
"""
ATTEMPT_SQL: Final = f"""
SELECT token, holder <=> %s,
       TIMESTAMPDIFF(MICROSECOND, {NOW}, expires_at), expires_at > {NOW}
FROM {LEASE_TABLE} WHERE name = %s
"""

RELEASE_SQL: Final = f"""
UPDATE {LEASE_TABLE} SET holder = NULL, expires_at = {NOW}
WHERE name = %s AND holder = %s AND token = %s
"""

FENCE_SQL: Final = f"""
SELECT token FROM {LEASE_TABLE}
WHERE name = %s AND holder = %s AND token = %s AND expires_at > {NOW}
LOCK IN SHARE MODE
"""

ROW_COLUMNS: Final = f"""
SELECT name, holder, token, TIMESTAMPDIFF(MICROSECOND, acquired_at, {NOW}),
       CASE WHEN holder IS NULL THEN NULL
            ELSE TIMESTAMPDIFF(MICROSECOND, {NOW}, expires_at) END
FROM {LEASE_TABLE}
"""

PRUNE_SQL: Final = f"""
UPDATE {LEASE_TABLE} SET holder = NULL
WHERE holder IS NOT NULL AND expires_at < {NOW} - INTERVAL %s MICROSECOND
"""

_advisory = MySQLBackend()


class MySQLLeaseBackend:
    """Lease rows on MySQL 8 and MariaDB 10.6+ (``SKIP LOCKED``)."""

    dialect_name = "mysql"
    renew_batch_size = 1_000
    # No LISTEN/NOTIFY: waiters sleep until the expiry they read.
    listen_sql: str | None = None

    def create_table(self) -> list[str]:
        return [CREATE_TABLE_SQL]

    def system_name(self, state: dict[str, Any]) -> str:
        return _advisory.system_name(state)

    def check_database(self, state: dict[str, Any]) -> StatementSteps[None]:
        yield from ()

    def renewer_setup(self, renew_every: float) -> list[str]:
        return []

    def acquire(
        self, state: dict[str, Any], name: str, holder: str, ttl: float, *, lock_wait: Timeout
    ) -> StatementSteps[Attempt]:
        mariadb = yield from _is_mariadb(state)
        seconds = _lock_wait_seconds(lock_wait, mariadb=mariadb)
        # The lock wait is set for this one statement only, so a pooled connection keeps
        # its own setting: MariaDB's SET STATEMENT, MySQL's SET_VAR optimizer hint.
        if mariadb:
            sql = f"SET STATEMENT innodb_lock_wait_timeout = {seconds} FOR {UPSERT_SQL}"
        else:
            sql = UPSERT_SQL.replace(
                "INSERT INTO",
                f"INSERT /*+ SET_VAR(innodb_lock_wait_timeout = {seconds}) */ INTO",
                1,
            )
        try:
            yield Statement(ROWS, sql, (name, holder, _microseconds(ttl)))
        except Exception as error:
            # A fenced row stayed locked (1205), or two first-time upserts of nearby
            # names deadlocked on InnoDB's gap locks (1213): either way not ours this time.
            if self.is_busy(error):
                return Attempt(None)
            raise
        rows = yield Statement(ROWS, ATTEMPT_SQL, (holder, name))
        if not rows:
            return Attempt(None, 0.0)
        token, ours, expires_in, unexpired = rows[0]
        if ours and unexpired:
            return Attempt(int(token))
        # Freed since the attempt (no expiry): worth trying again at once.
        return Attempt(None, _seconds(expires_in) or 0.0)

    def renew(self, leases: Sequence[tuple[str, str, int]], ttl: float) -> StatementSteps[set[str]]:
        wanted = {name: (holder, token) for name, holder, token in leases}
        marks = _marks(len(wanted))
        yield Statement(SCRIPT, "START TRANSACTION")
        try:
            rows = yield Statement(
                ROWS,
                f"SELECT name, holder, token, expires_at > {NOW} FROM {LEASE_TABLE} "
                f"WHERE name IN ({marks}) FOR UPDATE SKIP LOCKED",
                tuple(wanted),
            )
            mine = [
                str(name)
                for name, row_holder, token, unexpired in rows
                if wanted.get(str(name)) == (row_holder, int(token)) and unexpired
            ]
            if mine:
                yield Statement(
                    ROWS,
                    f"UPDATE {LEASE_TABLE} SET renewed_at = {NOW}, "
                    f"expires_at = {NOW} + INTERVAL %s MICROSECOND "
                    f"WHERE name IN ({_marks(len(mine))})",
                    (_microseconds(ttl), *mine),
                )
            yield Statement(SCRIPT, "COMMIT")
        except BaseException:
            yield Statement(SCRIPT, "ROLLBACK")
            raise
        return set(mine)

    def release(self, name: str, holder: str, token: int) -> StatementSteps[bool]:
        yield Statement(ROWS, RELEASE_SQL, (name, holder, token))
        changed = yield Statement(ROWS, "SELECT ROW_COUNT()")
        return bool(changed[0][0])

    def fence(self, name: str, holder: str, token: int) -> StatementSteps[bool]:
        rows = yield Statement(ROWS, FENCE_SQL, (name, holder, token))
        return bool(rows)

    def rows(self, names: Sequence[str]) -> StatementSteps[list[LeaseRow]]:
        found = yield Statement(
            ROWS, f"{ROW_COLUMNS} WHERE name IN ({_marks(len(names))})", tuple(names)
        )
        return [_lease_row(row) for row in found]

    def list_leases(self) -> StatementSteps[list[LeaseRow]]:
        found = yield Statement(ROWS, f"{ROW_COLUMNS} ORDER BY name")
        return [_lease_row(row) for row in found]

    def prune(self, expired_for: float) -> StatementSteps[int]:
        yield Statement(ROWS, PRUNE_SQL, (_microseconds(expired_for),))
        changed = yield Statement(ROWS, "SELECT ROW_COUNT()")
        return int(changed[0][0])

    def is_missing_table(self, error: BaseException) -> bool:
        return error_code(error) == ER_NO_SUCH_TABLE

    def is_connection_failure(self, error: BaseException) -> bool:
        return _advisory.is_connection_failure(error)

    def is_busy(self, error: BaseException) -> bool:
        # innodb_lock_wait_timeout ran out, or InnoDB chose this statement as a
        # deadlock's victim: either way it was rolled back.
        return error_code(error) in (ER_LOCK_WAIT_TIMEOUT, ER_LOCK_DEADLOCK)


def _lock_wait_seconds(lock_wait: Timeout, *, mariadb: bool) -> int:
    if lock_wait is None:
        return MAX_LOCK_WAIT_SECONDS
    seconds = min(MAX_LOCK_WAIT_SECONDS, math.ceil(lock_wait))
    return seconds if mariadb else max(1, seconds)


def _microseconds(seconds: float) -> int:
    return max(0, round(seconds * 1_000_000))


def _seconds(microseconds: object) -> float | None:
    return None if microseconds is None else int(microseconds) / 1_000_000  # type: ignore[call-overload]


def _marks(count: int) -> str:
    return ", ".join(["%s"] * count)


def _lease_row(row: Sequence[Any]) -> LeaseRow:
    name, holder, token, held_for, expires_in = row
    return LeaseRow(
        name=str(name),
        holder=None if holder is None else str(holder),
        token=int(token),
        held_for=_seconds(held_for),
        expires_in=_seconds(expires_in),
    )
