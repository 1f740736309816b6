"""Pruning: ``prune_leases()`` and ``advisory-locks leases --prune`` clear the holders of
leases expired for longer than an age, by the database's clock, and never delete a row:
a pruned name's next acquire gets the next token; a live lease is never pruned."""

from __future__ import annotations

import datetime
import json
import uuid
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.orm import Session

import advisory_locks
import advisory_locks.sqlalchemy
from advisory_locks import LeaseTableMissing, lease_lock, prune_leases
from advisory_locks._core.renewer import renewer
from advisory_locks.cli import main
from tests.lease.conftest import LeaseDatabase

EXPIRED_AGO = {
    "postgresql": "clock_timestamp() - :seconds * interval '1 second'",
    "mariadb": "UTC_TIMESTAMP(6) - INTERVAL :seconds SECOND",
    "sqlite": "strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || :seconds || ' seconds')",
}


def unique() -> str:
    return f"lease-prune:{uuid.uuid4()}"


def abandoned(lease_db: LeaseDatabase, name: str, expired_seconds_ago: int) -> int:
    """Take ``name``, stop renewing it (as a crashed holder would) and make the database
    see it expired that long ago; return its token."""
    lease = lease_lock(lease_db.engine, name, ttl=30, timeout=0)
    assert lease.acquire()
    renewer().forget(lease._holding)  # type: ignore[arg-type]
    with lease_db.admin.connect() as connection:
        connection.execute(
            text(
                f"UPDATE advisory_locks_lease SET expires_at = {EXPIRED_AGO[lease_db.kind]} "
                "WHERE name = :name"
            ),
            {"name": name, "seconds": expired_seconds_ago},
        )
    assert lease.token is not None
    return lease.token


def test_a_pruned_lease_keeps_its_row_and_its_next_acquire_gets_the_next_token(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    token = abandoned(lease_db, name, expired_seconds_ago=600)
    assert prune_leases(lease_db.engine, older_than=60) >= 1
    row = lease_db.row(name)
    assert row is not None
    assert (row.holder, row.token) == (None, token)
    with lease_lock(lease_db.engine, name, timeout=0) as lease:
        assert lease.token == token + 1


def test_a_live_lease_is_never_pruned_and_a_recent_expiry_is_kept_for_its_age(
    lease_db: LeaseDatabase,
) -> None:
    live, recent, old = unique(), unique(), unique()
    abandoned(lease_db, recent, expired_seconds_ago=30)
    abandoned(lease_db, old, expired_seconds_ago=7200)
    with lease_lock(lease_db.engine, live, ttl=30, timeout=0) as lease:
        assert prune_leases(lease_db.engine, older_than=datetime.timedelta(hours=1)) >= 1
        assert lease_db.row(old).holder is None  # type: ignore[union-attr]
        assert lease_db.row(recent).holder is not None  # type: ignore[union-attr]
        prune_leases(lease_db.engine, older_than=0)  # every expired lease, and only those
        assert lease_db.row(recent).holder is None  # type: ignore[union-attr]
        assert lease_db.row(live).holder is not None  # type: ignore[union-attr]
        lease.ensure_held()
        assert lease.held


def test_prune_takes_a_session_or_connection_and_leaves_its_transaction_alone(
    lease_db: LeaseDatabase,
) -> None:
    name = unique()
    abandoned(lease_db, name, expired_seconds_ago=600)
    with Session(lease_db.engine) as session:
        assert advisory_locks.sqlalchemy.prune_leases(session, older_than=60) >= 1
        assert not session.in_transaction()
    assert lease_db.row(name).holder is None  # type: ignore[union-attr]
    with lease_db.engine.connect() as connection:
        assert prune_leases(connection, older_than=60) == 0
        assert not connection.in_transaction()


@pytest.mark.parametrize(
    ("age", "error"),
    [
        (-1, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (datetime.timedelta(seconds=-5), ValueError),
        (200 * 365 * 86400, ValueError),
        pytest.param(10**400, ValueError, id="10**400"),  # too large for a float at all
        ("3600", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
)
def test_a_bad_age_is_refused_before_any_sql(
    lease_db: LeaseDatabase, age: Any, error: type
) -> None:
    statements: list[str] = []
    engine = create_engine(lease_db.url)

    @event.listens_for(engine, "before_cursor_execute")
    def seen(*arguments: Any) -> None:
        statements.append(arguments[2])

    with pytest.raises(error, match="older_than"):
        prune_leases(engine, older_than=age)
    assert statements == []
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    engine.dispose()


def test_prune_refuses_an_async_engine_before_any_sql(postgres_url: Any) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(postgres_url.set(drivername="postgresql+psycopg"))
    with pytest.raises(advisory_locks.UnsupportedFeature, match="blocking bind"):
        prune_leases(engine, older_than=0)


def test_prune_without_the_table_says_how_to_create_it(tmp_path: Any) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'empty.sqlite'}")
    with pytest.raises(LeaseTableMissing, match="create_lease_table"):
        prune_leases(engine, older_than=0)
    engine.dispose()


def test_cli_prune_clears_old_holders_and_refuses_bad_ages(
    lease_db: LeaseDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    url = lease_db.url.render_as_string(hide_password=False)
    old = unique()
    token = abandoned(lease_db, old, expired_seconds_ago=3 * 3600)
    with lease_lock(lease_db.engine, unique(), ttl=30, timeout=0) as live:
        assert main(["leases", "--url", url, "--prune", "2h", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["pruned"] >= 1
        assert lease_db.row(old).holder is None  # type: ignore[union-attr]
        assert main(["leases", "--url", url, "--prune", "0"]) == 0
        assert capsys.readouterr().out.startswith("Pruned ")
        live.ensure_held()
    with lease_lock(lease_db.engine, old, timeout=0) as lease:
        assert lease.token == token + 1
    for bad in ("-5", "soon", "2w", "nan", ""):
        assert main(["leases", "--url", url, "--prune", bad]) == 2
        assert "--prune" in capsys.readouterr().err
