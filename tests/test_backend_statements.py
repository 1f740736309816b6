"""A lock sends a backend's single lock or unlock statement itself (no steps to drive) and,
when the lock statement fails, throws the error into the backend's acquire steps. That is
only right while the statement is exactly the one those steps send first: checked here for
every mode, without a server (what the server does with them, the contract suite checks).
"""

from __future__ import annotations

import itertools

import pytest

from advisory_locks._core.steps import Statement
from advisory_locks._dialects import backend_for_dialect
from advisory_locks.keys import derive_key

KEYS = [derive_key("backend.statements"), derive_key(42), derive_key((1, 2))]


def _same(one: Statement | None, other: Statement) -> bool:
    return one is not None and (one.kind, one.sql, tuple(one.params)) == (
        other.kind,
        other.sql,
        tuple(other.params),
    )


@pytest.mark.parametrize(
    ("shared", "transaction", "timeout", "in_transaction"),
    list(itertools.product([False, True], [False, True], [0, None, 2.5], [False, True])),
)
def test_postgresql_lock_statement_is_the_first_statement_its_acquire_sends(
    shared: bool, transaction: bool, timeout: float | None, in_transaction: bool
) -> None:
    backend = backend_for_dialect("postgresql")
    for key in KEYS:
        statement = backend.lock_statement(
            key,
            shared=shared,
            transaction=transaction,
            timeout=timeout,
            in_transaction=in_transaction,
        )
        first = next(
            backend.acquire(
                {},
                key,
                shared=shared,
                transaction=transaction,
                timeout=timeout,
                in_transaction=in_transaction,
            )
        )
        if in_transaction and timeout != 0:
            # A wait inside the caller's transaction runs under a savepoint: a script
            # and, when it fails, a rollback to the savepoint, so the lock runs the steps.
            assert statement is None
        else:
            assert _same(statement, first), (statement, first)


@pytest.mark.parametrize("dialect", ["postgresql", "mysql"])
@pytest.mark.parametrize("shared", [False, True])
def test_unlock_statement_is_what_release_sends(dialect: str, shared: bool) -> None:
    backend = backend_for_dialect(dialect)
    for key in KEYS:
        statement = backend.unlock_statement(key, shared=shared)
        assert _same(statement, next(backend.release({}, key, shared=shared)))


def test_backends_that_do_more_than_one_statement_have_none() -> None:
    # MySQL's acquire may ask the server's version first, and GET_LOCK answers 0 for a
    # timed-out wait; SQLite's lock is a file locked in this process.
    key = KEYS[0]
    mysql = backend_for_dialect("mysql")
    assert (
        mysql.lock_statement(key, shared=False, transaction=False, timeout=1, in_transaction=False)
        is None
    )
    sqlite = backend_for_dialect("sqlite")
    assert (
        sqlite.lock_statement(key, shared=False, transaction=False, timeout=1, in_transaction=False)
        is None
    )
    assert sqlite.unlock_statement(key, shared=False) is None
