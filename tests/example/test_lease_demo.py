"""`manage.py lease_demo` end to end: real worker processes (`manage.py feed_checker`), one
frozen with SIGSTOP past its ttl and resumed, on a fresh database of each kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.example.test_checkout_race import (  # noqa: F401 - fixtures
    MANAGE,
    fresh_mariadb_database,
    fresh_postgresql_database,
    tables_in,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(__import__("signal"), "SIGSTOP"), reason="POSIX signals"),
]

ITEMS = 6
FREEZE_AT = 3


@pytest.fixture(
    params=[
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("mariadb", marks=pytest.mark.mysql),
        "sqlite",
    ]
)
def demo_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'demo.sqlite3'}"
    url: str = request.getfixturevalue(f"fresh_{request.param}_database")
    return url


def lease_demo(*arguments: str) -> subprocess.CompletedProcess[str]:
    inherited = {"DATABASE_URL", "DJANGO_SETTINGS_MODULE"}
    environment = {key: value for key, value in os.environ.items() if key not in inherited}
    return subprocess.run(
        [sys.executable, str(MANAGE), "lease_demo", *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        check=False,
    )


@pytest.mark.timeout(320)
def test_lease_demo_shows_takeover_stale_holder_stopping_and_fence_preventing_a_double_check(
    demo_database_url: str,
) -> None:
    finished = lease_demo(
        "--json",
        "--workers",
        "3",
        "--items",
        str(ITEMS),
        "--freeze-at",
        str(FREEZE_AT),
        "--database-url",
        demo_database_url,
    )
    assert finished.returncode == 0, finished.stderr
    result = json.loads(finished.stdout)
    assert set(result) == {"without_fence", "with_fence"}
    for run in result.values():
        # Frozen past its ttl, the holder lost the lease to the next token; resumed, it
        # learnt so (LockStolen) and stopped with exit status 3; every item got checked.
        assert run["takeover_tokens"][0] == run["stale_token"] + 1
        assert run["stale_holder_said"].startswith("stopped: LockStolen")
        assert run["stale_holder_exit"] == 3
        assert sorted(run["exit_codes"]) == [0, 0, 3]
        assert run["items_checked"] == ITEMS
    # Checking the lease after the write is too late: the item in flight is checked twice.
    assert result["without_fence"]["checked_twice"] == [FREEZE_AT]
    # fence() in the write's transaction refuses the stale holder's write.
    assert result["with_fence"]["checked_twice"] == []
    assert "froze worker" in finished.stderr
    assert "resumed worker" in finished.stderr
    if not demo_database_url.startswith("sqlite"):
        assert tables_in(demo_database_url) == []


def test_lease_demo_prints_what_each_run_showed(tmp_path: Path) -> None:
    finished = lease_demo(
        "--workers", "2", "--items", "3", "--freeze-at", "2",
        "--database-url", f"sqlite:///{tmp_path / 'demo.sqlite3'}",
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr
    out = finished.stdout
    assert "WITHOUT fence()" in out
    assert "checked twice: 1 (item 2)" in out
    assert out.rstrip().endswith("checked twice: 0")
    assert "the stale holder, resumed: stopped: LockStolen" in out
