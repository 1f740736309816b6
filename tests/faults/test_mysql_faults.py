"""The fault specs that apply to MySQL/MariaDB (``GET_LOCK``) alone, against the real server.

Lock sets keep crossed requests from deadlocking; no name provokes an SQL error. The
faults every database shares (killed holders, killed connections, pools, soak) run on
MariaDB through the ``database`` and ``target`` fixtures of the other files.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL

from advisory_locks import advisory_lock, advisory_lock_set, current_advisory_locks
from advisory_locks.keys import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN
from tests.faults.test_hostile_names import SETTINGS, counted
from tests.helpers import run_crossed

pytestmark = pytest.mark.faults

BINDS = ["engine", "connection", "session"]
JOIN_SECONDS = 60.0


def test_mysql_crossed_names_taken_as_lock_sets_never_deadlock(
    make_engine: Callable[..., Engine], mysql_url: URL
) -> None:
    engine = make_engine(mysql_url, pool_size=4)
    barrier = threading.Barrier(2, timeout=JOIN_SECONDS)

    def take(mine: str, theirs: str) -> None:
        with engine.connect() as connection:
            for _ in range(25):
                barrier.wait()
                with advisory_lock_set(connection, [mine, theirs]) as locks:
                    assert locks.held

    run_crossed(take, join_seconds=JOIN_SECONDS)


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
