"""What the ``advisory-locks`` CLI and the Django ``advisory_locks`` command print.

Both commands show a lock name's key (as PostgreSQL sees it, or the ``GET_LOCK`` name
MySQL and MariaDB see) and the table of held and awaited locks a backend's
``list_locks`` returns; the wording lives here once so the two cannot drift apart.
"""

from __future__ import annotations

import shutil
from typing import Any, Final, TextIO

from advisory_locks._dialects.base import LockedRow
from advisory_locks._dialects.mysql import server_lock_name
from advisory_locks.keys import CALLABLE_SCHEME, KeyScheme, LockKey, derive_key, scheme_label

__all__ = [
    "key_arguments",
    "key_details",
    "key_document",
    "lock_document",
    "locks_table",
    "mysql_key_details",
    "mysql_key_document",
    "mysql_lock_name",
]

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


def lock_document(row: LockedRow) -> dict[str, Any]:
    """One row of ``list_locks`` as a JSON object."""
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
    }


def locks_table(rows: list[LockedRow], out: TextIO) -> str:
    """The rows of ``list_locks`` as a table, fitted to ``out`` when it is a terminal."""
    if not rows:
        return "No advisory locks are held or awaited in this database.\n"
    at_most = _at_most_sign(out)
    header = ("PID", "STATUS", "MODE", "FOR", "KEY", "PG_LOCKS", "APPLICATION", "CLIENT", "STATE")
    cells = [header]
    for row in rows:
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
        cells.append(
            (
                str(row.pid),
                status,
                row.mode,
                duration,
                key,
                pg_locks,
                row.application_name or "-",
                row.client_addr or "local",
                row.state or "-",
            )
        )
    widths = [max(len(line[column]) for line in cells) for column in range(len(header))]
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
    return "\n".join(line.rstrip() for line in lines) + "\n"


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
