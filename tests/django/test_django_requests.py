"""Real requests through Django's WSGIHandler with persistent connections
(``CONN_MAX_AGE``) and ``CONN_HEALTH_CHECKS``, on PostgreSQL and MariaDB.

Django checks a persistent connection at its first use in a request (``_cursor()`` calls
``close_if_health_check_failed()``, once per request) and replaces one the server ended
between requests. The library's first use of the connection in a request must do the
same, and add no round trip where Django would not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
from django.db import connections
from sqlalchemy.engine import URL

from advisory_locks_django import advisory_lock, lease_lock
from tests.databases import psycopg_connect, pymysql_connect
from tests.django.real_requests import wsgi_worker
from tests.django.test_django_leases import _create_table
from tests.django_aliases import aim_django_alias
from tests.helpers import backend_alive, unique_name, wait_for

Kill = Callable[[Any], None]


def _postgres_kill(postgres_url: URL) -> Iterator[Kill]:
    with psycopg_connect(postgres_url, autocommit=True) as admin:

        def kill(dbapi_connection: Any) -> None:
            pid = dbapi_connection.info.backend_pid
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])
            wait_for(lambda: not backend_alive(admin, pid), "the backend has exited")

        yield kill


def _mysql_kill(mysql_url: URL) -> Iterator[Kill]:
    admin = pymysql_connect(mysql_url)
    admin.autocommit(True)

    def alive(session: int) -> bool:
        with admin.cursor() as cursor:
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s", (session,)
            )
            return bool(cursor.fetchone()[0])

    def kill(dbapi_connection: Any) -> None:
        session = int(dbapi_connection.thread_id())
        with admin.cursor() as cursor:
            cursor.execute(f"KILL CONNECTION {session}")
        wait_for(lambda: not alive(session), "the server ended the session")

    try:
        yield kill
    finally:
        admin.close()


@pytest.fixture(
    params=[
        pytest.param("default", id="postgresql", marks=pytest.mark.postgresql),
        pytest.param("mysql", id="mariadb"),
    ]
)
def checked_alias(
    request: pytest.FixtureRequest, django_db_blocker: Any
) -> Iterator[tuple[str, Kill]]:
    """An alias with CONN_MAX_AGE=600 and CONN_HEALTH_CHECKS=True, its lease table made,
    and a way to end a DB-API connection's server session from outside."""
    alias: str = request.param
    if alias == "default":
        request.getfixturevalue("django_db_setup")  # the migrated test database
        url: URL = request.getfixturevalue("postgres_url")
        kills = _postgres_kill(url.set(database=connections.settings[alias]["NAME"]))
    else:
        url = request.getfixturevalue("mysql_url")
        aim_django_alias(alias, url)
        kills = _mysql_kill(url)
    settings = connections.settings[alias]
    previous = settings["CONN_MAX_AGE"], settings["CONN_HEALTH_CHECKS"]
    settings["CONN_MAX_AGE"], settings["CONN_HEALTH_CHECKS"] = 600, True
    try:
        with django_db_blocker.unblock():
            if alias != "default":
                _create_table(alias)
            connections[alias].close()
            yield alias, next(kills)
    finally:
        settings["CONN_MAX_AGE"], settings["CONN_HEALTH_CHECKS"] = previous
        kills.close()


def _lock(kind: str, name: str, alias: str) -> AbstractContextManager[Any]:
    if kind == "advisory_lock":
        return advisory_lock(name, using=alias, timeout=0)
    return lease_lock(name, using=alias, timeout=0, ttl=30, key_prefix="")


@pytest.mark.parametrize("kind", ["advisory_lock", "lease_lock"])
def test_a_requests_first_lock_after_its_connection_was_killed_reconnects_as_django_does(
    checked_alias: tuple[str, Kill], kind: str
) -> None:
    alias, kill = checked_alias
    name = unique_name("health-check")
    box: dict[str, Any] = {}

    def take() -> str:
        with _lock(kind, name, alias):
            box["connection"] = connections[alias].connection
        return "taken"

    with wsgi_worker() as worker:
        first = worker.request(take)
        assert (first.body, first.error) == ("'taken'", None)
        killed = box.pop("connection")
        kill(killed)
        # Django's health check at the request's first use of the connection finds it
        # gone and connects anew, as it does for an ORM query.
        second = worker.request(take)
        assert (second.body, second.error) == ("'taken'", None)
        assert box["connection"] is not killed
        third = worker.request(take)  # the same, still open, connection
        assert (third.body, third.error) == ("'taken'", None)


@pytest.mark.parametrize("kind", ["advisory_lock", "lease_lock"])
def test_a_requests_later_locks_and_healthy_connections_cost_no_health_check(
    checked_alias: tuple[str, Kill], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once per request, as Django's own cursor: the check (one round trip) runs at the
    # first use only, and never with CONN_HEALTH_CHECKS off.
    alias, _ = checked_alias
    name = unique_name("health-check-once")
    checks: list[str] = []
    wrapper_class = type(connections[alias])
    is_usable = wrapper_class.is_usable

    def counted(self: Any) -> bool:
        checks.append(self.alias)
        return bool(is_usable(self))

    monkeypatch.setattr(wrapper_class, "is_usable", counted)

    def take_twice() -> int:
        for _ in range(2):
            with _lock(kind, name, alias):
                pass
        return len(checks)

    with wsgi_worker() as worker:
        assert worker.request(take_twice).body == "0"  # a new connection needs no check
        assert worker.request(take_twice).body == "1"  # a kept one is checked, once
        connections.settings[alias]["CONN_HEALTH_CHECKS"] = False
        worker.request(lambda: connections[alias].close())
        checks.clear()
        assert worker.request(take_twice).body == "0"
        assert worker.request(take_twice).body == "0"
