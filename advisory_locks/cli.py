"""The ``advisory-locks`` command: print a name's key, list the locks a database holds.

``key`` needs only the standard library, so it works wherever the package is installed;
``list`` connects through SQLAlchemy and the dialect backend, like the library itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from advisory_locks._monitoring import (
    KnownNames,
    identify,
    key_arguments,
    key_details,
    key_document,
    lease_document,
    leases_table,
    lock_document,
    locks_table,
    mysql_key_details,
    mysql_key_document,
    mysql_lock_name,
    prune_summary,
)
from advisory_locks.errors import AdvisoryLockError
from advisory_locks.keys import (
    DEFAULT_SCHEME,
    KEY_SCHEMES,
    PREFIX_ENV,
    SCHEME_ENV,
    LockKey,
    LockName,
    derive_key,
)

if TYPE_CHECKING:
    from advisory_locks._dialects.base import LockedRow
    from advisory_locks._dialects.lease import LeaseRow

__all__ = ["main"]

PROGRAM = "advisory-locks"
URL_ENVIRONMENT = ("ADVISORY_LOCKS_URL", "DATABASE_URL")
USAGE_ERROR = 2
CONNECT_TIMEOUT_SECONDS = 10
WATCH_INTERVAL_SECONDS = 2.0
# Cursor home, then erase the screen: each listing of --watch replaces the last.
CLEAR_SCREEN = "\x1b[H\x1b[2J"

KEY_EPILOG = f"""\
A NAME is always text, hashed by the key scheme: `key 42` is the key of the string "42".
Pass --int to use an integer as the key itself, or --pair A B for PostgreSQL's two-key form.

On a terminal the key is followed by its pg_locks ids and SQL to paste into psql. When
the output is piped, only the key line is printed, as the arguments of
pg_advisory_lock(...) (a pair as "A, B"), so scripts can write
  psql -c "SELECT pg_advisory_lock($({PROGRAM} key nightly-report))"
(--details prints everything anyway; --json prints it as one JSON object.)

Defaults come from ${SCHEME_ENV} and ${PREFIX_ENV}, like the library.
"""

LIST_EPILOG = f"""\
FOR is how long a waiter has waited, or for a holder an upper bound:
PostgreSQL does not record when an advisory lock was granted, so it shows the time since
the holder's connection started. Only the current database's locks are listed.

A key is a hash of its name: NAME shows the names you give (--name, --names-file), each
hashed with every key scheme and the prefix (--prefix, default ${PREFIX_ENV}), so
a match also tells the SCHEME; and the names the Ruby with_advisory_lock gem writes into
its lock statements as /* name */ comments, while the holder is idle after taking it.
Otherwise SCHEME is guessed from the key (marked ?): a pair of non-negative keys is the
gem's (prefix 0 by default), a bigint in the int4 range a small integer or hashtext().

