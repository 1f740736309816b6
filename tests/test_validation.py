"""Bad input fails with a clear error before any SQL; odd but valid names are plain data.

"Before any SQL" is shown on a fresh engine: its pool never connects (a ``connect`` event
counter stays at zero) and has nothing checked out afterwards.
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session, sessionmaker

from advisory_locks import AdvisoryLockError, advisory_lock, current_advisory_locks
from advisory_locks.sqlalchemy import SyncBind
from tests.databases import psycopg_connect
from tests.helpers import holder_pids, lock_rows, record_statements

Admin = psycopg.Connection[TupleRow]

# PostgreSQL's lock_timeout is an int in milliseconds.
LARGEST_TIMEOUT_SECONDS = (2**31 - 1) / 1000


class UntouchedEngine:
    """A fresh engine that counts every connection its pool opens."""

    def __init__(self, url: URL) -> None:
        self.engine = create_engine(url)
        self.connects = 0
        event.listen(self.engine, "connect", self._connected)

    def _connected(self, *arguments: Any) -> None:
        self.connects += 1

    def assert_no_sql_was_sent(self) -> None:
        assert self.connects == 0
        assert self.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


@pytest.fixture
def untouched(postgres_url: URL) -> Iterator[UntouchedEngine]:
    engine = UntouchedEngine(postgres_url)
    yield engine
    engine.engine.dispose()


@pytest.fixture(params=["engine", "session"])
def make_bind(
    request: pytest.FixtureRequest, untouched: UntouchedEngine
) -> Iterator[Callable[[], SyncBind]]:
    """Binds that do not connect until a lock needs SQL."""
    with contextlib.ExitStack() as closing:

        def make() -> SyncBind:
            if request.param == "engine":
                return untouched.engine
            return closing.enter_context(Session(untouched.engine))

        yield make


BAD_NAMES: list[tuple[object, type[Exception]]] = [
    (True, TypeError),
    (False, TypeError),
    (1.0, TypeError),
    (None, TypeError),
    (b"bytes", TypeError),
    (bytearray(b"bytes"), TypeError),
    (["a list"], TypeError),
    ([1, 2], TypeError),
    ({"a set"}, TypeError),
    ("", ValueError),
    (2**63, ValueError),
    (-(2**63) - 1, ValueError),
    ((), TypeError),
    ((1,), TypeError),
    ((1, 2, 3), TypeError),
    ((1, "2"), TypeError),
    ((True, 1), TypeError),
    ((1.0, 2), TypeError),
    ((None, None), TypeError),
    ((2**31, 0), ValueError),
    ((0, -(2**31) - 1), ValueError),
    ("lone surrogate \ud800", ValueError),
]


@pytest.mark.parametrize(("name", "error"), BAD_NAMES, ids=[repr(name) for name, _ in BAD_NAMES])
def test_bad_name_is_rejected_before_any_sql(
    name: Any, error: type[Exception], make_bind: Callable[[], SyncBind], untouched: UntouchedEngine
) -> None:
    with pytest.raises(error):
        advisory_lock(make_bind(), name)
    untouched.assert_no_sql_was_sent()


BAD_TIMEOUTS: list[tuple[object, type[Exception]]] = [
    (-1, ValueError),
    (-0.001, ValueError),
    (float("nan"), ValueError),
    (float("inf"), ValueError),
    (float("-inf"), ValueError),
    (LARGEST_TIMEOUT_SECONDS + 0.001, ValueError),
    (10**12, ValueError),
    (1.8e305, ValueError),  # finite, but its milliseconds overflow a float
    (sys.float_info.max, ValueError),
    (10**400, ValueError),  # an int too large for a float at all
    ("5", TypeError),
    (True, TypeError),
    (False, TypeError),
    ([5], TypeError),
]


@pytest.mark.parametrize(
    ("timeout", "error"),
    BAD_TIMEOUTS,
    ids=[repr(timeout) if timeout != 10**400 else "10**400" for timeout, _ in BAD_TIMEOUTS],
)
def test_bad_timeout_is_rejected_before_any_sql(
    timeout: Any,
    error: type[Exception],
    make_bind: Callable[[], SyncBind],
    untouched: UntouchedEngine,
) -> None:
    with pytest.raises(error):
        advisory_lock(make_bind(), "a good name", timeout=timeout)
    untouched.assert_no_sql_was_sent()


def test_a_timeout_with_more_digits_than_repr_converts_is_named_by_its_size(
    make_bind: Callable[[], SyncBind], untouched: UntouchedEngine
) -> None:
    with pytest.raises(ValueError, match="finite seconds > 0, not an integer of 16610 bits"):
        advisory_lock(make_bind(), "a good name", timeout=10**5000)
    untouched.assert_no_sql_was_sent()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"key_scheme": "md5"}, ValueError),
        ({"key_scheme": "rails", "key_prefix": "not a number"}, ValueError),
        ({"key_prefix": 1.5}, TypeError),
    ],
    ids=["unknown-scheme", "rails-text-prefix", "float-prefix"],
)
def test_bad_key_option_is_rejected_before_any_sql(
    options: dict[str, Any],
    error: type[Exception],
    make_bind: Callable[[], SyncBind],
    untouched: UntouchedEngine,
) -> None:
    with pytest.raises(error):
        advisory_lock(make_bind(), "a good name", **options)
    untouched.assert_no_sql_was_sent()


@pytest.mark.parametrize("option", ["shared", "transaction"])
@pytest.mark.parametrize("value", ["no", 1, None], ids=repr)
def test_mode_flag_that_is_not_a_bool_is_rejected_before_any_sql(
    option: str, value: object, make_bind: Callable[[], SyncBind], untouched: UntouchedEngine
) -> None:
    # "no" is truthy: accepting it would quietly take a shared or transaction lock.
    with pytest.raises(TypeError, match=option):
        advisory_lock(make_bind(), "a good name", **{option: value})  # type: ignore[arg-type]
    untouched.assert_no_sql_was_sent()


def test_creating_a_lock_sends_no_sql_until_it_is_acquired(
    make_bind: Callable[[], SyncBind], untouched: UntouchedEngine
) -> None:
    advisory_lock(make_bind(), "a good name", timeout=1, shared=True)
    untouched.assert_no_sql_was_sent()


@pytest.mark.parametrize(
    "bind",
    [None, "postgresql://postgres@127.0.0.1/test", object(), 42, sessionmaker()],
    ids=["None", "url-string", "object", "int", "sessionmaker"],
)
def test_bind_that_is_not_a_session_connection_or_engine_raises_type_error(bind: Any) -> None:
    with pytest.raises(TypeError):
        advisory_lock(bind, "a good name")


def test_a_raw_psycopg_connection_is_a_bind(pg_admin: Admin) -> None:
    # Raw drivers are binds of their own (tests/test_raw_postgres.py covers them).
    with advisory_lock(pg_admin, "a good name " + str(uuid.uuid4()), timeout=0) as lock:
        assert lock.held


def test_an_object_no_binding_understands_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"not builtins\.object"):
        advisory_lock(object(), "a good name")


def test_bad_input_on_a_raw_connection_fails_before_touching_it(postgres_url: URL) -> None:
    # A closed connection answers any statement with an error of its own (ConnectionGone):
    # the validation errors prove nothing reached it.
    closed = psycopg_connect(postgres_url)
    closed.close()
    with pytest.raises(TypeError):
        advisory_lock(closed, b"bytes")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="timeout"):
        advisory_lock(closed, "a good name", timeout=-1)
    with pytest.raises(TypeError, match="shared"):
        advisory_lock(closed, "a good name", shared="yes")  # type: ignore[call-overload]
    with pytest.raises(AdvisoryLockError, match="closed"):
        advisory_lock(closed, "a good name").acquire()


def test_current_advisory_locks_of_a_non_bind_raises_type_error() -> None:
    with pytest.raises(TypeError):
        current_advisory_locks("postgresql://postgres@127.0.0.1/test")  # type: ignore[arg-type]


def test_largest_timeout_postgresql_accepts_is_allowed(pg_engine: Engine, pg_admin: Admin) -> None:
    name = f"largest timeout {uuid.uuid4()}"
    with (
        pg_engine.connect() as connection,
        advisory_lock(connection, name, timeout=LARGEST_TIMEOUT_SECONDS),
    ):
        assert len(holder_pids(pg_admin, name)) == 1


# -- hostile but valid names are data, never SQL -------------------------------------------

HOSTILE_NAMES = {
    "single-quote": "'; DROP TABLE users; --",
    "double-quote": 'say "hello"',
    "dollar-quote": "$$; SELECT pg_advisory_unlock_all(); $$",
    "placeholders": "%s %(name)s $1 ? :name {}",
    "backslashes": "C:\\new\\table\\",
    "nul": "before\x00after",
    "ten-thousand-chars": "x" * 10_000,
    "emoji": "🔒 checkout 🛒",
    "right-to-left": "\u202eevil\u202c",
    "newlines": "line one\nline two\r\n\t",
    "sql-statement": "SELECT pg_terminate_backend(pg_backend_pid())",
}


@pytest.mark.parametrize("name", list(HOSTILE_NAMES.values()), ids=list(HOSTILE_NAMES))
def test_hostile_name_is_acquired_and_released_on_the_server(
    name: str, pg_engine: Engine, pg_admin: Admin
) -> None:
    name = f"{name} {uuid.uuid4()}"
    with pg_engine.connect() as connection:
        with advisory_lock(connection, name):
            assert len(holder_pids(pg_admin, name)) == 1
        assert lock_rows(pg_admin, name) == []


@pytest.mark.parametrize("name", list(HOSTILE_NAMES.values()), ids=list(HOSTILE_NAMES))
def test_hostile_name_never_appears_in_sql_text(name: str, postgres_url: URL) -> None:
    engine = create_engine(postgres_url)
    statements = record_statements(engine)
    name = f"{name} {uuid.uuid4()}"
    try:
        with Session(engine) as session, advisory_lock(session, name, timeout=5):
            pass
        assert statements, "the recorder saw the lock's SQL"
        assert not [statement for statement in statements if name in statement]
    finally:
        engine.dispose()
