"""The fault specs that apply to MySQL/MariaDB (``GET_LOCK``), against the real server.

A killed connection is learned through ``ensure_held()`` (``IS_USED_LOCK`` is this
connection's id) or at release; lock sets keep crossed requests from deadlocking; no
name provokes an SQL error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL

from advisory_locks import LockLost, advisory_lock, advisory_lock_set, current_advisory_locks
from advisory_locks.backends.mysql import server_lock_name
from advisory_locks.keys import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, derive_key
from tests.databases import pymysql_connect
from tests.faults.conftest import inject
from tests.faults.test_hostile_names import SETTINGS, counted
from tests.helpers import open_bind, unique_name, wait_for

pytestmark = pytest.mark.faults

BINDS = ["engine", "connection", "session"]
JOIN_SECONDS = 60.0


@pytest.fixture
def my_admin(mysql_url: URL) -> Iterator[Any]:
    admin = pymysql_connect(mysql_url)
    admin.autocommit(True)
    yield admin
    admin.close()


def holder_id(admin: Any, name: str) -> int | None:
    with admin.cursor() as cursor:
        cursor.execute("SELECT IS_USED_LOCK(%s)", (server_lock_name(derive_key(name)),))
        (connection_id,) = cursor.fetchone()
    return None if connection_id is None else int(connection_id)


def kill_holder(admin: Any, name: str) -> None:
    connection_id = holder_id(admin, name)
    assert connection_id is not None
    with admin.cursor() as cursor:
        cursor.execute(f"KILL {connection_id}")
    inject("MySQL connection killed")
    wait_for(lambda: holder_id(admin, name) is None, "the server drops the killed holder's lock")


@pytest.mark.parametrize("kind", BINDS)
def test_mysql_ensure_held_raises_lock_lost_after_the_connection_was_killed(
    kind: str, make_engine: Callable[..., Engine], mysql_url: URL, my_admin: Any
) -> None:
    name = unique_name()
    with open_bind(kind, make_engine(mysql_url)) as bind:
        lock = advisory_lock(bind, name)
        lock.acquire()
        lock.ensure_held()
        kill_holder(my_admin, name)
        with pytest.raises(LockLost):
            lock.ensure_held()
        with pytest.raises(LockLost):
            lock.release()


def test_mysql_crossed_names_taken_as_lock_sets_never_deadlock(
    make_engine: Callable[..., Engine], mysql_url: URL
) -> None:
    engine = make_engine(mysql_url, pool_size=4)
    first, second = unique_name("first"), unique_name("second")
    barrier = threading.Barrier(2, timeout=JOIN_SECONDS)
    errors: list[BaseException] = []

    def take(mine: str, theirs: str) -> None:
        try:
            with engine.connect() as connection:
                for _ in range(25):
                    barrier.wait()
                    with advisory_lock_set(connection, [mine, theirs]) as locks:
                        assert locks.held
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [
        threading.Thread(target=take, args=(first, second), daemon=True),
        threading.Thread(target=take, args=(second, first), daemon=True),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_SECONDS)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []


@pytest.fixture(scope="module")
def my_connection(mysql_url: URL) -> Iterator[Connection]:
    from sqlalchemy import create_engine

    engine = create_engine(mysql_url)
    with engine.connect() as connection:
        yield connection
    engine.dispose()


@settings(SETTINGS, max_examples=500)
@given(
    name=st.one_of(
        st.text(min_size=1),
        st.integers(INT64_MIN, INT64_MAX),
        st.tuples(st.integers(INT32_MIN, INT32_MAX), st.integers(INT32_MIN, INT32_MAX)),
    )
)
def test_mysql_any_valid_name_is_taken_and_given_back_without_an_sql_error(
    my_connection: Connection, name: str | int | tuple[int, int]
) -> None:
    counted("names taken and released on MySQL/MariaDB")
    try:
        lock = advisory_lock(my_connection, name, timeout=0)
    except ValueError:
        assert isinstance(name, str)  # not valid Unicode: no UTF-8 bytes to send
        return
    with lock:
        assert name in current_advisory_locks(my_connection)
        lock.ensure_held()
    assert current_advisory_locks(my_connection) == []
