"""``statement_timeout`` and ``lock_timeout`` the caller set: respected, and left as found.

A caller's ``statement_timeout`` cuts any wait, including ``timeout=None`` (the library
reports it as ``LockTimeout``); a caller's ``lock_timeout`` bounds ``timeout=None`` waits;
an explicit ``timeout=t`` applies to the lock wait only and the caller's setting is back
in force afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session

from advisory_locks import LockTimeout, advisory_lock
from tests.faults.conftest import inject
from tests.helpers import unique_name

pytestmark = pytest.mark.faults


@pytest.fixture
def engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine()


@pytest.fixture
def busy(engine: Engine) -> Iterator[str]:
    """A name another connection holds for the whole test."""
    name = unique_name()
    with engine.connect() as holder, advisory_lock(holder, name):
        yield name


def setting(connection: Connection, name: str) -> str:
    return str(connection.execute(text(f"SHOW {name}")).scalar_one())


def set_for_session(connection: Connection, name: str, value: str) -> None:
    connection.execute(text(f"SET {name} = '{value}'"))
    connection.commit()  # a plain SET rolled back would be undone


def test_callers_statement_timeout_cuts_a_wait_without_timeout(engine: Engine, busy: str) -> None:
    with engine.connect() as connection:
        set_for_session(connection, "statement_timeout", "200ms")
        inject("statement_timeout")
        with pytest.raises(LockTimeout, match="statement_timeout"):
            advisory_lock(connection, busy, timeout=None).acquire()
        assert setting(connection, "statement_timeout") == "200ms"


def test_callers_statement_timeout_shorter_than_the_lock_timeout_wins(
    engine: Engine, busy: str
) -> None:
    with engine.connect() as connection:
        set_for_session(connection, "statement_timeout", "200ms")
        inject("statement_timeout")
        with pytest.raises(LockTimeout), advisory_lock(connection, busy, timeout=30):
            pass
        assert setting(connection, "statement_timeout") == "200ms"


def test_statement_timeout_inside_a_transaction_leaves_it_usable_and_unchanged(
    engine: Engine, busy: str
) -> None:
    with engine.connect() as connection, connection.begin():
        connection.execute(text("SET LOCAL statement_timeout = '200ms'"))
        inject("statement_timeout")
        with pytest.raises(LockTimeout):
            advisory_lock(connection, busy, transaction=True).acquire()
        assert connection.scalar(text("SELECT 1")) == 1
        assert setting(connection, "statement_timeout") == "200ms"


def test_engine_wide_statement_timeout_cuts_a_session_lock_wait_of_a_session(
    make_engine: Callable[..., Engine], busy: str
) -> None:
    # A Session takes session locks on a connection of its own, so a SET on the
    # Session's connection would not reach it; set per engine (connect options) instead.
    engine = make_engine(connect_args={"options": "-c statement_timeout=200"})
    inject("statement_timeout")
    with Session(engine) as session, pytest.raises(LockTimeout):
        advisory_lock(session, busy).acquire()


def test_callers_lock_timeout_bounds_a_wait_without_timeout(engine: Engine, busy: str) -> None:
    with engine.connect() as connection:
        set_for_session(connection, "lock_timeout", "200ms")
        inject("lock_timeout")
        with pytest.raises(LockTimeout), advisory_lock(connection, busy, timeout=None):
            pass
        assert setting(connection, "lock_timeout") == "200ms"


@pytest.mark.parametrize("granted", [True, False])
def test_callers_session_lock_timeout_is_back_after_a_timed_acquire(
    granted: bool, engine: Engine, busy: str
) -> None:
    with engine.connect() as connection:
        set_for_session(connection, "lock_timeout", "7s")
        inject("lock_timeout")
        lock = advisory_lock(connection, unique_name() if granted else busy, timeout=0.2)
        assert lock.acquire() is granted
        assert setting(connection, "lock_timeout") == "7s"
        if granted:
            lock.release()
