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
    (``WITH_ADVISORY_LOCK_PREFIX`` in Ruby) and defaults to 0. On MySQL and MariaDB the
    gem locks the text ``prefix + name`` itself (see ``server_lock_name``).
``hashtext``
    the int4 PostgreSQL's ``hashtext(prefix + name)`` returns, as one bigint key, so
    ``pg_advisory_lock(hashtext('nightly-report'))`` written in psql is the same lock.
    Computed here, not by the server: Bob Jenkins' ``hash_bytes`` of the UTF-8 text, as
    PostgreSQL 12 and later compute it on little-endian machines for a UTF8 database and
    a deterministic collation.
a callable ``name -> int | (int, int)``
    any other key function (a legacy md5-based one, say). It receives the name as given,
    without the prefix, and its result is validated like an integer or pair name.

The prefix (a namespace, so two applications on one database do not collide) applies to
string names only; integer and pair names are already the key.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Final, Literal, TypeAlias

__all__ = [
    "DEFAULT_SCHEME",
    "KEY_SCHEMES",
    "KeyFunction",
    "KeyScheme",
    "LockKey",
    "LockName",
    "derive_key",
    "lock_key",
]

LockName: TypeAlias = str | int | tuple[int, int]
KeyFunction: TypeAlias = Callable[[str], int | tuple[int, int]]
"""A key scheme of your own: takes the name as given, returns one bigint or an int4 pair."""
KeyScheme: TypeAlias = str | KeyFunction
"""A scheme's name (one of ``KEY_SCHEMES``) or a ``KeyFunction``."""

DEFAULT_SCHEME: Final = "sha256"
KEY_SCHEMES: Final[tuple[str, ...]] = ("sha256", "pglock", "rails", "hashtext")
# LockKey.scheme of a key a KeyFunction made.
CALLABLE_SCHEME: Final = "callable"

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
    # The scheme that turned a string name into the key ("" for int and pair names): MySQL
    # sends a rails name to GET_LOCK as the gem does.
    scheme: str = ""

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
    name: LockName, *, scheme: KeyScheme | None = None, prefix: str | int | None = None
) -> int | tuple[int, int]:
    """Return the key(s) sent to the server for ``name``.

    :param name: a non-empty ``str`` (turned into a key by ``scheme``), an ``int`` (a
        signed 64-bit key, used as is) or an ``(int, int)`` pair (two signed 32-bit keys).
    :param scheme: how a ``str`` becomes a key: ``"sha256"``, ``"pglock"``, ``"rails"``,
        ``"hashtext"``, or a function ``name -> int | (int, int)``; default
        ``$ADVISORY_LOCKS_KEY_SCHEME``, else ``"sha256"``.
    :param prefix: a namespace for ``str`` names (the ``rails`` scheme's is an integer;
        a function scheme gets the name without it); default ``$ADVISORY_LOCKS_PREFIX``.
    :raises TypeError: a name, prefix, or function result of the wrong type.
    :raises ValueError: an empty name, an out-of-range integer, an unknown scheme.
    """
    return derive_key(name, scheme=scheme, prefix=prefix).value


def derive_key(
    name: object, *, scheme: KeyScheme | None = None, prefix: str | int | None = None
) -> LockKey:
    """Validate ``name`` and derive its key; raise TypeError/ValueError on bad input.

    The arguments are those of ``lock_key``; the result also keeps the name, the prefix
    text and the scheme's name.
    """
    if name.__class__ is str and scheme is None and prefix is None:
        # The usual call, answered first: a plain string name, with the scheme and prefix
        # the environment says.
        if not name:
            raise ValueError("lock name must not be empty")
        reader = _reader  # _environment()'s usual answer, neither variable set, first
        data = reader[1]
        if reader[0] is os.environ and reader[2] not in data and reader[3] not in data:
            return _string_key(name, DEFAULT_SCHEME, None)
        prefix, scheme = _environment()
        return _string_key(name, _resolve_scheme(scheme) if scheme else DEFAULT_SCHEME, prefix)
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
    environment_prefix, environment_scheme = _environment()
    prefix = environment_prefix if prefix is None else prefix
    if prefix is not None and (isinstance(prefix, bool) or not isinstance(prefix, (str, int))):
        # Checked before the cache, which would otherwise answer True as it did 1.
        raise TypeError(f"key prefix must be str or int, not {type(prefix).__name__}")
    if scheme is not None and not isinstance(scheme, str):
        if not callable(scheme):
            raise TypeError(
                f"key scheme must be a scheme's name or a function, not {type(scheme).__name__}"
            )
        return _function_key(name, scheme)
    if scheme is None:
        scheme = environment_scheme or DEFAULT_SCHEME
    return _string_key(name, _resolve_scheme(scheme), prefix)