--watch lists again every --interval seconds until Ctrl-C, on a terminal in place of the
previous listing (with --json: one JSON array per line).
"""


class UsageError(Exception):
    """A problem with what the user asked for; reported on stderr with exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    parser = _parser()
    try:
        arguments = parser.parse_args(argv)
    except SystemExit as exit_:
        # argparse exits for --help and usage errors; callers of main() get a status.
        return exit_.code if isinstance(exit_.code, int) else USAGE_ERROR
    if arguments.command is None:
        parser.print_help(sys.stderr)
        return USAGE_ERROR
    try:
        if arguments.command == "key":
            return _run_key(arguments, sys.stdout)
        if arguments.command == "leases":
            return _run_leases(arguments, sys.stdout)
        return _run_list(arguments, sys.stdout)
    except UsageError as error:
        print(f"{PROGRAM} {arguments.command}: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM, description="Inspect database advisory locks taken by advisory-locks."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    key = commands.add_parser(
        "key",
        help="print the key(s) the server sees for a lock name",
        description="Print the key(s) the database server sees for a lock name.",
        epilog=KEY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    key.add_argument("name", nargs="?", metavar="NAME", help="the lock name (text)")
    key.add_argument(
        "--scheme",
        choices=KEY_SCHEMES,
        help=f"how text becomes a key (default: ${SCHEME_ENV} or {DEFAULT_SCHEME})",
    )
    key.add_argument("--prefix", help=f"namespace prepended to text names (default: ${PREFIX_ENV})")
    key.add_argument(
        "--int", action="store_true", help="NAME is a signed 64-bit integer key, not text"
    )
    key.add_argument(
        "--pair",
        nargs=2,
        type=int,
        metavar=("A", "B"),
        help="the two signed 32-bit keys of PostgreSQL's two-key form (instead of NAME)",
    )
    key.add_argument(
        "--dialect",
        choices=("postgresql", "mysql"),
        default="postgresql",
        help="show the key as this database sees it: PostgreSQL's integer key(s) "
        "(default), or the GET_LOCK name on MySQL/MariaDB",
    )
    output = key.add_mutually_exclusive_group()
    output.add_argument(
        "--details", action="store_true", help="explain the key even when output is piped"
    )
    output.add_argument("--json", action="store_true", help="print one JSON object")

    list_ = commands.add_parser(
        "list",
        help="show held and awaited advisory locks",
        description="Show the advisory locks held and awaited in a PostgreSQL, MySQL or "
        "MariaDB database.",
        epilog=LIST_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    list_.add_argument(
        "--url",
        help="database URL, e.g. postgresql://user@host/db or any SQLAlchemy URL "
        f"(default: ${URL_ENVIRONMENT[0]}, then ${URL_ENVIRONMENT[1]})",
    )
    list_.add_argument("--json", action="store_true", help="print a JSON array, one object a lock")
    list_.add_argument(
        "--name",
        action="append",
        default=[],
        metavar="NAME",
        help="a lock name to recognise among the keys (repeatable)",
    )
    list_.add_argument(
        "--names-file",
        metavar="FILE",
        help="read names to recognise from FILE, one a line (# comments; - for stdin)",
    )
    list_.add_argument(
        "--prefix", help=f"namespace the names were hashed with (default: ${PREFIX_ENV})"
    )
    list_.add_argument(
        "--watch", action="store_true", help="list again every --interval seconds until Ctrl-C"
    )
    list_.add_argument(
        "--interval",
        type=_positive_seconds,
        metavar="S",
        help=f"seconds between listings with --watch (default: {WATCH_INTERVAL_SECONDS:g})",
    )
    list_.add_argument(
        "--count",
        type=_positive_count,
        metavar="N",
        help="with --watch, stop after N listings",
    )

    leases = commands.add_parser(
        "leases",
        help="show lease locks: holder, fencing token, acquired, expires in",
        description="Show the lease locks of a PostgreSQL, MySQL, MariaDB or SQLite database "
        "(the rows of advisory_locks_lease), timed by the database server's clock.",
    )
    leases.add_argument(
        "--url",
        help="database URL, e.g. postgresql://user@host/db or any SQLAlchemy URL "
        f"(default: ${URL_ENVIRONMENT[0]}, then ${URL_ENVIRONMENT[1]})",
    )
    leases.add_argument(
        "--json", action="store_true", help="print a JSON array, one object a lease"
    )
    leases.add_argument(
        "--prune",
        type=_age,
        metavar="AGE",
        help="instead of listing, clear the holders of leases expired for more than AGE "
        "(seconds, or 90s, 15m, 2h, 7d) by the database's clock; rows and their tokens "
        "stay, so tokens never reset",
    )
    return parser


def _age(text: str) -> float:
    from advisory_locks._core.prune import parse_age

    try:
        return parse_age(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, not {text}")
    return seconds


def _positive_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {count}")
    return count


# --- key ----------------------------------------------------------------------------------


def _run_key(arguments: argparse.Namespace, out: TextIO) -> int:
    name = _name_from(arguments)
    scheme: str | None = None
    prefix: str | None = None
    if isinstance(name, str):
        scheme = arguments.scheme or os.environ.get(SCHEME_ENV) or DEFAULT_SCHEME
        prefix = arguments.prefix if arguments.prefix is not None else os.environ.get(PREFIX_ENV)
    try:
        key = derive_key(name, scheme=scheme, prefix=prefix)
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None
    if arguments.dialect == "mysql":
        return _print_mysql_name(key, arguments, out)
    if arguments.json:
        json.dump(key_document(key, scheme, prefix), out, ensure_ascii=False)
        out.write("\n")
        return 0
    out.write(key_arguments(key) + "\n")
    if arguments.details or out.isatty():
        out.write(key_details(key, scheme, prefix))
    return 0


def _print_mysql_name(key: LockKey, arguments: argparse.Namespace, out: TextIO) -> int:
    if arguments.json:
        json.dump(mysql_key_document(key), out, ensure_ascii=False)
        out.write("\n")
        return 0
    out.write(mysql_lock_name(key) + "\n")
    if arguments.details or out.isatty():
        out.write(mysql_key_details(key))
    return 0


def _name_from(arguments: argparse.Namespace) -> LockName:
    if arguments.pair is not None:
        if arguments.name is not None or arguments.int:
            raise UsageError("give either NAME or --pair A B, not both")
        first, second = arguments.pair
        return (first, second)
    if arguments.name is None:
        raise UsageError("a NAME (or --pair A B) is required")
    if arguments.int:
        try:
            return int(arguments.name)
        except ValueError:
            raise UsageError(f"--int needs an integer NAME, not {arguments.name!r}") from None
    if not isinstance(arguments.name, str):  # pragma: no cover - argparse gives str
        raise UsageError("NAME must be text")
    return str(arguments.name)


# --- list ---------------------------------------------------------------------------------


def _url_from(arguments: argparse.Namespace) -> str:
    url: str | None = arguments.url or next(
        (os.environ[name] for name in URL_ENVIRONMENT if os.environ.get(name)), None
    )
    if not url:
        raise UsageError(
            f"no database: pass --url or set ${URL_ENVIRONMENT[0]} or ${URL_ENVIRONMENT[1]}"
        )
    return url


def _run_leases(arguments: argparse.Namespace, out: TextIO) -> int:
    if arguments.prune is not None:
        pruned = _prune_leases(_url_from(arguments), arguments.prune)
        if arguments.json:
            json.dump({"pruned": pruned}, out)
            out.write("\n")
        else:
            out.write(prune_summary(pruned, arguments.prune))
        return 0
    rows = _fetch_leases(_url_from(arguments))
    if arguments.json:
        json.dump([lease_document(row) for row in rows], out, ensure_ascii=False, indent=2)
        out.write("\n")
    else:
        out.write(leases_table(rows))
    return 0


def _fetch_leases(url_text: str) -> list[LeaseRow]:
    """The rows of the lease table in the database at ``url_text``."""
    try:
        from sqlalchemy.exc import SQLAlchemyError
    except ImportError:
        raise UsageError("needs SQLAlchemy: pip install 'advisory-locks[sqlalchemy]'") from None
    from advisory_locks._bindings.sqlalchemy_lease import CREATE_HINT
    from advisory_locks._core.steps import on, run_steps
    from advisory_locks._dialects.lease import lease_backend_for_dialect

    shown = url_text
    try:
        url = _sync_url(url_text)
        shown = url.render_as_string(hide_password=True)
        backend = lease_backend_for_dialect(url.get_backend_name())
        with _connected(url) as executor:
            try:
                rows: list[LeaseRow] = run_steps(on(executor, backend.list_leases()))
            except Exception as error:
                if backend.is_missing_table(error):
                    raise UsageError(f"no leases on {shown}: {CREATE_HINT}") from None
                raise UsageError(f"cannot list leases on {shown}: {_first_line(error)}") from None
            return rows
    except (SQLAlchemyError, AdvisoryLockError, ImportError, ValueError) as error:
        raise UsageError(f"cannot list leases on {shown}: {_first_line(error)}") from None


def _prune_leases(url_text: str, older_than: float) -> int:
    """Prune the leases of the database at ``url_text`` (``prune_leases()``)."""
    try:
        from sqlalchemy import create_engine
        from sqlalchemy.exc import SQLAlchemyError
        from sqlalchemy.pool import NullPool
    except ImportError:
        raise UsageError("needs SQLAlchemy: pip install 'advisory-locks[sqlalchemy]'") from None
    from advisory_locks._bindings.sqlalchemy_lease import CREATE_HINT
    from advisory_locks._core.dispatch import prune_leases
    from advisory_locks.errors import LeaseTableMissing

    shown = url_text
    try:
        url = _sync_url(url_text)
        shown = url.render_as_string(hide_password=True)
        engine = create_engine(url, poolclass=NullPool, connect_args=_connect_args(url))
        try:
            return prune_leases(engine, older_than=older_than)
        finally:
            engine.dispose()
    except LeaseTableMissing:
        raise UsageError(f"no leases on {shown}: {CREATE_HINT}") from None
    except (SQLAlchemyError, AdvisoryLockError, ImportError, ValueError) as error:
        raise UsageError(f"cannot prune leases on {shown}: {_first_line(error)}") from None


def _connect_args(url: Any) -> dict[str, Any]:
    connect_args: dict[str, Any] = {}
    if url.get_driver_name() in ("psycopg", "psycopg2") and "connect_timeout" not in url.query:
        connect_args["connect_timeout"] = CONNECT_TIMEOUT_SECONDS
    return connect_args


@contextlib.contextmanager
def _connected(url: Any) -> Iterator[Any]:
    """An executor on a new connection to ``url`` (closed at the end)."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    from advisory_locks._core.executors import DBAPIExecutor

    engine = create_engine(url, poolclass=NullPool, connect_args=_connect_args(url))
    try:
        with engine.connect() as connection:
            yield DBAPIExecutor(connection.connection.dbapi_connection)
    finally:
        engine.dispose()


def _run_list(arguments: argparse.Namespace, out: TextIO) -> int:
    url = _url_from(arguments)
    if not arguments.watch and (arguments.interval is not None or arguments.count is not None):
        raise UsageError("--interval and --count go with --watch")
    names = [*arguments.name, *_names_from_file(arguments.names_file)]
    prefix = arguments.prefix if arguments.prefix is not None else os.environ.get(PREFIX_ENV)
    rows, dialect = _fetch_locks(url)
    known = KnownNames(dialect)
    for name in names:
        try:
            known.add(name, prefix=prefix, source="given")
        except (TypeError, ValueError) as error:
            raise UsageError(f"cannot hash the name {name!r}: {error}") from None
    if arguments.watch:
        return _watch(arguments, url, out, rows, known)
    if arguments.json:
        documents = [lock_document(row, identify(row, known)) for row in rows]
        json.dump(documents, out, ensure_ascii=False, indent=2)
        out.write("\n")
    else:
        out.write(locks_table(rows, out, known))
    return 0


def _watch(
    arguments: argparse.Namespace,
    url: str,
    out: TextIO,
    first: list[LockedRow],
    known: KnownNames,
) -> int:
    """List every ``--interval`` seconds until Ctrl-C (or ``--count`` listings), starting
    with the ``first`` listing."""
    interval = arguments.interval or WATCH_INTERVAL_SECONDS
    terminal = out.isatty()
    rows: list[LockedRow] | None = first
    problem = ""
    listed = 0
    try:
        while True:
            if arguments.json:
                if rows is None:
                    print(f"{PROGRAM} list: {problem}", file=sys.stderr, flush=True)
                else:
                    documents = [lock_document(row, identify(row, known)) for row in rows]
                    json.dump(documents, out, ensure_ascii=False)
                    out.write("\n")
            else:
                header = (
                    f"Every {interval:g}s: advisory locks on {_shown_url(url)}"
                    f"  {time.strftime('%H:%M:%S')}  (Ctrl-C to stop)\n\n"
                )
                body = locks_table(rows, out, known) if rows is not None else problem + "\n"
                out.write((CLEAR_SCREEN if terminal else "\n" if listed else "") + header + body)
            out.flush()
            listed += 1
            if arguments.count is not None and listed >= arguments.count:
                return 0
            time.sleep(interval)
            try:
                rows, problem = _fetch_locks(url)[0], ""
            except UsageError as error:
                # The server went away (a restart, a failover): say so, and keep trying.
                rows, problem = None, str(error)
    except KeyboardInterrupt:
        out.write("\n")
        return 0


def _shown_url(url_text: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url_text).render_as_string(hide_password=True)
    except Exception:
        return "the database"


def _names_from_file(path: str | None) -> list[str]:
    """The names in a --names-file: one a line, blank lines and # comments skipped."""
    if path is None:
        return []
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as file:
                text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read --names-file {path}: {error}") from None
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _fetch_locks(url_text: str) -> tuple[list[LockedRow], str]:
    """The locks listed by the server at ``url_text``, and the backend's dialect name."""
    try:
        from sqlalchemy import create_engine
        from sqlalchemy.exc import SQLAlchemyError
        from sqlalchemy.pool import NullPool
    except ImportError:
        raise UsageError("needs SQLAlchemy: pip install 'advisory-locks[sqlalchemy]'") from None
    from advisory_locks._core.executors import DBAPIExecutor
    from advisory_locks._core.steps import on, run_steps
    from advisory_locks._dialects import backend_for_dialect

    shown = url_text
    try:
        url = _sync_url(url_text)
        shown = url.render_as_string(hide_password=True)
        connect_args = {}
        if url.get_driver_name() in ("psycopg", "psycopg2") and "connect_timeout" not in url.query:
            connect_args["connect_timeout"] = CONNECT_TIMEOUT_SECONDS
        backend = backend_for_dialect(url.get_backend_name())
        engine = create_engine(url, poolclass=NullPool, connect_args=connect_args)
        try:
            with engine.connect() as connection:
                pooled = connection.connection
                executor = DBAPIExecutor(pooled.dbapi_connection)
                rows = run_steps(on(executor, backend.list_locks(executor.state)))
                return rows, backend.dialect_name
        finally:
            engine.dispose()
    except (SQLAlchemyError, AdvisoryLockError, ImportError, ValueError) as error:
        raise UsageError(f"cannot list locks on {shown}: {_first_line(error)}") from None


def _sync_url(text: str) -> Any:
    from sqlalchemy.engine import make_url

    url = make_url(text)
    backend, _, driver = url.drivername.partition("+")
    # Heroku-style DATABASE_URLs say postgres://, which SQLAlchemy no longer accepts.
    if backend == "postgres":
        backend = "postgresql"
    # A bare URL means one particular driver to SQLAlchemy (postgresql:// psycopg2,
    # mysql:// mysqlclient), installed or not: use whichever of the database's drivers is
    # installed instead. Async drivers need an event loop for nothing here: a sync one too.
    if backend == "postgresql" and driver in ("", "asyncpg", "psycopg_async"):
        driver = "psycopg" if _installed("psycopg") else "psycopg2"
    elif backend in ("mysql", "mariadb") and driver in ("", "aiomysql", "asyncmy"):
        driver = installed_mysql_driver()
    return url.set(drivername=f"{backend}+{driver}" if driver else backend)


def installed_mysql_driver() -> str:
    """SQLAlchemy's name for the MySQL driver installed here: mysqlclient, else PyMySQL.

    mysqlclient (``MySQLdb``) is preferred when it is the real one; PyMySQL registered
    under that name (``pymysql.install_as_MySQLdb()``) counts as PyMySQL.
    """
    import importlib
    import sys

    loaded = sys.modules.get("MySQLdb")
    if loaded is None and _installed("MySQLdb"):
        try:
            loaded = importlib.import_module("MySQLdb")
        except ImportError:  # a broken build (missing client library) is not installed
            loaded = None
    if loaded is not None and loaded.__name__ == "MySQLdb":
        return "mysqldb"
    if _installed("pymysql"):
        return "pymysql"
    raise UsageError(
        "a MySQL/MariaDB URL needs a driver: pip install 'advisory-locks[mysql]' (PyMySQL) "
        "or 'advisory-locks[mysqlclient]'"
    )


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules[module] is None: imports of it are blocked
        return False


def _first_line(error: BaseException) -> str:
    # SQLAlchemy appends SQL and a link to its docs; the driver's reason comes first.
    cause = getattr(error, "orig", None) or error
    text = str(cause).strip() or type(cause).__name__
    return " ".join(text.splitlines()[0].split())
