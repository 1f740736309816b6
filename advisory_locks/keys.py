"""Lock names and the integer keys the database server sees.

A name is a non-empty ``str`` (hashed), an ``int`` (a signed 64-bit key, used as is) or
a ``(int, int)`` pair (two signed 32-bit keys, PostgreSQL's two-key form). A scheme turns
a string into a key. Every scheme here is defined on the UTF-8 bytes of the text with an
explicit byte order, so a key never depends on the Python version, the platform or
``PYTHONHASHSEED``.

Schemes:

``sha256`` (default)
    first 8 bytes of SHA-256(utf8(prefix + name)), big-endian, signed: one bigint key.
``pglock``
    first 8 bytes of SHA-256(utf8(prefix + name)), little-endian, signed: the key
    django-pglock computes for the same string.
``rails``
    ``(crc32(utf8(name)) & 0x7fffffff, prefix & 0x7fffffff)``: the pair the Ruby
    ``with_advisory_lock`` gem sends to PostgreSQL; its prefix is an integer
    (``WITH_ADVISORY_LOCK_PREFIX`` in Ruby) and defaults to 0.

The prefix (a namespace, so two applications on one database do not collide) applies to
string names only; integer and pair names are already the key.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Final, Literal, TypeAlias

__all__ = [
    "DEFAULT_SCHEME",
    "KEY_SCHEMES",
    "LockKey",
    "LockName",
    "derive_key",
    "lock_key",
]

LockName: TypeAlias = str | int | tuple[int, int]
KeyScheme = Literal["sha256", "pglock", "rails"]

DEFAULT_SCHEME: Final = "sha256"
KEY_SCHEMES: Final[tuple[str, ...]] = ("sha256", "pglock", "rails")

SCHEME_ENV: Final = "ADVISORY_LOCKS_KEY_SCHEME"
PREFIX_ENV: Final = "ADVISORY_LOCKS_PREFIX"

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
INT32_MIN: Final = -(2**31)
INT32_MAX: Final = 2**31 - 1


@dataclass(frozen=True, slots=True)
class LockKey:
    """A validated name and the key(s) derived from it."""

    name: LockName
    ints: tuple[int] | tuple[int, int]
    # The namespace text a string name was hashed with ("" for none, and for int and pair
    # names); backends that lock by name rather than by integer key (MySQL) need it too.
    prefix: str = ""

    @property
    def value(self) -> int | tuple[int, int]:
        """The key as the server sees it: one bigint, or the int4 pair."""
        if len(self.ints) == 1:
            return self.ints[0]
        return self.ints

    def pg_locks_ids(self) -> tuple[int, int, int]:
        """``(classid, objid, objsubid)`` of this key's row in PostgreSQL's ``pg_locks``.

        classid and objid are ``oid`` columns (unsigned 32-bit); objsubid is 1 for a
        bigint key and 2 for a pair.
        """
        if len(self.ints) == 1:
            unsigned = self.ints[0] & 0xFFFFFFFFFFFFFFFF
            return unsigned >> 32, unsigned & 0xFFFFFFFF, 1
        first, second = self.ints
        return first & 0xFFFFFFFF, second & 0xFFFFFFFF, 2


def lock_key(
    name: LockName, *, scheme: str | None = None, prefix: str | int | None = None
) -> int | tuple[int, int]:
    """Return the key(s) sent to the server for ``name``.

    ``scheme`` defaults to ``$ADVISORY_LOCKS_KEY_SCHEME`` or ``"sha256"``; ``prefix`` to
    ``$ADVISORY_LOCKS_PREFIX`` or none.
    """
    return derive_key(name, scheme=scheme, prefix=prefix).value


def derive_key(
    name: object, *, scheme: str | None = None, prefix: str | int | None = None
) -> LockKey:
    """Validate ``name`` and derive its key; raise TypeError/ValueError on bad input."""
    if isinstance(name, bool):
        raise TypeError("lock name must be str, int or (int, int), not bool")
    if isinstance(name, int):
        # An int subclass (IntEnum, an (int, Enum) mix-in) is the lock of its value on
        # every database: MySQL locks the formatted name, where it may say "Color.RED".
        value = int(name)
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"integer lock name {value} is outside the signed 64-bit range")
        return LockKey(value, (value,))
    if isinstance(name, tuple):
        pair = _validate_pair(name)
        return LockKey(pair, pair)
    if not isinstance(name, str):
        raise TypeError(f"lock name must be str, int or (int, int), not {type(name).__name__}")
    if not name:
        raise ValueError("lock name must not be empty")
    scheme = _resolve_scheme(scheme)
    prefix = os.environ.get(PREFIX_ENV) if prefix is None else prefix
    if prefix is not None and (isinstance(prefix, bool) or not isinstance(prefix, (str, int))):
        # Checked before the cache, which would otherwise answer True as it did 1.
        raise TypeError(f"key prefix must be str or int, not {type(prefix).__name__}")
    return _string_key(name, scheme, prefix)


# Applications lock the same few names over and over (a job's name, "checkout:<sku>"):
# hashing and validating again is a measurable part of a lock's client time. The cache is
# keyed on the scheme and prefix AFTER the environment was read, so changing
# $ADVISORY_LOCKS_KEY_SCHEME or $ADVISORY_LOCKS_PREFIX takes effect at once; LockKey is
# frozen, so handing one instance to many locks is safe. Errors are not cached.
@lru_cache(maxsize=4096)
def _string_key(name: str, scheme: str, prefix: str | int | None) -> LockKey:
    if scheme == "rails":
        return LockKey(name, _rails_key(name, prefix), _text_prefix(prefix))
    text_prefix = _text_prefix(prefix)
    digest = hashlib.sha256(_utf8(text_prefix + name)).digest()
    order: Literal["big", "little"] = "little" if scheme == "pglock" else "big"
    return LockKey(name, (int.from_bytes(digest[:8], order, signed=True),), text_prefix)


def _validate_pair(name: tuple[object, ...]) -> tuple[int, int]:
    if len(name) != 2 or not all(
        isinstance(part, int) and not isinstance(part, bool) for part in name
    ):
        raise TypeError("a pair lock name must be a tuple of exactly two ints")
    first, second = (int(part) for part in name)  # type: ignore[call-overload]
    for part in (first, second):
        if not INT32_MIN <= part <= INT32_MAX:
            raise ValueError(f"pair lock name part {part} is outside the signed 32-bit range")
    return first, second


def _resolve_scheme(scheme: str | None) -> str:
    if scheme is None:
        scheme = os.environ.get(SCHEME_ENV) or DEFAULT_SCHEME
    if scheme not in KEY_SCHEMES:
        raise ValueError(f"unknown key scheme {scheme!r}; expected one of {KEY_SCHEMES}")
    return scheme


def _text_prefix(prefix: str | int | None) -> str:
    if prefix is None:
        return ""
    if isinstance(prefix, bool) or not isinstance(prefix, (str, int)):
        raise TypeError(f"key prefix must be str or int, not {type(prefix).__name__}")
    return str(prefix)


def _rails_key(name: str, prefix: str | int | None) -> tuple[int, int]:
    if prefix is None or prefix == "":
        prefix_int = 0
    elif isinstance(prefix, bool):
        raise TypeError("key prefix must be str or int, not bool")
    elif isinstance(prefix, int):
        prefix_int = prefix
    else:
        try:
            prefix_int = int(prefix)
        except ValueError:
            raise ValueError(
                f"the rails key scheme needs an integer prefix, got {prefix!r}"
            ) from None
    return zlib.crc32(_utf8(name)) & 0x7FFFFFFF, prefix_int & 0x7FFFFFFF


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"lock name is not valid Unicode text ({error.reason} at index {error.start})"
        ) from None