def _function_key(name: str, function: KeyFunction) -> LockKey:
    # Not cached: the function is the user's, and nothing says it is pure or cheap to keep.
    # Its result is held to the rules of an int or pair name, so a bad one fails here,
    # before any SQL, rather than as a server error or a silently different lock.
    result: object = function(name)
    if isinstance(result, bool) or not isinstance(result, (int, tuple)):
        raise TypeError(
            f"{_returned(function, name, result)}; expected an int or a tuple of two ints"
        )
    if isinstance(result, int):
        if not INT64_MIN <= result <= INT64_MAX:
            raise ValueError(f"{_returned(function, name, result)}, outside the 64-bit range")
        return LockKey(name, (int(result),), "", CALLABLE_SCHEME)
    try:
        pair = _validate_pair(result)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{_returned(function, name, result)}: {error}") from None
    return LockKey(name, pair, "", CALLABLE_SCHEME)


def _returned(function: KeyFunction, name: str, result: object) -> str:
    shown = name if len(name) <= 80 else name[:80] + "..."
    return f"key scheme {_function_label(function)} returned {result!r} for {shown!r}"


def scheme_label(scheme: KeyScheme) -> str:
    """How a scheme is named in messages and command output: its name, or for a function
    its dotted module and qualified name."""
    if isinstance(scheme, str):
        return scheme
    return _function_label(scheme)


def _function_label(function: object) -> str:
    module = getattr(function, "__module__", None)
    qualified = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{qualified}" if module else str(qualified)


# Applications lock the same few names over and over (a job's name, "checkout:<sku>"):
# hashing and validating again is a measurable part of a lock's client time. The cache is
# keyed on the scheme and prefix AFTER the environment was read, so changing
# $ADVISORY_LOCKS_KEY_SCHEME or $ADVISORY_LOCKS_PREFIX takes effect at once; LockKey is
# frozen, so handing one instance to many locks is safe. Errors are not cached.
@lru_cache(maxsize=4096)
def _string_key(name: str, scheme: str, prefix: str | int | None) -> LockKey:
    text_prefix = _text_prefix(prefix)
    if scheme == "rails":
        return LockKey(name, _rails_key(name, prefix), text_prefix, scheme)
    if scheme == "hashtext":
        return LockKey(name, (_hashtext(_utf8(text_prefix + name)),), text_prefix, scheme)
    digest = hashlib.sha256(_utf8(text_prefix + name)).digest()
    order: Literal["big", "little"] = "little" if scheme == "pglock" else "big"
    key = int.from_bytes(digest[:8], order, signed=True)
    return LockKey(name, (key,), text_prefix, scheme)


def _environment() -> tuple[str | None, str | None]:
    """``$ADVISORY_LOCKS_PREFIX`` and ``$ADVISORY_LOCKS_KEY_SCHEME`` (None when unset),
    read on every lock named by a string, so a change applies at once.

    ``os.environ.get`` of an unset variable raises and catches a KeyError inside the
    mapping, which costs more than the rest of deriving a key. ``os.environ`` keeps its
    contents in ``_data`` under ``encodekey(name)`` and hands values out through
    ``decodevalue`` (CPython's ``os._Environ`` since 3.2, on every platform); reading the
    same entries that way never raises. Anything else falls back to the mapping.
    """
    global _reader
    environ = os.environ
    reader = _reader
    if reader[0] is not environ:
        data = getattr(environ, "_data", None)
        encode = getattr(environ, "encodekey", None)
        decode = getattr(environ, "decodevalue", None)
        if not isinstance(data, dict) or not callable(encode) or not callable(decode):
            return environ.get(PREFIX_ENV), environ.get(SCHEME_ENV)
        reader = _reader = (environ, data, encode(PREFIX_ENV), encode(SCHEME_ENV), decode)
    data = reader[1]
    if reader[2] not in data and reader[3] not in data:  # the usual answer: neither is set
        return _UNSET
    prefix, scheme, decode = data.get(reader[2]), data.get(reader[3]), reader[4]
    return (
        None if prefix is None else decode(prefix),
        None if scheme is None else decode(scheme),
    )


