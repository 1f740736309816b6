"""What the ``advisory-locks`` CLI and the Django ``advisory_locks`` command print.

Both commands show a lock name's key (as PostgreSQL sees it, or the ``GET_LOCK`` name
MySQL and MariaDB see) and the table of held and awaited locks a backend's
``list_locks`` returns; the wording lives here once so the two cannot drift apart.

A listed key is a hash: its name is known only where someone tells it. ``KnownNames``
holds the names an operator gave (each hashed with every key scheme, so a match also
tells the scheme), and ``identify`` adds what a row itself shows: the
``with_advisory_lock`` gem writes its lock name into the statement as a ``/* name */``
comment, which ``pg_stat_activity.query`` keeps while the holder is idle. Where the name
stays unknown, the key's shape still suggests a scheme (``guessed_scheme``).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TextIO

from advisory_locks._dialects.base import LockedRow
from advisory_locks._dialects.lease import LeaseRow
from advisory_locks._dialects.mysql import server_lock_name
from advisory_locks.keys import (
    CALLABLE_SCHEME,
    INT32_MAX,
    INT32_MIN,
    KEY_SCHEMES,
    KeyScheme,
    LockKey,
    LockName,
    derive_key,
    scheme_label,
)

__all__ = [
    "Identity",
    "KnownNames",
    "guessed_scheme",
    "identify",
    "key_arguments",
    "key_details",
    "key_document",
    "lease_document",
    "leases_table",
    "lock_cells",
    "lock_document",
    "locks_table",
    "mysql_key_details",
    "mysql_key_document",
    "mysql_lock_name",
    "prune_summary",
    "rails_comment_name",
]

ListedKey = int | tuple[int, int] | str

# The gem's lock statement: SELECT pg_try_advisory_lock(k1,k2) AS t<hex> /* name */
# (the name with "/*" and "*/" replaced by "--"). Unlock statements are not matched: a
# connection idle after one no longer holds that lock.
LOCK_CALL: Final = re.compile(
    r"\bpg_(?:try_)?advisory_(?:xact_)?lock(?:_shared)?\s*\(\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\)",
    re.IGNORECASE,
)
TRAILING_COMMENT: Final = re.compile(r"/\* (.*?) \*/\s*;?\s*$", re.DOTALL)

# Without a terminal there is no width to fit; still keep one row per lock readable.
UNFITTED_QUERY_CHARS: Final = 200
MIN_QUERY_CHARS: Final = 20


def mysql_lock_name(key: LockKey) -> str:
    """The name ``GET_LOCK`` is given for ``key`` on MySQL and MariaDB."""
    return server_lock_name(key)


def mysql_key_document(key: LockKey) -> dict[str, Any]:
    """The GET_LOCK name of ``key`` and the SQL to take it by hand, as one JSON object."""
    quoted = _mysql_quoted(server_lock_name(key))
    return {
        "name": list(key.name) if isinstance(key.name, tuple) else key.name,
        "prefix": key.prefix or None,
        "mysql_lock_name": server_lock_name(key),
        "lock_sql": f"SELECT GET_LOCK({quoted}, -1);",
        "unlock_sql": f"SELECT RELEASE_LOCK({quoted});",
    }


def mysql_key_details(key: LockKey) -> str:
    """The SQL that takes, releases and inspects ``key``'s lock in the mysql client."""
    quoted = _mysql_quoted(server_lock_name(key))
    return (
        "\n-- in the mysql/mariadb client (MariaDB: a large timeout instead of -1):\n"
        f"SELECT GET_LOCK({quoted}, -1);\n"
        f"SELECT RELEASE_LOCK({quoted});\n"
        f"SELECT IS_USED_LOCK({quoted});\n"
    )


def _mysql_quoted(server_name: str) -> str:
    return "'" + server_name.replace("\\", "\\\\").replace("'", "''") + "'"


def key_arguments(key: LockKey) -> str:
    """The key as the arguments of ``pg_advisory_lock(...)``: ``-42`` or ``42, 7``."""
    return ", ".join(str(part) for part in key.ints)


def key_document(key: LockKey, scheme: KeyScheme | None, prefix: str | None) -> dict[str, Any]:
    """The key(s) PostgreSQL sees for ``key``, its pg_locks ids and SQL, as a JSON object."""
    classid, objid, objsubid = key.pg_locks_ids()
    return {
        "name": list(key.name) if isinstance(key.name, tuple) else key.name,
        "scheme": None if scheme is None else scheme_label(scheme),
        "prefix": prefix or None,
        "key": list(key.ints) if len(key.ints) == 2 else key.ints[0],
        "pg_locks": {"classid": classid, "objid": objid, "objsubid": objsubid},
        "lock_sql": f"SELECT pg_advisory_lock({key_arguments(key)});",
        "unlock_sql": f"SELECT pg_advisory_unlock({key_arguments(key)});",
    }


