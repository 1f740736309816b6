"""Key schemes through Django: a function as ADVISORY_LOCKS["KEY_SCHEME"], hashtext, and
locks shared with the real django-pglock package in both directions."""

from __future__ import annotations

import hashlib
import io

import pglock
import psycopg
import pytest
from django.core.management import call_command
from django.test import override_settings
from psycopg.rows import TupleRow

from advisory_locks.keys import lock_key
from advisory_locks_django import advisory_lock
from advisory_locks_django.checks import check_settings
from tests.django.support import holders, in_thread, server_pid
from tests.helpers import unique_name

pytestmark = [pytest.mark.postgresql, pytest.mark.django_db(transaction=True)]

Admin = psycopg.Connection[TupleRow]


def md5_key(name: str) -> int:
    """A legacy key function, as a project might have had before this library."""
    return int.from_bytes(hashlib.md5(name.encode()).digest()[:8], "big", signed=True)


def tenant_pair(name: str) -> tuple[int, int]:
    tenant, _, job = name.partition("/")
    return int(tenant), len(job)


# -- a function as the configured scheme ------------------------------------------------------


def test_a_function_is_a_valid_key_scheme_setting() -> None:
    with override_settings(ADVISORY_LOCKS={"KEY_SCHEME": md5_key}):
        assert check_settings() == []


def test_text_that_names_no_scheme_is_still_refused_by_the_checks() -> None:
    with override_settings(ADVISORY_LOCKS={"KEY_SCHEME": "tests.django.md5_key"}):
        assert [message.id for message in check_settings()] == ["advisory_locks.E004"]


def test_a_configured_function_scheme_keys_every_lock(admin: Admin) -> None:
    name = unique_name("md5")
    with override_settings(ADVISORY_LOCKS={"KEY_SCHEME": md5_key, "KEY_PREFIX": "ignored:"}):
        lock = advisory_lock(name)
        assert lock.key == md5_key(name)  # the name as given: no prefix
        with lock:
            assert holders(admin, md5_key(name)) == [server_pid()]
            taken = admin.execute("SELECT pg_try_advisory_lock(%s)", (md5_key(name),))
            assert taken.fetchone() == (False,)


def test_a_configured_function_scheme_may_return_a_pair(admin: Admin) -> None:
    with (
        override_settings(ADVISORY_LOCKS={"KEY_SCHEME": tenant_pair}),
        advisory_lock("918273/nightly-report") as lock,
    ):
        assert lock.key == (918273, 14)
        assert holders(admin, (918273, 14)) == [server_pid()]


@pytest.mark.parametrize(
    ("result", "error"), [("42", TypeError), (2**63, ValueError), ((1, 2**31), ValueError)]
)
def test_a_bad_result_of_the_configured_function_fails_before_any_sql(
    result: object, error: type[Exception], django_assert_num_queries: object
) -> None:
    with (
        override_settings(ADVISORY_LOCKS={"KEY_SCHEME": lambda name: result}),
        django_assert_num_queries(0),  # type: ignore[operator]
        pytest.raises(error, match="returned"),
    ):
        advisory_lock(unique_name())


def test_an_explicit_scheme_beats_the_configured_function() -> None:
    with override_settings(ADVISORY_LOCKS={"KEY_SCHEME": md5_key}):
        lock = advisory_lock("daily", key_scheme="hashtext", key_prefix="")
    assert lock.key == lock_key("daily", scheme="hashtext", prefix="")


def test_the_command_prints_the_configured_function_schemes_key() -> None:
    out = io.StringIO()
    with override_settings(ADVISORY_LOCKS={"KEY_SCHEME": md5_key}):
        call_command("advisory_locks", "key", "nightly-report", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == str(md5_key("nightly-report"))
    assert any(f"{__name__}.md5_key" in line for line in lines)


# -- hashtext -----------------------------------------------------------------------------------


def test_a_hashtext_lock_is_the_lock_psql_takes_with_hashtext(admin: Admin) -> None:
    name = unique_name("hashtext-é")
    with override_settings(ADVISORY_LOCKS={"KEY_SCHEME": "hashtext", "KEY_PREFIX": "shop:"}):
        with advisory_lock(name):
            taken = admin.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (f"shop:{name}",))
            assert taken.fetchone() == (False,)
        taken = admin.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (f"shop:{name}",))
        assert taken.fetchone() == (True,)
        admin.execute("SELECT pg_advisory_unlock(hashtext(%s))", (f"shop:{name}",))


# -- django-pglock, the real package ----------------------------------------------------------


def test_a_pglock_advisory_lock_excludes_the_pglock_scheme(admin: Admin) -> None:
    name = unique_name("pglock-theirs-é")
    with pglock.advisory(name, timeout=0) as acquired:
        assert acquired is True
        assert holders(admin, name, scheme="pglock", prefix="") == [server_pid()]
        ours = in_thread(
            lambda: advisory_lock(name, key_scheme="pglock", key_prefix="", timeout=0).acquire()
        )
        assert ours is False
    # Released by django-pglock, the same name is ours to take: one lock, not two.
    assert (
        in_thread(
            lambda: advisory_lock(name, key_scheme="pglock", key_prefix="", timeout=0).acquire()
        )
        is True
    )


def test_the_pglock_scheme_excludes_a_pglock_advisory_lock(admin: Admin) -> None:
    name = unique_name("pglock-ours-日本")

    def theirs() -> bool:
        with pglock.advisory(name, timeout=0) as acquired:
            return bool(acquired)

    with advisory_lock(name, key_scheme="pglock", key_prefix="", timeout=0):
        assert in_thread(theirs) is False
    assert in_thread(theirs) is True


def test_the_configured_pglock_scheme_shares_djangos_pglock_key() -> None:
    name = unique_name("pglock-key")
    with override_settings(ADVISORY_LOCKS={"KEY_SCHEME": "pglock", "KEY_PREFIX": ""}):
        assert advisory_lock(name).key == pglock.advisory(name).int_lock_id
