"""Specification of lock names and keys: schemes, prefixes, validation, pg_locks ids.

The literal integers below were computed once and written down on purpose: a change to a
scheme changes which lock every deployed process takes, so it must fail these tests rather
than pass them by recomputing the same formula.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import zlib
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL

from advisory_locks import advisory_lock
from advisory_locks.keys import LockKey, _hashtext, derive_key, lock_key
from tests.databases import advisory_locks_held, psycopg_connect
from tests.helpers import advisory_statements, record_statements, unique_name

# name -> (sha256 big-endian, pglock little-endian, rails crc32 & 0x7fffffff)
VECTORS: dict[str, tuple[int, int, int]] = {
    "test": (-6951639720043709083, 7313085519096743583, 1484750348),
    "nightly-report": (7440995589958059143, -8663603374018903193, 69980848),
    "café": (-8858723660289998967, -8503059731156496507, 414007989),
    "日本": (-3518790099034495285, -3808106454699791665, 1203228108),
    "🔒 lock": (-5947565950102618643, -1315635304337475923, 712834840),
}

# name -> what PostgreSQL 15's hashtext(name) returned for it (UTF8 database, C.UTF-8).
HASHTEXT_VECTORS: dict[str, int] = {
    "test": 1771415073,
    "nightly-report": 759228614,
    "café": 103771354,
    "日本": -1851216170,
    "🔒 lock": -2090329356,
}

HOSTILE_NAMES = [
    "a'b\"c",
    "'); DROP TABLE x; --",
    "nul\x00inside",
    "x" * 10_000,
    "$1 %s %(name)s ?",
    "\n\t\r",
]


@pytest.fixture(autouse=True)
def _no_key_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The developer's shell must not change what the vectors below mean.
    monkeypatch.delenv("ADVISORY_LOCKS_KEY_SCHEME", raising=False)
    monkeypatch.delenv("ADVISORY_LOCKS_PREFIX", raising=False)


# --- schemes ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "expected"), [(n, v[0]) for n, v in VECTORS.items()])
def test_default_scheme_keys_are_fixed_vectors(name: str, expected: int) -> None:
    assert lock_key(name) == expected


@pytest.mark.parametrize(("name", "expected"), [(n, v[1]) for n, v in VECTORS.items()])
def test_pglock_scheme_keys_are_fixed_vectors(name: str, expected: int) -> None:
    assert lock_key(name, scheme="pglock") == expected


@pytest.mark.parametrize(("name", "expected"), [(n, v[2]) for n, v in VECTORS.items()])
def test_rails_scheme_keys_are_fixed_vectors_with_prefix_zero(name: str, expected: int) -> None:
    assert lock_key(name, scheme="rails") == (expected, 0)


@pytest.mark.parametrize(("name", "expected"), list(HASHTEXT_VECTORS.items()))
def test_hashtext_scheme_keys_are_fixed_vectors(name: str, expected: int) -> None:
    assert lock_key(name, scheme="hashtext") == expected


def test_hashtext_key_is_one_bigint_inside_the_int4_range() -> None:
    key = derive_key("nightly-report", scheme="hashtext")
    assert key.ints == (759228614,)
    assert all(-(2**31) <= derive_key(n, scheme="hashtext").ints[0] < 2**31 for n in VECTORS)


def test_hashtext_of_no_bytes_is_the_servers() -> None:
    # No name is empty, so only the function itself can be asked; SELECT hashtext('').
    assert _hashtext(b"") == -1477818771


def test_default_scheme_is_sha256() -> None:
    assert lock_key("test") == lock_key("test", scheme="sha256")


@pytest.mark.parametrize("name", list(VECTORS))
def test_default_scheme_is_first_eight_sha256_bytes_big_endian_signed(name: str) -> None:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    assert lock_key(name) == int.from_bytes(digest[:8], "big", signed=True)


@pytest.mark.parametrize("name", list(VECTORS))
def test_pglock_scheme_equals_django_pglock_formula(name: str) -> None:
    # django-pglock: int.from_bytes(sha256(name.encode()).digest()[:8], "little", signed=True)
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    assert lock_key(name, scheme="pglock") == int.from_bytes(digest[:8], "little", signed=True)


def test_rails_scheme_matches_the_with_advisory_lock_gem_for_test() -> None:
    # The gem's PostgreSQL keys: [Zlib.crc32("test") & 0x7fffffff, prefix.to_i].
    assert lock_key("test", scheme="rails") == (1484750348, 0)


@pytest.mark.parametrize("name", list(VECTORS))
def test_rails_scheme_is_crc32_of_utf8_masked_to_31_bits(name: str) -> None:
    assert lock_key(name, scheme="rails") == (zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF, 0)


def test_rails_key_parts_fit_in_int4() -> None:
    first, second = lock_key("test", scheme="rails", prefix=-1)  # type: ignore[misc]
    assert 0 <= first <= 2**31 - 1
    assert second == 0x7FFFFFFF


def test_the_two_hash_schemes_give_different_keys() -> None:
    assert lock_key("test", scheme="sha256") != lock_key("test", scheme="pglock")


def test_text_is_not_normalised_so_composed_and_decomposed_forms_differ() -> None:
    # "café" precomposed vs "cafe" + combining acute: different UTF-8, different keys.
    assert lock_key("caf\u00e9") != lock_key("cafe\u0301")


# --- prefixes -----------------------------------------------------------------------------


def test_prefix_is_prepended_to_the_text_before_hashing() -> None:
    assert lock_key("test", prefix="billing:") == -7887281703547300716
    assert lock_key("test", prefix="billing:") == lock_key("billing:test")


def test_pglock_scheme_applies_the_prefix_too() -> None:
    assert lock_key("test", scheme="pglock", prefix="billing:") == -7776414425115817326


def test_prefix_with_non_ascii_text() -> None:
    assert lock_key("café", prefix="shop/") == 7286865146962422413


def test_hashtext_scheme_prepends_the_prefix_like_sha256() -> None:
    # SELECT hashtext('billing:test')
    assert lock_key("test", scheme="hashtext", prefix="billing:") == -934050249
    assert lock_key("test", scheme="hashtext", prefix="billing:") == lock_key(
        "billing:test", scheme="hashtext", prefix=""
    )


def test_integer_prefix_hashes_as_its_decimal_text() -> None:
    assert lock_key("test", prefix=7) == lock_key("7test")


def test_empty_prefix_is_no_prefix() -> None:
    assert lock_key("test", prefix="") == lock_key("test")


def test_rails_prefix_is_the_second_key() -> None:
    assert lock_key("test", scheme="rails", prefix=42) == (1484750348, 42)


def test_rails_prefix_may_be_integer_text() -> None:
    assert lock_key("test", scheme="rails", prefix="42") == (1484750348, 42)


def test_rails_prefix_that_is_not_an_integer_is_rejected() -> None:
    with pytest.raises(ValueError, match="integer prefix"):
        lock_key("test", scheme="rails", prefix="billing")


def test_prefix_of_wrong_type_is_rejected() -> None:
    with pytest.raises(TypeError):
        lock_key("test", prefix=1.5)  # type: ignore[arg-type]


def test_prefix_does_not_apply_to_integer_names() -> None:
    assert lock_key(42, prefix="billing:") == 42


def test_prefix_does_not_apply_to_pair_names() -> None:
    assert lock_key((1, 2), prefix="billing:") == (1, 2)


# --- environment --------------------------------------------------------------------------


def test_scheme_comes_from_the_environment_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADVISORY_LOCKS_KEY_SCHEME", "rails")
    assert lock_key("test") == (1484750348, 0)


def test_explicit_scheme_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADVISORY_LOCKS_KEY_SCHEME", "rails")
    assert lock_key("test", scheme="sha256") == -6951639720043709083


def test_unknown_scheme_in_the_environment_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADVISORY_LOCKS_KEY_SCHEME", "md5")
    with pytest.raises(ValueError, match="unknown key scheme"):
        lock_key("test")


def test_prefix_comes_from_the_environment_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADVISORY_LOCKS_PREFIX", "billing:")
    assert lock_key("test") == -7887281703547300716


def test_explicit_prefix_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADVISORY_LOCKS_PREFIX", "billing:")
    assert lock_key("test", prefix="") == -6951639720043709083


def test_rails_prefix_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADVISORY_LOCKS_PREFIX", "9")
    assert lock_key("test", scheme="rails") == (1484750348, 9)


# --- integer and pair names ---------------------------------------------------------------


@pytest.mark.parametrize("name", [0, 1, -1, 2**63 - 1, -(2**63)])
def test_integer_name_is_the_key(name: int) -> None:
    assert lock_key(name) == name


@pytest.mark.parametrize("name", [(0, 0), (1, 2), (-(2**31), 2**31 - 1)])
def test_pair_name_is_the_key(name: tuple[int, int]) -> None:
    assert lock_key(name) == name


def test_integer_name_ignores_the_scheme() -> None:
    assert lock_key(42, scheme="rails") == 42


def test_string_that_looks_like_an_integer_is_hashed_as_text() -> None:
    assert lock_key("42") != 42


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", [True, False, 1.0, None, b"test", bytearray(b"x"), ["a"], [1, 2], {1, 2}, object()]
)
def test_names_of_other_types_are_a_type_error(name: object) -> None:
    with pytest.raises(TypeError, match="lock name must be"):
        derive_key(name)


def test_empty_name_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        lock_key("")


@pytest.mark.parametrize("name", [2**63, -(2**63) - 1, 10**30])
def test_integer_outside_signed_64_bit_is_a_value_error(name: int) -> None:
    with pytest.raises(ValueError, match="64-bit"):
        lock_key(name)


@pytest.mark.parametrize("name", [(2**31, 0), (0, -(2**31) - 1), (2**40, 2**40)])
def test_pair_part_outside_signed_32_bit_is_a_value_error(name: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="32-bit"):
        lock_key(name)


@pytest.mark.parametrize("name", [(), (1,), (1, 2, 3), (1, "2"), ("a", "b"), (True, 1), (1.0, 2)])
def test_malformed_pair_is_a_type_error(name: tuple[object, ...]) -> None:
    with pytest.raises(TypeError, match="pair"):
        derive_key(name)


@pytest.mark.parametrize("name", ["\ud800", "ok\udfffok"])
def test_lone_surrogate_is_a_value_error(name: str) -> None:
    with pytest.raises(ValueError, match="not valid Unicode"):
        lock_key(name)


def test_lone_surrogate_is_a_value_error_for_rails_too() -> None:
    with pytest.raises(ValueError, match="not valid Unicode"):
        lock_key("\ud800", scheme="rails")


def test_unknown_scheme_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown key scheme"):
        lock_key("test", scheme="crc32")


@pytest.mark.parametrize("scheme", [42, b"sha256", ["rails"], 1.5])
def test_scheme_that_is_neither_a_name_nor_a_function_is_a_type_error(scheme: object) -> None:
    with pytest.raises(TypeError, match="key scheme must be"):
        lock_key("test", scheme=scheme)  # type: ignore[arg-type]


def test_scheme_from_the_environment_is_only_ever_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # The variable is text: a dotted path to a function is not imported, it is unknown.
    monkeypatch.setenv("ADVISORY_LOCKS_KEY_SCHEME", "myapp.keys.legacy_key")
    with pytest.raises(ValueError, match="unknown key scheme"):
        lock_key("test")
    monkeypatch.setenv("ADVISORY_LOCKS_KEY_SCHEME", "hashtext")
    assert lock_key("test") == HASHTEXT_VECTORS["test"]


# --- a function as the scheme -------------------------------------------------------------


def md5_key(name: str) -> int:
    """The kind of legacy key function a project copied from a blog post years ago."""
    return int.from_bytes(hashlib.md5(name.encode()).digest()[:8], "big", signed=True)


def test_function_scheme_returning_an_int_gives_that_bigint_key() -> None:
    assert lock_key("test", scheme=md5_key) == md5_key("test") == 688887797400064883
    assert derive_key("test", scheme=md5_key).ints == (688887797400064883,)


def test_function_scheme_returning_a_pair_gives_that_pair() -> None:
    assert lock_key("test", scheme=lambda name: (len(name), -1)) == (4, -1)


def test_function_scheme_receives_the_name_as_given_without_the_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ADVISORY_LOCKS_PREFIX", "from-env:")
    seen: list[str] = []

    def record(name: str) -> int:
        seen.append(name)
        return 1

    derive_key("café", scheme=record, prefix="billing:")
    derive_key("café", scheme=record)
    assert seen == ["café", "café"]
    assert derive_key("café", scheme=record).prefix == ""


def test_function_scheme_is_called_for_each_lock_not_cached() -> None:
    calls: list[str] = []

    def counting(name: str) -> int:
        calls.append(name)
        return len(calls)

    assert [lock_key("same", scheme=counting) for _ in range(3)] == [1, 2, 3]


def test_function_scheme_does_not_apply_to_integer_and_pair_names() -> None:
    def refuse(name: str) -> int:
        raise AssertionError("int and pair names are the key already")

    assert lock_key(42, scheme=refuse) == 42
    assert lock_key((1, 2), scheme=refuse) == (1, 2)


def test_function_scheme_still_refuses_a_prefix_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="key prefix"):
        lock_key("test", scheme=md5_key, prefix=1.5)  # type: ignore[arg-type]


def test_function_scheme_still_refuses_an_empty_name_before_calling() -> None:
    with pytest.raises(ValueError, match="empty"):
        lock_key("", scheme=lambda name: 1)


BAD_FUNCTION_RESULTS: list[tuple[object, type[Exception], str]] = [
    (True, TypeError, "expected an int or a tuple of two ints"),
    ("42", TypeError, "expected an int or a tuple of two ints"),
    (1.0, TypeError, "expected an int or a tuple of two ints"),
    (None, TypeError, "expected an int or a tuple of two ints"),
    ([1, 2], TypeError, "expected an int or a tuple of two ints"),
    (b"\x00" * 8, TypeError, "expected an int or a tuple of two ints"),
    (2**63, ValueError, "64-bit"),
    (-(2**63) - 1, ValueError, "64-bit"),
    ((1, 2, 3), TypeError, "exactly two ints"),
    ((1, "2"), TypeError, "exactly two ints"),
    ((True, 0), TypeError, "exactly two ints"),
    ((2**31, 0), ValueError, "32-bit"),
    ((0, -(2**31) - 1), ValueError, "32-bit"),
]


@pytest.mark.parametrize(("result", "error", "message"), BAD_FUNCTION_RESULTS)
def test_function_scheme_result_is_validated_like_an_int_or_pair_name(
    result: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message) as raised:
        lock_key("test", scheme=lambda name: result)  # type: ignore[arg-type,return-value]
    # The message names the function and what it returned, so the culprit is found.
    assert "<lambda>" in str(raised.value)
    assert repr(result) in str(raised.value)


def test_an_error_inside_the_function_scheme_reaches_the_caller_unchanged() -> None:
    def broken(name: str) -> int:
        raise KeyError(name)

    with pytest.raises(KeyError):
        lock_key("test", scheme=broken)


@pytest.fixture(scope="module")
def recording_engine(postgres_url: URL) -> Iterator[tuple[Engine, list[str]]]:
    engine = create_engine(postgres_url)
    statements = record_statements(engine)
    yield engine, statements
    engine.dispose()


@pytest.mark.parametrize(("result", "error", "message"), BAD_FUNCTION_RESULTS)
def test_a_bad_function_scheme_result_fails_before_any_sql(
    recording_engine: tuple[Engine, list[str]],
    result: object,
    error: type[Exception],
    message: str,
) -> None:
    engine, statements = recording_engine
    before = len(statements)
    with engine.connect() as connection:
        sent_on_connect = len(statements)
        with pytest.raises(error, match=message):
            advisory_lock(connection, "test", key_scheme=lambda name: result, timeout=0)  # type: ignore[arg-type,return-value]
        assert statements[sent_on_connect:] == []
    assert advisory_statements(statements[before:]) == []


def test_a_function_scheme_locks_its_key_on_the_server(
    pg_engine: Engine, pg_admin: psycopg.Connection[TupleRow]
) -> None:
    name = unique_name("md5")
    with pg_engine.connect() as connection, advisory_lock(connection, name, key_scheme=md5_key):
        # Another service that only knows the legacy function takes the same lock.
        taken = pg_admin.execute("SELECT pg_try_advisory_lock(%s)", (md5_key(name),)).fetchone()
        assert taken == (False,)


# --- hostile names ------------------------------------------------------------------------


@pytest.mark.parametrize("name", HOSTILE_NAMES)
@pytest.mark.parametrize("scheme", ["sha256", "pglock"])
def test_hostile_name_maps_to_an_ordinary_bigint_key(name: str, scheme: str) -> None:
    key = lock_key(name, scheme=scheme)
    assert isinstance(key, int)
    assert -(2**63) <= key <= 2**63 - 1


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_name_maps_to_an_ordinary_rails_pair(name: str) -> None:
    first, second = lock_key(name, scheme="rails")  # type: ignore[misc]
    assert 0 <= first <= 2**31 - 1
    assert second == 0


def test_sql_text_name_has_a_fixed_key() -> None:
    assert lock_key("'); DROP TABLE x; --") == -8067416350369537785


# --- stability ----------------------------------------------------------------------------


@pytest.mark.parametrize("hash_seed", ["0", "4242"])
def test_keys_are_the_same_in_another_process_with_another_hash_seed(hash_seed: str) -> None:
    names = list(VECTORS)
    program = (
        "import sys; from advisory_locks.keys import lock_key\n"
        "for name in sys.argv[1:]:\n"
        "    print(lock_key(name), lock_key(name, scheme='pglock'),"
        " *lock_key(name, scheme='rails'))\n"
    )
    environment = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONIOENCODING": "utf-8"}
    environment.pop("ADVISORY_LOCKS_KEY_SCHEME", None)
    environment.pop("ADVISORY_LOCKS_PREFIX", None)
    completed = subprocess.run(
        [sys.executable, "-c", program, *names],
        env=environment,
        capture_output=True,
        text=True,
        encoding="utf-8",
        check=True,
        timeout=60,
    )
    expected = [f"{VECTORS[n][0]} {VECTORS[n][1]} {VECTORS[n][2]} 0" for n in names]
    assert completed.stdout.splitlines() == expected


# --- LockKey ------------------------------------------------------------------------------


def test_lock_key_value_of_a_string_name_is_one_integer() -> None:
    assert derive_key("test").value == -6951639720043709083


def test_lock_key_value_of_a_rails_name_is_the_pair() -> None:
    assert derive_key("test", scheme="rails").value == (1484750348, 0)


def test_lock_key_keeps_the_name() -> None:
    assert derive_key("café").name == "café"


@pytest.mark.parametrize(
    ("key", "ids"),
    [
        (LockKey(1, (1,)), (0, 1, 1)),
        (LockKey(-1, (-1,)), (0xFFFFFFFF, 0xFFFFFFFF, 1)),
        (LockKey(2**32, (2**32,)), (1, 0, 1)),
        (LockKey(-(2**63), (-(2**63),)), (0x80000000, 0, 1)),
        (LockKey((1, 2), (1, 2)), (1, 2, 2)),
        (LockKey((-1, -2), (-1, -2)), (0xFFFFFFFF, 0xFFFFFFFE, 2)),
    ],
)
def test_pg_locks_ids_split_keys_into_unsigned_oids(
    key: LockKey, ids: tuple[int, int, int]
) -> None:
    assert key.pg_locks_ids() == ids


@pytest.fixture
def holder(postgres_url: URL) -> Iterator[psycopg.Connection[TupleRow]]:
    with psycopg_connect(postgres_url, autocommit=True) as connection:
        yield connection


@pytest.mark.parametrize(
    "name",
    [-6951639720043709083, 7440995589958059143, (-5, -(2**31)), (1484750348, 0)],
    ids=["negative-bigint", "positive-bigint", "negative-pair", "rails-pair"],
)
def test_pg_locks_ids_match_what_the_server_reports(
    name: int | tuple[int, int],
    holder: psycopg.Connection[TupleRow],
    pg_admin: psycopg.Connection[TupleRow],
) -> None:
    key = derive_key(name)
    placeholders = ", ".join(["%s"] * len(key.ints))
    holder.execute(f"SELECT pg_advisory_lock({placeholders})", key.ints)
    try:
        rows = advisory_locks_held(pg_admin, holder.info.backend_pid)
    finally:
        holder.execute(f"SELECT pg_advisory_unlock({placeholders})", key.ints)
    assert [(row.classid, row.objid, row.objsubid) for row in rows] == [key.pg_locks_ids()]


# --- hashtext against the server ----------------------------------------------------------

# Characters of every UTF-8 length: 1 byte, 2 bytes, 3 bytes, 4 bytes (outside the BMP).
NON_ASCII = "éßñøЖж日本語한글€🔒😀𝄞🚀"


def _names_of_every_byte_length(up_to: int) -> list[str]:
    # Lengths around the 12-byte blocks hash_bytes reads (11, 12, 13, 23, 24, 25, ...),
    # with bytes >= 0x80 landing in every position of the last, partial block.
    names = []
    for length in range(up_to + 1):
        names.append("a" * length)
        names.append("é" * (length // 2) + "x" * (length % 2))
        names.append("x" * (length % 3) + "日" * (length // 3))
        names.append("🔒" * (length // 4) + "y" * (length % 4))
        names.append("".join(chr(0x7F - i % 0x7E) for i in range(length)))
    return names


def _hashtext_test_names() -> list[str]:
    generator = random.Random(20261112)  # fixed: a failure reproduces
    ascii_names = [
        "".join(chr(generator.randint(1, 127)) for _ in range(generator.randint(1, 48)))
        for _ in range(2000)
    ]
    unicode_names = [
        "".join(generator.choice(NON_ASCII + "abc-:_ ") for _ in range(generator.randint(1, 30)))
        for _ in range(1500)
    ]
    long_names = [
        "x" * 1000,
        "nightly-report:" * 200,
        "".join(generator.choice(NON_ASCII) for _ in range(5000)),
        "z" * 100_001,
    ]
    return [*_names_of_every_byte_length(40), *ascii_names, *unicode_names, *long_names]


def _server_hashtext(admin: psycopg.Connection[TupleRow], texts: list[str]) -> list[int]:
    # One round trip for the whole batch; ORDINALITY keeps the answers in order.
    rows = admin.execute(
        "SELECT hashtext(t.text) FROM unnest(%s::text[]) WITH ORDINALITY AS t(text, i)"
        " ORDER BY t.i",
        (texts,),
    ).fetchall()
    return [row[0] for row in rows]


def test_hashtext_names_are_utf8_on_the_server_under_test(
    pg_admin: psycopg.Connection[TupleRow],
) -> None:
    # The scheme hashes UTF-8 bytes, as hashtext() does in a UTF8 database; in a database
    # of another encoding the server would hash other bytes.
    assert pg_admin.execute("SHOW server_encoding").fetchone() == ("UTF8",)


def test_hashtext_scheme_equals_the_servers_hashtext_for_thousands_of_names(
    pg_admin: psycopg.Connection[TupleRow],
) -> None:
    names = _hashtext_test_names()
    assert len(names) > 3500
    lengths = {len(name.encode("utf-8")) for name in names}
    assert set(range(41)) <= lengths
    ours = [_hashtext(name.encode("utf-8")) for name in names]
    server = _server_hashtext(pg_admin, names)
    mismatched = [(n[:40], o, s) for n, o, s in zip(names, ours, server, strict=True) if o != s]
    assert mismatched == []
    # Through the public scheme too (the empty string is no name).
    assert [lock_key(name, scheme="hashtext", prefix="") for name in names if name] == [
        key for name, key in zip(names, server, strict=True) if name
    ]


def test_hashtext_scheme_with_a_prefix_equals_the_servers_hashtext_of_the_joined_text(
    pg_admin: psycopg.Connection[TupleRow],
) -> None:
    names = [name for name in _hashtext_test_names()[::7] if name]
    for prefix in ("billing:", "tenant-42/", "日本:", 7):
        server = _server_hashtext(pg_admin, [f"{prefix}{name}" for name in names])
        assert [lock_key(name, scheme="hashtext", prefix=prefix) for name in names] == server


@pytest.fixture
def psql_session(postgres_url: URL) -> Iterator[psycopg.Connection[TupleRow]]:
    """A plain psycopg connection standing in for psql or another service's code."""
    with psycopg_connect(postgres_url, autocommit=True) as connection:
        yield connection