def key_details(key: LockKey, scheme: KeyScheme | None, prefix: str | None) -> str:
    """``key`` explained for a terminal: its pg_locks ids and SQL to paste into psql."""
    classid, objid, objsubid = key.pg_locks_ids()
    arguments = key_arguments(key)
    if isinstance(key.name, str) and key.scheme == CALLABLE_SCHEME:
        label = "default" if scheme is None else scheme_label(scheme)
        described = f"{key.name!r} (text; keyed by the function {label}, which takes no prefix)"
    elif isinstance(key.name, str):
        label = "default" if scheme is None else scheme_label(scheme)
        described = f"{key.name!r} (text; scheme {label}, " + (
            f"prefix {prefix!r})" if prefix else "no prefix)"
        )
    elif isinstance(key.name, tuple):
        described = f"{key.name} (a pair: used as the key itself)"
    else:
        described = f"{key.name} (an integer: used as the key itself)"
    kind = "two int4 keys" if len(key.ints) == 2 else "one bigint key"
    lines = [
        "",
        f"name      {described}",
        f"key       {arguments} ({kind})",
        f"pg_locks  classid={classid} objid={objid} objsubid={objsubid}",
    ]
    if isinstance(key.name, str) and _looks_like_integer(key.name):
        lines.append(f"note      hashed as text; use --int to make {key.name} the key itself")
    if key.scheme == "hashtext" and isinstance(key.name, str) and "\x00" not in key.name:
        text = _postgres_quoted(key.prefix + key.name)
        lines.append(f"note      the server's hashtext({text}) is this key")
    lines += [
        "",
        "-- in psql:",
        f"SELECT pg_advisory_lock({arguments});",
        f"SELECT pg_advisory_unlock({arguments});",
        "SELECT pid, mode, granted FROM pg_locks WHERE locktype = 'advisory'",
        f"  AND classid = {classid} AND objid = {objid} AND objsubid = {objsubid};",
    ]
    return "\n".join(lines) + "\n"


def _postgres_quoted(text: str) -> str:
    # standard_conforming_strings (on since PostgreSQL 9.1): only the quote is special.
    return "'" + text.replace("'", "''") + "'"