_UNSET: Final = (None, None)


# (the os.environ read, its _data, the two encoded names, decodevalue), for _environment;
# no mapping is ever the first, so the first read fills it.
_reader: tuple[object, dict[object, object], object, object, Callable[..., str]] = (
    None,
    {},
    None,
    None,
    str,
)


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


def _resolve_scheme(scheme: str) -> str:
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


# --- PostgreSQL's hashtext() ------------------------------------------------------------
#
# hashtext(text) is hash_any() of the text's bytes (for a deterministic collation), and
# hash_any() is Bob Jenkins' 2006 hash as PostgreSQL's src/common/hashfn.c adapts it
# (hash_bytes). It works on three unsigned 32-bit words; Python ints are unbounded, so
# every step is reduced modulo 2**32. The words are read little-endian, as the server
# reads them on x86-64 and ARM64; a big-endian server computes different values.

_WORD: Final = 0xFFFFFFFF
# The starting value of a, b and c before the length is added: the golden ratio
# constant plus PostgreSQL's own seed, 3923095.
_HASH_START: Final = (0x9E3779B9 + 3923095) & _WORD


def _rotated(word: int, bits: int) -> int:
    return ((word << bits) | (word >> (32 - bits))) & _WORD


def _mixed(a: int, b: int, c: int) -> tuple[int, int, int]:
    # Jenkins' mix(): six rounds, each subtracting, xor-ing a rotation, and adding.
    for rotate_a, rotate_b, rotate_c in ((4, 6, 8), (16, 19, 4)):
        a = ((a - c) & _WORD) ^ _rotated(c, rotate_a)
        c = (c + b) & _WORD
        b = ((b - a) & _WORD) ^ _rotated(a, rotate_b)
        a = (a + c) & _WORD
        c = ((c - b) & _WORD) ^ _rotated(b, rotate_c)
        b = (b + a) & _WORD
    return a, b, c


def _finished(a: int, b: int, c: int) -> int:
    # Jenkins' final(): folds a and b into c; c is the hash.
    c = ((c ^ b) - _rotated(b, 14)) & _WORD
    a = ((a ^ c) - _rotated(c, 11)) & _WORD
    b = ((b ^ a) - _rotated(a, 25)) & _WORD
    c = ((c ^ b) - _rotated(b, 16)) & _WORD
    a = ((a ^ c) - _rotated(c, 4)) & _WORD
    b = ((b ^ a) - _rotated(a, 14)) & _WORD
    return ((c ^ b) - _rotated(b, 24)) & _WORD


def _hashtext(data: bytes) -> int:
    """What PostgreSQL's ``hashtext()`` returns for text whose UTF-8 bytes are ``data``.

    A signed 32-bit int, as the SQL function's ``integer`` result. Valid for PostgreSQL
    12 and later on little-endian machines, for a UTF8 database and a deterministic
    collation (the default; for a nondeterministic one the server hashes a sort key).
    """
    a = b = c = (_HASH_START + len(data)) & _WORD
    whole_blocks = len(data) - len(data) % 12
    # Every full 12-byte block is mixed in, including the last one when the length is a
    # multiple of 12 (the server loops while at least 12 bytes remain).
    for start in range(0, whole_blocks, 12):
        a = (a + int.from_bytes(data[start : start + 4], "little")) & _WORD
        b = (b + int.from_bytes(data[start + 4 : start + 8], "little")) & _WORD
        c = (c + int.from_bytes(data[start + 8 : start + 12], "little")) & _WORD
        a, b, c = _mixed(a, b, c)
    # The last 0..11 bytes are added without a mix. Bytes 8..10 go one byte up in c: in
    # Jenkins' design c's lowest byte is kept for the length.
    tail = data[whole_blocks:]
    a = (a + int.from_bytes(tail[0:4], "little")) & _WORD
    b = (b + int.from_bytes(tail[4:8], "little")) & _WORD
    c = (c + (int.from_bytes(tail[8:11], "little") << 8)) & _WORD
    result = _finished(a, b, c)
    return result - 2**32 if result > INT32_MAX else result


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"lock name is not valid Unicode text ({error.reason} at index {error.start})"
        ) from None
