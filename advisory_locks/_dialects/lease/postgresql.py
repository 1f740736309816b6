"""Lease rows on PostgreSQL: every piece of lease SQL sent to PostgreSQL.

Time is ``clock_timestamp()``: the server's clock at the moment a row is examined, not
the start of the transaction (a fence runs inside the caller's transaction, which may
have begun long before; an acquire may have waited for a row lock).

Fencing works through row-lock modes: ``fence()`` takes ``FOR KEY SHARE`` on the row in
the caller's transaction. A renewal or release updates only non-key columns, which
needs ``FOR NO KEY UPDATE``, compatible with KEY SHARE: the owner's renewer is never
blocked by the owner's own fence. A takeover's ``ON CONFLICT DO UPDATE`` also assigns the
key column (``name = excluded.name``), which makes PostgreSQL lock the row ``FOR UPDATE``
before checking the condition (ExecUpdateLockMode looks at the columns assigned, not at
whether their values change): that conflicts with KEY SHARE, so a takeover waits until
every fencing transaction has ended, and then re-checks the expiry.

The statements avoid PostgreSQL-only syntax where an equivalent costs nothing, so
CockroachDB and YugabyteDB accept them too (untested here); the exception is the release's
``pg_notify()``, which CockroachDB lacks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

from advisory_locks._core.contract import Timeout
from advisory_locks._core.steps import ROWS, Statement
from advisory_locks._dialects.lease.base import LEASE_TABLE, Attempt, LeaseRow, StatementSteps
from advisory_locks._dialects.postgresql import LOCK_NOT_AVAILABLE, PostgresBackend, sqlstate_of

__all__ = ["PostgresLeaseBackend"]

UNDEFINED_TABLE: Final = "42P01"
# lock_timeout = 0 means "no limit" to PostgreSQL; "do not wait" is the shortest limit.
NO_WAIT_MS: Final = 1
MAX_WAIT_MS: Final = 2**31 - 1

CREATE_TABLE_SQL: Final = f"""
CREATE TABLE IF NOT EXISTS {LEASE_TABLE} (
    name varchar(255) NOT NULL PRIMARY KEY,
    holder varchar(255) NULL,
    token bigint NOT NULL,
    acquired_at timestamp with time zone NOT NULL,
    renewed_at timestamp with time zone NOT NULL,
    expires_at timestamp with time zone NOT NULL
)
"""

# One statement: the set_config in the FROM subquery runs before the row is inserted or
# locked, so lock_timeout bounds the wait for a fenced row; set_config(..., true) ends
# with the statement's own transaction (the lease connection is in autocommit), so it
# is safe through a transaction pooler. A new name starts at token 1; a taken-over one
# counts on from its row, which is never deleted.
ACQUIRE_SQL: Final = f"""
INSERT INTO {LEASE_TABLE} AS lease (name, holder, token, acquired_at, renewed_at, expires_at)
SELECT %s, %s, 1, clock_timestamp(), clock_timestamp(),
       clock_timestamp() + %s::float8 * interval '1 second'
FROM (SELECT pg_catalog.set_config('lock_timeout', %s, true)) AS wait
ON CONFLICT (name) DO UPDATE
SET name = excluded.name, holder = excluded.holder, token = lease.token + 1,
    acquired_at = excluded.acquired_at, renewed_at = excluded.renewed_at,
    expires_at = excluded.expires_at
WHERE lease.holder IS NULL OR lease.expires_at <= clock_timestamp()
RETURNING lease.token
"""

# statement_timestamp(): one instant for the whole batch (the renewal's own transaction
# started with the statement, so it is never earlier than when the renewal was sent).
# The CTE takes FOR NO KEY UPDATE on the rows it can, which a fence's KEY SHARE allows; a
# row locked harder (a takeover in progress) is skipped this round rather than holding
# up the other leases of the batch. It runs once (MATERIALIZED; clock_timestamp() would
# keep it from being inlined anyway), and matches names by joining the arrays to the
# primary key: psycopg prepares a statement it runs often, and the generic plan that
# PostgreSQL then uses for "name IN (SELECT ... WHERE name = ANY(%s) FOR ... SKIP
# LOCKED)" re-ran that subquery for every lease: renewing 8,000 leases took 5 s (two
# minutes with plan_cache_mode = force_generic_plan) instead of a tenth of a second, and
# leases expired while they were being renewed.
RENEW_SQL: Final = f"""
WITH mine AS MATERIALIZED (
  SELECT lease.name FROM {LEASE_TABLE} AS lease
  JOIN unnest(%s::text[], %s::text[], %s::int8[]) AS held(name, holder, token)
    ON lease.name = held.name AND lease.holder = held.holder AND lease.token = held.token
  WHERE lease.expires_at > clock_timestamp()
  FOR NO KEY UPDATE OF lease SKIP LOCKED
)
UPDATE {LEASE_TABLE} AS lease
SET renewed_at = statement_timestamp(),
    expires_at = statement_timestamp() + %s::float8 * interval '1 second'