def _looks_like_integer(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Identity:
    """What a listed key is known to stand for."""

    name: LockName | None = None
    # The key scheme; certain when a name was matched by hashing it, else a guess.
    scheme: str | None = None
    scheme_certain: bool = False
    source: str | None = None  # where the name came from: "given", "query comment", ...

    @property
    def scheme_shown(self) -> str:
        if self.scheme is None:
            return "-"
        return self.scheme if self.scheme_certain else f"{self.scheme}?"


@dataclass
class KnownNames:
    """Names to recognise among listed keys, each hashed with every key scheme."""

    dialect: str = "postgresql"
    by_key: dict[ListedKey, Identity] = field(default_factory=dict)

    def add(self, name: LockName, *, prefix: str | int | None, source: str) -> None:
        """Recognise ``name`` (hashed with ``prefix``) wherever its key is listed.

        Raises TypeError/ValueError for a name no scheme can hash.
        """
        if not isinstance(name, str):
            self._add(derive_key(name), None, source)
            return
        errors: list[Exception] = []
        for scheme in KEY_SCHEMES:
            try:
                key = derive_key(name, scheme=scheme, prefix=prefix)
            except ValueError as error:  # e.g. the rails scheme and a text prefix
                errors.append(error)
                continue
            self._add(key, scheme, source)
        if len(errors) == len(KEY_SCHEMES):
            raise errors[0]

    def add_held(self, keys: Iterable[LockKey], *, source: str) -> None:
        """Recognise keys this process derived itself: each knows its own scheme."""
        for key in keys:
            self._add(key, key.scheme if isinstance(key.name, str) and key.scheme else None, source)

    def _add(self, key: LockKey, scheme: str | None, source: str) -> None:
        if self.dialect == "mysql":
            # GET_LOCK sees prefix + name whatever the scheme: the scheme is not visible.
            self.by_key.setdefault(server_lock_name(key), Identity(key.name, None, False, source))
        elif scheme is None:
            guess = guessed_scheme(key.value)
            self.by_key.setdefault(key.value, Identity(key.name, guess, False, source))
        else:
            self.by_key.setdefault(key.value, Identity(key.name, scheme, True, source))

    def __contains__(self, key: object) -> bool:
        return key in self.by_key


def identify(row: LockedRow, known: KnownNames | Mapping[Any, Identity] | None = None) -> Identity:
    """What ``row``'s key stands for: a known name, the gem's comment, or a guess."""
    by_key = known.by_key if isinstance(known, KnownNames) else (known or {})
    found = by_key.get(row.key)
    if found is not None:
        return found
    commented = rails_comment_name(row)
    if commented is not None:
        key = derive_key(commented, scheme="rails", prefix=row.key[1])  # type: ignore[index]
        # The comment is the gem's only if its name hashes to the key; a name it had to
        # rewrite ("/*" -> "--") no longer does, and is shown without a certain scheme.
        matches = key.value == row.key
        return Identity(commented, "rails", matches, "query comment")
    return Identity(None, guessed_scheme(row.key), False, None)


def rails_comment_name(row: LockedRow) -> str | None:
    """The ``/* name */`` the with_advisory_lock gem put in the row's query, if any.

    Only when the query's lock call has the row's own keys: the comment then names this
    lock, not another one the connection took.
    """
    if not isinstance(row.key, tuple):
        return None
    call = LOCK_CALL.search(row.query)
    if call is None or call.group(2) is None:
        return None
    if (int(call.group(1)), int(call.group(2))) != row.key:
        return None
    comment = TRAILING_COMMENT.search(row.query, call.end())
    if comment is None or not comment.group(1).strip():
        return None
    return comment.group(1)


def guessed_scheme(key: ListedKey) -> str | None:
    """The key scheme a listed key's shape suggests, or None when nothing does.

    A pair of non-negative int4s is what the with_advisory_lock gem sends (crc32 of the
    name, masked to 31 bits, and its prefix, 0 by default); a bigint within the int4
    range is a small integer key or PostgreSQL's ``hashtext()``; any other bigint is a
    64-bit hash (sha256, pglock or another), which only the name can tell apart.
    """
    if isinstance(key, str):
        return None
    if isinstance(key, tuple):
        first, second = key
        return "rails" if first >= 0 and second >= 0 else None
    return "int4" if INT32_MIN <= key <= INT32_MAX else None


def lock_document(row: LockedRow, identity: Identity | None = None) -> dict[str, Any]:
    """One row of ``list_locks`` as a JSON object."""
    identity = identify(row) if identity is None else identity
    pg_locks = None
    if not isinstance(row.key, str):
        classid, objid, objsubid = derive_key(row.key).pg_locks_ids()
        pg_locks = {"classid": classid, "objid": objid, "objsubid": objsubid}
    return {
        "pid": row.pid,
        "key": list(row.key) if isinstance(row.key, tuple) else row.key,
        "pg_locks": pg_locks,
        "mode": row.mode,
        "granted": row.granted,
        "waiting_seconds": row.waiting_seconds,
        "held_at_most_seconds": row.held_at_most_seconds,
        "application_name": row.application_name,
        "client_addr": row.client_addr,
        "state": row.state,
        "query": row.query,
        "name": list(identity.name) if isinstance(identity.name, tuple) else identity.name,
        "name_source": identity.source,
        "scheme": identity.scheme,
        "scheme_certain": identity.scheme_certain,
    }


def locks_table(
    rows: list[LockedRow], out: TextIO, known: KnownNames | Mapping[Any, Identity] | None = None
) -> str:
    """The rows of ``list_locks`` as a table, fitted to ``out`` when it is a terminal.

    SCHEME is the key scheme (``?``: guessed from the key's shape); NAME the lock's name
    where ``known`` or the row's query tells it.
    """
    if not rows:
        return "No advisory locks are held or awaited in this database.\n"
    at_most = _at_most_sign(out)
    cells = [
        LOCK_CELLS_HEADER,
        *(lock_cells(row, identify(row, known), at_most) for row in rows),
    ]
    widths = [max(len(line[column]) for line in cells) for column in range(len(cells[0]))]
    prefix_width = sum(widths) + 2 * len(widths)
    if out.isatty():
        room = max(MIN_QUERY_CHARS, shutil.get_terminal_size().columns - prefix_width)
    else:
        room = UNFITTED_QUERY_CHARS
    queries = ["QUERY", *(_shorten(" ".join(row.query.split()), room) for row in rows)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        + "  "
        + query
        for line, query in zip(cells, queries, strict=True)
    ]
    lines.append("")
    if any(row.granted for row in rows):
        lines.append(f"{at_most} held at most this long (since the holder's connection started)")
    lines.append("QUERY is the connection's current statement, or its last one when STATE is idle")
    if any(identify(row, known).scheme_shown.endswith("?") for row in rows):
        lines.append("SCHEME? is guessed from the key's shape; --name NAME tells the name")
    return "\n".join(line.rstrip() for line in lines) + "\n"


LOCK_CELLS_HEADER: Final = (
    "PID",
    "STATUS",
    "MODE",
    "FOR",
    "KEY",
    "SCHEME",
    "NAME",
    "PG_LOCKS",
    "APPLICATION",
    "CLIENT",
    "STATE",
)


def lock_cells(row: LockedRow, identity: Identity, at_most: str = "≤") -> tuple[str, ...]:
    """One row of ``list_locks`` as the texts of ``LOCK_CELLS_HEADER``'s columns (the
    query aside): a holder's time is an upper bound, marked with ``at_most``."""
    if isinstance(row.key, str):  # MySQL: the server knows the lock by this name
        pg_locks = "-"
    else:
        classid, objid, objsubid = derive_key(row.key).pg_locks_ids()
        pg_locks = f"{classid}/{objid}/{objsubid}"
    if row.granted:
        status, duration = "held", _duration(row.held_at_most_seconds, at_most)
    else:
        status, duration = "waiting", _duration(row.waiting_seconds, "")
    key = ",".join(map(str, row.key)) if isinstance(row.key, tuple) else str(row.key)
    return (
        str(row.pid),
        status,
        row.mode,
        duration,
        key,
        identity.scheme_shown,
        _name_cell(identity.name),
        pg_locks,
        row.application_name or "-",
        row.client_addr or "local",
        row.state or "-",
    )


def lease_document(row: LeaseRow) -> dict[str, Any]:
    """One row of the lease table as a JSON object; times are the database server's."""
    return {
        "name": row.name,
        "held": row.held,
        "holder": row.holder,
        "token": row.token,
        "acquired_seconds_ago": row.held_for,
        "expires_in_seconds": row.expires_in,
    }


def leases_table(rows: list[LeaseRow]) -> str:
    """The rows of the lease table: who holds each lease, its fencing token, since when
    and until when, all by the database server's clock (a client clock plays no part)."""
    if not rows:
        return "No leases in this database.\n"
    header = ("NAME", "STATUS", "HOLDER", "TOKEN", "ACQUIRED", "EXPIRES IN")
    cells = [header]
    for row in rows:
        if row.held:
            status = "held"
        elif row.holder is not None:
            status = "expired"
        else:
            status = "free"
        acquired = "-" if row.held_for is None else f"{_duration(row.held_for, '')} ago"
        if row.expires_in is None:
            expires = "-"
        elif row.expires_in > 0:
            expires = _duration(row.expires_in, "")
        else:
            expires = f"expired {_duration(-row.expires_in, '')} ago"
        cells.append((row.name, status, row.holder or "-", str(row.token), acquired, expires))
    widths = [max(len(line[column]) for line in cells) for column in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    ]
    lines.append("")
    lines.append("Times are the database server's; TOKEN counts the acquisitions of each name")
    return "\n".join(lines) + "\n"


def prune_summary(pruned: int, older_than: float) -> str:
    """What ``leases --prune`` did, in one line."""
    leases = "lease" if pruned == 1 else "leases"
    return (
        f"Pruned {pruned} {leases} expired more than {older_than:g} s ago "
        "(holders cleared; rows and tokens kept).\n"
    )


def _name_cell(name: LockName | None) -> str:
    if name is None:
        return "-"
    if isinstance(name, tuple):
        return ",".join(map(str, name))
    return repr(name) if isinstance(name, str) else str(name)


def _duration(seconds: float | None, qualifier: str) -> str:
    if seconds is None:
        return "?"
    text = f"{seconds:.1f}s" if seconds < 600 else f"{seconds / 60:.0f}min"
    return f"{qualifier} {text}" if qualifier else text


def _at_most_sign(out: TextIO) -> str:
    # Consoles with a legacy encoding cannot print the mathematical sign.
    try:
        "≤".encode(getattr(out, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "<="
    return "≤"


def _shorten(text: str, room: int) -> str:
    return text if len(text) <= room else text[: room - 3] + "..."
