"""``advisory-locks leases``: the lease table as the database server's clock sees it."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import create_engine

from advisory_locks import lease_lock
from advisory_locks.cli import main
from tests.lease.conftest import LeaseDatabase


def _url(lease_db: LeaseDatabase) -> str:
    return lease_db.url.render_as_string(hide_password=False)


def _listed(lease_db: LeaseDatabase, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    assert main(["leases", "--url", _url(lease_db), "--json"]) == 0
    documents: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return documents


def test_leases_lists_the_holder_token_and_expiry_of_a_held_lease(
    lease_db: LeaseDatabase, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"lease-listing:{uuid.uuid4()}"
    with lease_lock(lease_db.engine, name, ttl=30.0) as lease:
        held = {row["name"]: row for row in _listed(lease_db, capsys)}[name]
        row = lease_db.row(name)
        assert row is not None
        assert (held["held"], held["holder"], held["token"]) == (True, row.holder, lease.token)
        assert 25.0 < held["expires_in_seconds"] <= 30.0
        assert 0.0 <= held["acquired_seconds_ago"] < 5.0
        assert main(["leases", "--url", _url(lease_db)]) == 0
        table = capsys.readouterr().out
        line = next(line for line in table.splitlines() if line.startswith(name))
        assert line.split()[1:4] == ["held", str(row.holder), str(lease.token)]
        assert table.splitlines()[0].split()[:4] == ["NAME", "STATUS", "HOLDER", "TOKEN"]
    released = {row["name"]: row for row in _listed(lease_db, capsys)}[name]
    assert (released["held"], released["holder"], released["token"]) == (False, None, lease.token)
    assert main(["leases", "--url", _url(lease_db)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(name))
    assert line.split()[1:4] == ["free", "-", str(lease.token)]


def test_leases_without_the_table_says_how_to_create_it(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'empty.sqlite'}"
    create_engine(url).dispose()
    assert main(["leases", "--url", url]) == 2
    error = capsys.readouterr().err
    assert "advisory_locks_lease does not exist" in error
    assert "create_lease_table" in error