@pytest.mark.parametrize("prefix", [None, "billing:"])
def test_a_hashtext_lock_taken_in_sql_excludes_the_hashtext_scheme(
    pg_engine: Engine, psql_session: psycopg.Connection[TupleRow], prefix: str | None
) -> None:
    name = unique_name("hashtext-é🔒")
    psql_session.execute("SELECT pg_advisory_lock(hashtext(%s))", ((prefix or "") + name,))
    try:
        lock = advisory_lock(pg_engine, name, key_scheme="hashtext", key_prefix=prefix, timeout=0)
        assert lock.acquire() is False
    finally:
        psql_session.execute("SELECT pg_advisory_unlock(hashtext(%s))", ((prefix or "") + name,))
    # Freed in SQL, it is ours to take: the two sides named one lock.
    with advisory_lock(pg_engine, name, key_scheme="hashtext", key_prefix=prefix, timeout=0):
        pass


@pytest.mark.parametrize("prefix", [None, "billing:"])
def test_the_hashtext_scheme_excludes_a_hashtext_lock_taken_in_sql(
    pg_engine: Engine, psql_session: psycopg.Connection[TupleRow], prefix: str | None
) -> None:
    name = unique_name("hashtext-日本")
    text = (prefix or "") + name
    with advisory_lock(pg_engine, name, key_scheme="hashtext", key_prefix=prefix, timeout=0):
        taken = psql_session.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (text,))
        assert taken.fetchone() == (False,)
    taken = psql_session.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (text,))
    assert taken.fetchone() == (True,)
    psql_session.execute("SELECT pg_advisory_unlock(hashtext(%s))", (text,))
