"""Property-based specs (hypothesis) for names and options from untrusted input.

- Any object given as a name, key scheme, prefix, timeout or mode either maps to a valid
  key/option or raises TypeError/ValueError, before any SQL is sent.
- A name's key is the same in every process, whatever PYTHONHASHSEED.
- No name can provoke an SQL error: arbitrary names are taken and given back on the
  real server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, create_engine
from sqlalchemy.engine import URL

from advisory_locks import advisory_lock, current_advisory_locks
from advisory_locks.keys import (
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    KEY_SCHEMES,
    LockKey,
    derive_key,
)
from tests.faults.conftest import report
from tests.helpers import advisory_statements, record_statements

pytestmark = [pytest.mark.faults, pytest.mark.slow]

GENERATED: dict[str, int] = {}
SETTINGS = settings(
    database=None,  # no .hypothesis/ directory in the checkout
    deadline=None,  # real round trips vary
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def counted(test: str) -> None:
    GENERATED[test] = GENERATED.get(test, 0) + 1


# Session scope: reported once at the end, with the counts of other modules' properties.
@pytest.fixture(scope="session", autouse=True)
def report_inputs() -> Iterator[None]:
    yield
    for test, count in sorted(GENERATED.items()):
        report(f"hypothesis inputs generated: {count:6d}  {test}")


# Valid names, and values one step outside what is valid.
valid_names = st.one_of(
    st.text(min_size=1),
    st.integers(INT64_MIN, INT64_MAX),
    st.tuples(st.integers(INT32_MIN, INT32_MAX), st.integers(INT32_MIN, INT32_MAX)),
)
anything = st.one_of(
    valid_names,
    st.text(max_size=0),
    st.integers(),
    st.tuples(st.integers(), st.integers()),
    st.tuples(st.integers()),
    st.tuples(st.integers(), st.integers(), st.integers()),
    st.tuples(st.integers(), st.text()),
    st.lists(st.integers(), max_size=2),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
    st.binary(),
    st.dictionaries(st.text(), st.integers(), max_size=2),
    st.builds(object),
)


def assert_valid_key(key: LockKey, name: object) -> None:
    assert key.name == name
    if len(key.ints) == 1:
        assert INT64_MIN <= key.ints[0] <= INT64_MAX
    else:
        assert len(key.ints) == 2
        assert all(INT32_MIN <= part <= INT32_MAX for part in key.ints)
    classid, objid, objsubid = key.pg_locks_ids()
    assert 0 <= classid < 2**32
    assert 0 <= objid < 2**32
    assert objsubid == len(key.ints)


@settings(SETTINGS, max_examples=3000)
@given(name=anything, scheme=st.one_of(st.none(), st.sampled_from(KEY_SCHEMES), st.text()))
def test_any_name_maps_to_a_valid_key_or_raises_type_or_value_error(
    name: object, scheme: str | None
) -> None:
    counted("name x scheme -> key or TypeError/ValueError")
    try:
        key = derive_key(name, scheme=scheme)
    except (TypeError, ValueError):
        return
    assert_valid_key(key, name)


@settings(SETTINGS, max_examples=1000)
@given(name=st.text(min_size=1), prefix=st.one_of(st.none(), st.text(), st.integers(), anything))
def test_any_prefix_gives_a_valid_key_or_raises_type_or_value_error(
    name: str, prefix: object
) -> None:
    counted("prefix -> key or TypeError/ValueError")
    for scheme in KEY_SCHEMES:
        try:
            key = derive_key(name, scheme=scheme, prefix=prefix)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        assert_valid_key(key, name)


@pytest.fixture(scope="module")
def recorded(postgres_url: URL) -> Iterator[tuple[Connection, list[str]]]:
    engine = create_engine(postgres_url)
    statements = record_statements(engine)
    with engine.connect() as connection:
        yield connection, statements
    engine.dispose()


@settings(SETTINGS, max_examples=1000)
@given(
    name=anything,
    timeout=st.one_of(st.none(), st.floats(allow_nan=True), st.integers(), anything),
    shared=st.one_of(st.booleans(), anything),
    transaction=st.one_of(st.booleans(), anything),
)
def test_bad_names_and_options_raise_before_any_sql(
    recorded: tuple[Connection, list[str]],
    name: object,
    timeout: object,
    shared: object,
    transaction: object,
) -> None:
    counted("name and options -> lock object or error before SQL")
    connection, statements = recorded
    before = len(advisory_statements(statements))
    try:
        lock = advisory_lock(  # type: ignore[call-overload]
            connection,
            name,
            timeout=timeout,
            shared=shared,
            transaction=transaction,
        )
    except (TypeError, ValueError):
        assert len(advisory_statements(statements)) == before
        return
    # Accepted: every option is well formed (the lock is made, not taken).
    assert lock.shared in (True, False)
    assert lock.transaction in (True, False)
    assert lock.timeout is None or lock.timeout >= 0
    assert len(advisory_statements(statements)) == before


@settings(SETTINGS, max_examples=1000)
@given(name=valid_names, scheme=st.sampled_from(KEY_SCHEMES), shared=st.booleans())
def test_any_valid_name_is_taken_and_given_back_without_an_sql_error(
    recorded: tuple[Connection, list[str]],
    name: str | int | tuple[int, int],
    scheme: str,
    shared: bool,
) -> None:
    counted("names taken and released on the server")
    connection, _ = recorded
    try:
        lock = advisory_lock(connection, name, key_scheme=scheme, shared=shared, timeout=0)
    except ValueError:
        # Text that is not valid Unicode (lone surrogates) has no UTF-8 bytes to hash.
        assert isinstance(name, str)
        return
    with lock:
        assert lock.held
        assert name in current_advisory_locks(connection)
        lock.ensure_held()
    assert current_advisory_locks(connection) == []


KEYS_IN_CHILD = """
import json, sys
from advisory_locks.keys import derive_key, KEY_SCHEMES
names = json.load(sys.stdin)
out = []
for name in names:
    row = []
    for scheme in KEY_SCHEMES:
        try:
            row.append(list(derive_key(name, scheme=scheme, prefix="p").ints))
        except (TypeError, ValueError) as error:
            row.append(type(error).__name__)
    out.append(row)
json.dump(out, sys.stdout)
"""


def keys_here(names: list[str]) -> list[list[object]]:
    rows: list[list[object]] = []
    for name in names:
        row: list[object] = []
        for scheme in KEY_SCHEMES:
            try:
                row.append(list(derive_key(name, scheme=scheme, prefix="p").ints))
            except (TypeError, ValueError) as error:
                row.append(type(error).__name__)
        rows.append(row)
    return rows


@settings(SETTINGS, max_examples=10)
@given(
    names=st.lists(st.text(min_size=1), min_size=100, max_size=100), seed=st.integers(0, 2**32 - 1)
)
def test_keys_are_the_same_in_a_process_with_another_hash_seed(names: list[str], seed: int) -> None:
    GENERATED["names keyed in a subprocess (other PYTHONHASHSEED)"] = GENERATED.get(
        "names keyed in a subprocess (other PYTHONHASHSEED)", 0
    ) + len(names)
    child = subprocess.run(
        [sys.executable, "-c", KEYS_IN_CHILD],
        input=json.dumps(names),
        capture_output=True,
        text=True,
        env={"PYTHONHASHSEED": str(seed), "PATH": "", "PYTHONPATH": ":".join(sys.path)},
        check=True,
    )
    assert json.loads(child.stdout) == keys_here(names)
