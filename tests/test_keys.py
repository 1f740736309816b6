"""Specification of lock names and keys: schemes, prefixes, validation, pg_locks ids.

The literal integers below were computed once and written down on purpose: a change to a
scheme changes which lock every deployed process takes, so it must fail these tests rather
than pass them by recomputing the same formula.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zlib
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy.engine import URL

from advisory_locks.keys import LockKey, derive_key, lock_key
from tests.databases import advisory_locks_held, psycopg_connect

# name -> (sha256 big-endian, pglock little-endian, rails crc32 & 0x7fffffff)
VECTORS: dict[str, tuple[int, int, int]] = {
    "test": (-6951639720043709083, 7313085519096743583, 1484750348),
    "nightly-report": (7440995589958059143, -8663603374018903193, 69980848),
    "café": (-8858723660289998967, -8503059731156496507, 414007989),
    "日本": (-3518790099034495285, -3808106454699791665, 1203228108),
    "🔒 lock": (-5947565950102618643, -1315635304337475923, 712834840),
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