FROM mine
WHERE lease.name = mine.name
RETURNING lease.name
"""

# The release tells waiters at once: NOTIFY is delivered at commit (this statement's own
# transaction) to every connection LISTENing on the channel, with the name as payload.
# NOTIFY needs no session state, so it works through a transaction pooler too.
NOTIFY_CHANNEL: Final = LEASE_TABLE
RELEASE_SQL: Final = f"""
WITH released AS (
  UPDATE {LEASE_TABLE} SET holder = NULL, expires_at = clock_timestamp()
  WHERE name = %s AND holder = %s AND token = %s
  RETURNING name, token
)
SELECT token, pg_catalog.pg_notify('{NOTIFY_CHANNEL}', name) FROM released
"""

FENCE_SQL: Final = f"""
SELECT token FROM {LEASE_TABLE}
WHERE name = %s AND holder = %s AND token = %s AND expires_at > clock_timestamp()
FOR KEY SHARE
"""

ROW_COLUMNS: Final = """
SELECT name, holder, token,
       EXTRACT(EPOCH FROM clock_timestamp() - acquired_at)::float8,
       CASE WHEN holder IS NULL THEN NULL
            ELSE EXTRACT(EPOCH FROM expires_at - clock_timestamp())::float8 END
"""
ROWS_SQL: Final = f"{ROW_COLUMNS} FROM {LEASE_TABLE} WHERE name = ANY(%s::text[])"
LIST_SQL: Final = f"{ROW_COLUMNS} FROM {LEASE_TABLE} ORDER BY name"

PRUNE_SQL: Final = f"""
WITH pruned AS (
  UPDATE {LEASE_TABLE} SET holder = NULL
  WHERE holder IS NOT NULL
    AND expires_at < clock_timestamp() - %s::float8 * interval '1 second'
  RETURNING 1
)
SELECT count(*) FROM pruned
"""

_advisory = PostgresBackend()


class PostgresLeaseBackend:
    """Lease rows on PostgreSQL (and servers that speak its SQL)."""

    dialect_name = "postgresql"
    # One array parameter carries any number of names.
    renew_batch_size = 10_000
    listen_sql: str | None = f"LISTEN {NOTIFY_CHANNEL}"

    def create_table(self) -> list[str]:
        return [CREATE_TABLE_SQL]

    def system_name(self, state: dict[str, Any]) -> str:
        return self.dialect_name

    def check_database(self, state: dict[str, Any]) -> StatementSteps[None]:
        yield from ()

    def renewer_setup(self, renew_every: float) -> list[str]:
        return []

    def acquire(
        self, state: dict[str, Any], name: str, holder: str, ttl: float, *, lock_wait: Timeout
    ) -> StatementSteps[Attempt]:
        try:
            rows = yield Statement(
                ROWS, ACQUIRE_SQL, (name, holder, ttl, str(_lock_timeout_ms(lock_wait)))
            )
        except Exception as error:
            if self.is_busy(error):
                return Attempt(None)  # a fenced transaction keeps the row locked
            raise
        if rows:
            return Attempt(int(rows[0][0]))
        current = yield from self.rows([name])
        # Freed since the attempt (expires_in None): worth trying again at once.
        return Attempt(None, (current[0].expires_in or 0.0) if current else 0.0)

    def renew(self, leases: Sequence[tuple[str, str, int]], ttl: float) -> StatementSteps[set[str]]:
        names = [name for name, _holder, _token in leases]
        holders = [holder for _name, holder, _token in leases]
        tokens = [token for _name, _holder, token in leases]
        rows = yield Statement(ROWS, RENEW_SQL, (names, holders, tokens, ttl))
        return {str(row[0]) for row in rows}

    def release(self, name: str, holder: str, token: int) -> StatementSteps[bool]:
        rows = yield Statement(ROWS, RELEASE_SQL, (name, holder, token))
        return bool(rows)

    def fence(self, name: str, holder: str, token: int) -> StatementSteps[bool]:
        rows = yield Statement(ROWS, FENCE_SQL, (name, holder, token))
        return bool(rows)

    def rows(self, names: Sequence[str]) -> StatementSteps[list[LeaseRow]]:
        found = yield Statement(ROWS, ROWS_SQL, (list(names),))
        return [_lease_row(row) for row in found]

    def list_leases(self) -> StatementSteps[list[LeaseRow]]:
        found = yield Statement(ROWS, LIST_SQL)
        return [_lease_row(row) for row in found]

    def prune(self, expired_for: float) -> StatementSteps[int]:
        rows = yield Statement(ROWS, PRUNE_SQL, (expired_for,))
        return int(rows[0][0])

    def is_missing_table(self, error: BaseException) -> bool:
        return sqlstate_of(error) == UNDEFINED_TABLE

    def is_connection_failure(self, error: BaseException) -> bool:
        return _advisory.is_connection_failure(error)

    def is_busy(self, error: BaseException) -> bool:
        # lock_timeout ran out (the acquire's own, or one the server or role sets).
        return sqlstate_of(error) == LOCK_NOT_AVAILABLE


def _lock_timeout_ms(lock_wait: Timeout) -> int:
    if lock_wait is None:
        return 0
    # Capped before rounding: a huge finite wait's milliseconds overflow a float.
    milliseconds = math.ceil(min(lock_wait, MAX_WAIT_MS / 1000) * 1000)
    return min(MAX_WAIT_MS, max(NO_WAIT_MS, milliseconds))


def _lease_row(row: Sequence[Any]) -> LeaseRow:
    name, holder, token, held_for, expires_in = row
    return LeaseRow(
        name=str(name),
        holder=None if holder is None else str(holder),
        token=int(token),
        held_for=None if held_for is None else float(held_for),
        expires_in=None if expires_in is None else float(expires_in),
    )
