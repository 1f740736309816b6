"""The Django app on MySQL/MariaDB and SQLite beyond the contract suite: the management
command there, and SQLite file locks that end with the Django connection that took them.

What every database shares through Django (exclusion, timeouts, refusals, ...) is
specified once in tests/contract, whose targets include the Django binding.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.core.signals import request_finished
from django.db import connections
from sqlalchemy.engine import URL

from advisory_locks import LockLost, LockUsageError, UnsupportedFeature
from advisory_locks._dialects.mysql import server_lock_name
from advisory_locks.keys import derive_key, lock_key
from advisory_locks_django import advisory_lock
from tests.databases import pymysql_connect
from tests.django.support import in_thread, run_in_thread
from tests.django_aliases import aim_django_alias
from tests.helpers import unique_name


@pytest.fixture
def mysql_alias(mysql_url: URL, django_db_blocker: Any) -> Iterator[str]:
    aim_django_alias("mysql", mysql_url)
    with django_db_blocker.unblock():
        yield "mysql"
        connections["mysql"].close()


@pytest.fixture
def sqlite_alias(tmp_path: Path, django_db_blocker: Any) -> Iterator[str]:
    aim_django_alias("sqlite", URL.create("sqlite"), tmp_path / "django.sqlite3")
    with django_db_blocker.unblock():
        yield "sqlite"
        connections["sqlite"].close()


def _command(*arguments: str) -> str:
    out = io.StringIO()
    call_command("advisory_locks", *arguments, stdout=out)
    return out.getvalue()


def _server_lists_named_locks(url: URL) -> bool:
    admin = pymysql_connect(url)
    try:
        with admin.cursor() as cursor:
            cursor.execute(
                "SELECT @@performance_schema + (SELECT COUNT(*) FROM information_schema.PLUGINS "
                "WHERE PLUGIN_NAME = 'METADATA_LOCK_INFO' AND PLUGIN_STATUS = 'ACTIVE')"
            )
            return bool(cursor.fetchone()[0])
    finally:
        admin.close()


# -- the management command on MySQL/MariaDB ------------------------------------------------


def test_key_with_dialect_mysql_prints_the_get_lock_name() -> None:
    output = _command("key", "Nightly-Report", "--dialect", "mysql")
    assert output.splitlines()[0] == server_lock_name(derive_key("Nightly-Report"))
    assert "SELECT GET_LOCK(" in output


def test_key_for_a_mysql_alias_prints_the_get_lock_name() -> None:
    # The alias's engine says what the server sees; no connection is needed for that.
    assert _command("key", "nightly-report", "--database", "mysql").splitlines()[0] == (
        "nightly-report"
    )


def test_key_for_a_postgresql_alias_prints_the_integer_key() -> None:
    first_line = _command("key", "nightly-report", "--database", "default").splitlines()[0]
    assert first_line == str(lock_key("nightly-report"))


def test_key_json_for_mysql_carries_the_lock_name_and_sql() -> None:
    document = json.loads(_command("key", "job", "--dialect", "mysql", "--json"))
    assert document["mysql_lock_name"] == "job"
    assert document["lock_sql"] == "SELECT GET_LOCK('job', -1);"


def test_list_on_mysql_shows_a_held_lock_or_says_how_to_expose_locks(
    mysql_alias: str, mysql_url: URL
) -> None:
    name = unique_name("listed")
    with advisory_lock(name, using=mysql_alias):
        if _server_lists_named_locks(mysql_url):
            output = _command("list", "--database", mysql_alias)
            assert server_lock_name(derive_key(name)) in output
            assert repr(name) in output.split("this process can tell:")[1]
        else:
            with pytest.raises(CommandError, match="metadata_lock_info") as raised:
                _command("list", "--database", mysql_alias)
            assert "cannot list locks on database 'mysql'" in str(raised.value)


def test_list_on_sqlite_points_to_the_lock_files(sqlite_alias: str) -> None:
    with pytest.raises(CommandError, match="lsof"):
        _command("list", "--database", sqlite_alias)


# -- SQLite: file locks end with the Django connection --------------------------------------


def _free_in_another_thread(name: str, using: str) -> bool:
    def try_lock() -> bool:
        lock = advisory_lock(name, using=using, timeout=0)
        if not lock.acquire():
            return False
        lock.release()
        return True

    return bool(in_thread(try_lock))


def test_closing_the_django_connection_frees_its_sqlite_locks_by_the_request_end(
    sqlite_alias: str,
) -> None:
    name = unique_name("closed")
    advisory_lock(name, using=sqlite_alias).acquire()
    connections[sqlite_alias].close()
    request_finished.send(sender=None)
    assert _free_in_another_thread(name, sqlite_alias)


def test_releasing_after_the_sqlite_connection_closed_raises_lock_lost(
    sqlite_alias: str,
) -> None:
    name = unique_name("lost")
    lock = advisory_lock(name, using=sqlite_alias)
    lock.acquire()
    connections[sqlite_alias].close()
    with pytest.raises(LockLost):
        lock.release()
    assert _free_in_another_thread(name, sqlite_alias)


def test_a_sqlite_lock_outlives_commits_on_its_django_connection(sqlite_alias: str) -> None:
    from django.db import transaction

    name = unique_name("commit")
    with advisory_lock(name, using=sqlite_alias):
        with transaction.atomic(using=sqlite_alias):
            connections[sqlite_alias].cursor().execute("CREATE TABLE t (x)")
        assert not _free_in_another_thread(name, sqlite_alias)


# -- a lock is released in the thread that took it -------------------------------------------


@pytest.mark.parametrize("alias_fixture", ["mysql_alias", "sqlite_alias"])
def test_a_release_from_another_thread_is_refused_while_the_holder_queries(
    alias_fixture: str, request: pytest.FixtureRequest
) -> None:
    # The unlock would go out on the holder's connection in the middle of its query (on
    # PyMySQL: "Packet sequence number wrong", then a closed connection): refused unsent.
    alias = request.getfixturevalue(alias_fixture)
    name = unique_name("xthread")
    lock = advisory_lock(name, using=alias)
    assert lock.acquire()
    try:
        releaser = run_in_thread(lambda: (time.sleep(0.3), lock.release()))
        with connections[alias].cursor() as cursor:
            if connections[alias].vendor == "mysql":
                cursor.execute("SELECT SLEEP(1), 7")
            else:
                cursor.execute("SELECT 0, 7")
                releaser.thread.join(10)
            assert list(cursor.fetchall()) == [(0, 7)]
        with pytest.raises(LockUsageError, match="release it in that thread"):
            releaser.get()
        assert lock.held
        assert not _free_in_another_thread(name, alias)
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT 8")
            assert list(cursor.fetchall()) == [(8,)]
    finally:
        lock.release()
    assert _free_in_another_thread(name, alias)


# -- what the refusals say ------------------------------------------------------------------


@pytest.mark.parametrize("alias_fixture", ["mysql_alias", "sqlite_alias"])
def test_refusing_a_transaction_lock_speaks_no_sqlalchemy(
    alias_fixture: str, request: pytest.FixtureRequest
) -> None:
    # The advice must make sense to a Django user: no Session, no session.commit().
    alias = request.getfixturevalue(alias_fixture)
    with pytest.raises(UnsupportedFeature) as refused:
        advisory_lock(unique_name(), using=alias, transaction=True).acquire()
    message = str(refused.value)
    assert "transaction=False" in message
    assert "session." not in message
    assert "advisory_lock(session" not in message
