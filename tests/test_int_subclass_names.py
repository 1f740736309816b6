"""An ``int`` subclass is the same lock as its int value, on every database.

``IntEnum`` members, ``(int, Enum)`` mix-ins (whose ``format()`` says "Color.RED" on Python
3.11+) and int subclasses with their own ``__str__``/``__format__`` all name the lock of
their value: on MySQL/MariaDB, which locks a text name, as on PostgreSQL and SQLite, which
lock the integer key. Each test holds one spelling on one connection and tries the other
on a second connection with ``timeout=0``; the values are random, so concurrent runs on
a shared server never meet.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL, make_url

from advisory_locks import advisory_lock
from advisory_locks.keys import LockName, derive_key


class Spelled(int):
    """An int that prints as something else."""

    def __str__(self) -> str:
        return "spelled"

    def __repr__(self) -> str:
        return "Spelled()"

    def __format__(self, spec: str) -> str:
        return "spelled"


def spellings(value: int) -> dict[str, int]:
    """``value`` as each kind of int subclass."""

    class Color(enum.IntEnum):
        RED = value

    class Shade(int, enum.Enum):
        DARK = value

    return {"IntEnum": Color.RED, "(int, Enum)": Shade.DARK, "int subclass": Spelled(value)}


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "postgresql":
        url: URL = request.getfixturevalue("postgres_url")
    elif request.param == "mariadb":
        url = request.getfixturevalue("mysql_url")
    else:
        url = make_url(f"sqlite:///{tmp_path / 'names.sqlite'}")
    engine = create_engine(url)
    yield engine
    engine.dispose()


def excludes(engine: Engine, held: LockName, tried: LockName) -> bool:
    """Whether holding ``held`` keeps another connection from taking ``tried``."""
    with engine.connect() as holder, engine.connect() as other:
        with advisory_lock(holder, held, timeout=0) as lock:
            assert lock.held
            excluded = not advisory_lock(other, tried, timeout=0).acquire()
        # Released: the other spelling is free again.
        with advisory_lock(other, tried, timeout=0) as lock:
            assert lock.held
    return excluded


@pytest.mark.parametrize("kind", ["IntEnum", "(int, Enum)", "int subclass"])
def test_an_int_subclass_and_its_int_value_are_one_lock(engine: Engine, kind: str) -> None:
    value = random.getrandbits(62)
    member = spellings(value)[kind]
    assert excludes(engine, member, value)
    assert excludes(engine, value, member)


@pytest.mark.parametrize("kind", ["IntEnum", "(int, Enum)", "int subclass"])
def test_a_pair_of_int_subclasses_and_the_int_pair_are_one_lock(engine: Engine, kind: str) -> None:
    first, second = random.getrandbits(30), random.getrandbits(30)
    pair = (spellings(first)[kind], spellings(second)[kind])
    assert excludes(engine, pair, (first, second))
    assert excludes(engine, (first, second), pair)


@pytest.mark.parametrize("kind", ["IntEnum", "(int, Enum)", "int subclass"])
def test_the_lock_is_named_by_the_plain_value(kind: str) -> None:
    value = random.getrandbits(62)
    key = derive_key(spellings(value)[kind])
    assert type(key.name) is int
    assert key.name == value
    assert key.ints == (value,)


def test_an_int_subclass_out_of_range_is_refused_before_any_sql() -> None:
    with pytest.raises(ValueError, match="64-bit"):
        derive_key(Spelled(2**63))
