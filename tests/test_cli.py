"""Specification of the ``advisory-locks`` command line: ``key`` and ``list``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import TupleRow
from sqlalchemy.engine import URL

from advisory_locks._dialects.base import LockedRow
from advisory_locks._monitoring import Identity, identify, rails_comment_name
from advisory_locks.cli import installed_mysql_driver, main
from advisory_locks.keys import derive_key, lock_key
from tests.databases import psycopg_connect, pymysql_connect

OBSERVE_DEADLINE_SECONDS = 10.0


@pytest.fixture(autouse=True)
def _no_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in (
        "ADVISORY_LOCKS_KEY_SCHEME",
        "ADVISORY_LOCKS_PREFIX",
        "ADVISORY_LOCKS_URL",
        "DATABASE_URL",
    ):
        monkeypatch.delenv(variable, raising=False)


class Terminal(io.StringIO):
    """Captured output that says it is a terminal, as an interactive shell's would."""

    encoding = "utf-8"

    def isatty(self) -> bool:
        return True


# --- key ----------------------------------------------------------------------------------


def test_key_prints_only_the_key_when_output_is_piped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "test"]) == 0
    assert capsys.readouterr().out == "-6951639720043709083\n"


def test_key_prints_a_pair_as_the_arguments_of_pg_advisory_lock(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["key", "test", "--scheme", "rails"]) == 0
    assert capsys.readouterr().out == "1484750348, 0\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["key", "cli-paste-pair", "--scheme", "rails", "--prefix", "12"],
        ["key", "cli-paste-bigint"],
        ["key", "cli-paste-hashtext", "--scheme", "hashtext"],
        ["key", "--pair", "-7", "2147483647"],
    ],
    ids=["rails-pair", "sha256-bigint", "hashtext", "negative-pair"],
)
def test_key_output_pastes_into_pg_advisory_lock_as_is(
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
    connect: Any,
    pg_admin: psycopg.Connection[TupleRow],
) -> None:
    # What `psql -c "SELECT pg_advisory_lock($(advisory-locks key NAME))"` sends: the
    # output spliced into the SQL text, not passed as parameters.
    assert main(argv) == 0
    printed = capsys.readouterr().out.strip()
    holder = connect("cli-paste")
    holder.execute(f"SELECT pg_advisory_lock({printed})")
    try:
        held = pg_admin.execute(
            "SELECT classid, objid, objsubid FROM pg_locks"
            " WHERE locktype = 'advisory' AND pid = %s AND granted",
            (holder.info.backend_pid,),
        ).fetchall()
    finally:
        holder.execute(f"SELECT pg_advisory_unlock({printed})")
    expected = derive_key(
        (int(argv[2]), int(argv[3])) if argv[1] == "--pair" else argv[1],
        scheme=argv[argv.index("--scheme") + 1] if "--scheme" in argv else None,
        prefix=argv[argv.index("--prefix") + 1] if "--prefix" in argv else None,
    )
    assert held == [expected.pg_locks_ids()]


def test_key_uses_the_pglock_scheme_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "test", "--scheme", "pglock"]) == 0
    assert capsys.readouterr().out == "7313085519096743583\n"


def test_key_uses_the_hashtext_scheme_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    # SELECT hashtext('nightly-report') on PostgreSQL 15.
    assert main(["key", "nightly-report", "--scheme", "hashtext"]) == 0
    assert capsys.readouterr().out == "759228614\n"


def test_key_details_for_hashtext_name_the_server_expression(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["key", "--details", "report", "--scheme", "hashtext", "--prefix", "o'k:"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "note      the server's hashtext('o''k:report') is this key" in lines


def test_key_json_names_the_hashtext_scheme_and_gives_one_integer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["key", "--json", "nightly-report", "--scheme", "hashtext"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["scheme"], document["key"]) == ("hashtext", 759228614)
    assert document["lock_sql"] == "SELECT pg_advisory_lock(759228614);"


def test_key_applies_the_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "test", "--prefix", "billing:"]) == 0
    assert capsys.readouterr().out == f"{lock_key('test', prefix='billing:')}\n"


def test_key_passes_a_rails_prefix_as_the_second_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "test", "--scheme", "rails", "--prefix", "7"]) == 0
    assert capsys.readouterr().out == "1484750348, 7\n"


def test_key_takes_the_scheme_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADVISORY_LOCKS_KEY_SCHEME", "rails")
    assert main(["key", "test"]) == 0
    assert capsys.readouterr().out == "1484750348, 0\n"


def test_key_takes_the_prefix_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADVISORY_LOCKS_PREFIX", "billing:")
    assert main(["key", "test"]) == 0
    assert capsys.readouterr().out == "-7887281703547300716\n"


def test_key_hashes_a_name_that_looks_like_an_integer_as_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["key", "42"]) == 0
    assert capsys.readouterr().out == f"{lock_key('42')}\n"


def test_key_with_int_uses_the_integer_itself(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "--int", "-42"]) == 0
    assert capsys.readouterr().out == "-42\n"


def test_key_with_pair_uses_the_two_integers_themselves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["key", "--pair", "-1", "5"]) == 0
    assert capsys.readouterr().out == "-1, 5\n"


def test_key_on_a_terminal_explains_pg_locks_ids_and_psql(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(["key", "test"]) == 0
    lines = terminal.getvalue().splitlines()
    assert lines[0] == "-6951639720043709083"
    assert "pg_locks  classid=2676412545 objid=2286714213 objsubid=1" in lines
    assert "SELECT pg_advisory_lock(-6951639720043709083);" in lines
    assert "SELECT pg_advisory_unlock(-6951639720043709083);" in lines


def test_key_details_flag_explains_even_when_piped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "--details", "test", "--scheme", "rails"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "1484750348, 0"
    assert "pg_locks  classid=1484750348 objid=0 objsubid=2" in lines
    assert "SELECT pg_advisory_lock(1484750348, 0);" in lines


def test_key_details_point_out_that_an_integer_looking_name_was_hashed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["key", "--details", "42"]) == 0
    assert "use --int" in capsys.readouterr().out


def test_key_json_has_the_key_pg_locks_ids_and_sql(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "--json", "café", "--prefix", "shop/"]) == 0
    document = json.loads(capsys.readouterr().out)
    key = lock_key("café", prefix="shop/")
    classid, objid, objsubid = derive_key("café", prefix="shop/").pg_locks_ids()
    assert document == {
        "name": "café",
        "scheme": "sha256",
        "prefix": "shop/",
        "key": key,
        "pg_locks": {"classid": classid, "objid": objid, "objsubid": objsubid},
        "lock_sql": f"SELECT pg_advisory_lock({key});",
        "unlock_sql": f"SELECT pg_advisory_unlock({key});",
    }


def test_key_json_gives_a_pair_as_a_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "--json", "test", "--scheme", "rails"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["key"] == [1484750348, 0]
    assert document["pg_locks"] == {"classid": 1484750348, "objid": 0, "objsubid": 2}
    assert document["lock_sql"] == "SELECT pg_advisory_lock(1484750348, 0);"


def test_key_mysql_dialect_under_rails_prints_the_gems_get_lock_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["key", "Nightly Report", "--scheme", "rails", "--prefix", "7", "--dialect", "mysql"]
    assert main(argv) == 0
    assert capsys.readouterr().out == "7Nightly Report\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["key", ""], "must not be empty"),
        (["key", "--int", "forty-two"], "--int needs an integer"),
        (["key", "--int", str(2**63)], "64-bit"),
        (["key", "--pair", str(2**31), "0"], "32-bit"),
        (["key", "x", "--pair", "1", "2"], "not both"),
        (["key"], "NAME"),
        (["key", "x", "--scheme", "rails", "--prefix", "billing"], "integer prefix"),
        (["key", "\udcff"], "not valid Unicode"),
    ],
)
def test_key_reports_bad_input_on_stderr_with_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err
    assert "Traceback" not in captured.err


def test_key_rejects_an_unknown_scheme(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "x", "--scheme", "md5"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "key" in capsys.readouterr().err


def test_help_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "--help"]) == 0
    assert "--int" in capsys.readouterr().out


def test_python_dash_m_prints_the_rails_key() -> None:
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("ADVISORY_LOCKS_KEY_SCHEME", "ADVISORY_LOCKS_PREFIX")
    }
    completed = subprocess.run(
        [sys.executable, "-m", "advisory_locks", "key", "test", "--scheme", "rails"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (completed.returncode, completed.stdout, completed.stderr) == (0, "1484750348, 0\n", "")


# --- list ---------------------------------------------------------------------------------


def url_text(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def unique_key() -> int:
    # Other tests and other engineers' runs share the server; a fresh key is ours alone.
    return lock_key(f"cli-test-{uuid.uuid4()}")  # type: ignore[return-value]


@pytest.fixture
def connect(postgres_url: URL) -> Iterator[Any]:
    """Opens autocommit connections tagged with an application_name; closes them after."""
    opened: list[psycopg.Connection[TupleRow]] = []

    def open_connection(application_name: str) -> psycopg.Connection[TupleRow]:
        connection = psycopg_connect(
            postgres_url.update_query_dict({"application_name": application_name}),
            autocommit=True,
        )
        opened.append(connection)
        return connection

    yield open_connection
    for connection in opened:
        connection.close()


@contextlib.contextmanager
def waiting(
    waiter: psycopg.Connection[TupleRow],
    key: int,
    admin: psycopg.Connection[TupleRow],
    sql: str = "SELECT pg_advisory_lock(%s)",
) -> Iterator[None]:
    """Block ``waiter`` in ``sql`` on a thread until the block exits and the lock frees."""
    thread = threading.Thread(target=waiter.execute, args=(sql, (key,)), daemon=True)
    thread.start()
    try:
        wait_until_waiting(admin, waiter.info.backend_pid)
        yield
    finally:
        # The caller releases the holder inside the block, so the waiter is granted. If the
        # block failed first, closing the holder in teardown frees the waiter instead.
        thread.join(OBSERVE_DEADLINE_SECONDS)


def wait_until_waiting(admin: psycopg.Connection[TupleRow], pid: int) -> None:
    # Observing server state, not synchronising: waitstart is set once the wait is queued.
    deadline = time.monotonic() + OBSERVE_DEADLINE_SECONDS
    query = """
        SELECT count(*) FROM pg_locks
        WHERE locktype = 'advisory' AND pid = %s AND NOT granted AND waitstart IS NOT NULL
    """
    while time.monotonic() < deadline:
        row = admin.execute(query, (pid,)).fetchone()
        if row is not None and row[0]:
            return
    pytest.fail(f"backend {pid} never showed up as waiting in pg_locks")


def list_json(url: URL, capsys: pytest.CaptureFixture[str], key: object) -> list[dict[str, Any]]:
    assert main(["list", "--url", url_text(url), "--json"]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return [row for row in rows if row["key"] == key]


def test_list_shows_the_holder_and_the_waiter_of_a_lock(
    postgres_url: URL,
    connect: Any,
    pg_admin: psycopg.Connection[TupleRow],
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = unique_key()
    holder, waiter = connect("cli-holder"), connect("cli-waiter")
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    with waiting(waiter, key, pg_admin):
        rows = list_json(postgres_url, capsys, key)
        holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
    summary = [(r["pid"], r["granted"], r["mode"], r["application_name"]) for r in rows]
    assert summary == [
        (holder.info.backend_pid, True, "exclusive", "cli-holder"),
        (waiter.info.backend_pid, False, "exclusive", "cli-waiter"),
    ]


def test_list_reports_how_long_a_waiter_waited_and_what_it_runs(
    postgres_url: URL,
    connect: Any,
    pg_admin: psycopg.Connection[TupleRow],
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = unique_key()
    holder, waiter = connect("cli-holder"), connect("cli-waiter")
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    with waiting(waiter, key, pg_admin):
        (waiter_row,) = [row for row in list_json(postgres_url, capsys, key) if not row["granted"]]
        holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
    assert waiter_row["waiting_seconds"] >= 0
    assert waiter_row["held_at_most_seconds"] is None
    assert waiter_row["state"] == "active"
    assert "pg_advisory_lock" in waiter_row["query"]


def test_list_gives_the_pg_locks_ids_of_each_key(
    postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    key = unique_key()
    holder = connect("cli-holder")
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    (row,) = list_json(postgres_url, capsys, key)
    classid, objid, objsubid = derive_key(key).pg_locks_ids()
    assert row["pg_locks"] == {"classid": classid, "objid": objid, "objsubid": objsubid}


def test_list_shows_a_pair_key_as_a_pair(
    postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    first = unique_key() & 0x7FFFFFFF
    holder = connect("cli-holder")
    holder.execute("SELECT pg_advisory_lock(%s, %s)", (first, -7))
    (row,) = list_json(postgres_url, capsys, [first, -7])
    assert (row["pid"], row["pg_locks"]["objsubid"]) == (holder.info.backend_pid, 2)


def test_list_shows_every_holder_of_a_shared_lock_and_an_exclusive_waiter(
    postgres_url: URL,
    connect: Any,
    pg_admin: psycopg.Connection[TupleRow],
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = unique_key()
    readers = [connect("cli-reader-1"), connect("cli-reader-2")]
    writer = connect("cli-writer")
    for reader in readers:
        reader.execute("SELECT pg_advisory_lock_shared(%s)", (key,))
    with waiting(writer, key, pg_admin):
        rows = list_json(postgres_url, capsys, key)
        for reader in readers:
            reader.execute("SELECT pg_advisory_unlock_shared(%s)", (key,))
    summary = sorted((r["pid"], r["granted"], r["mode"]) for r in rows)
    assert summary == sorted(
        [
            (readers[0].info.backend_pid, True, "shared"),
            (readers[1].info.backend_pid, True, "shared"),
            (writer.info.backend_pid, False, "exclusive"),
        ]
    )


def test_list_held_for_is_an_upper_bound_even_after_a_later_transaction(
    postgres_url: URL,
    connect: Any,
    pg_admin: psycopg.Connection[TupleRow],
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = unique_key()
    holder = connect("cli-holder")
    (granted_at,) = holder.execute(
        "SELECT clock_timestamp() FROM pg_advisory_lock(%s)", (key,)
    ).fetchone()
    # A session lock outlives its transaction: a transaction begun later must not make
    # the lock look younger than it is. The server-side pause makes the gap measurable.
    holder.execute("SELECT pg_sleep(0.3)")
    with holder.transaction():
        holder.execute("SELECT 1")
        (age,) = pg_admin.execute(
            "SELECT EXTRACT(EPOCH FROM clock_timestamp() - %s)::float8", (granted_at,)
        ).fetchone()  # type: ignore[misc]
        (row,) = list_json(postgres_url, capsys, key)
    assert row["held_at_most_seconds"] >= age


def test_list_table_has_one_line_per_lock_with_pid_status_and_key(
    postgres_url: URL,
    connect: Any,
    pg_admin: psycopg.Connection[TupleRow],
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = unique_key()
    holder, waiter = connect("cli-holder"), connect("cli-waiter")
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    with waiting(waiter, key, pg_admin):
        assert main(["list", "--url", url_text(postgres_url)]) == 0
        holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
    lines = capsys.readouterr().out.splitlines()
    ours = [line.split()[:3] for line in lines if str(key) in line.split()]
    assert ours == [
        [str(holder.info.backend_pid), "held", "exclusive"],
        [str(waiter.info.backend_pid), "waiting", "exclusive"],
    ]
    assert lines[0].split()[:5] == ["PID", "STATUS", "MODE", "FOR", "KEY"]


def test_list_marks_a_holders_duration_as_an_upper_bound(
    postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    key = unique_key()
    connect("cli-holder").execute("SELECT pg_advisory_lock(%s)", (key,))
    assert main(["list", "--url", url_text(postgres_url)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if str(key) in line.split()]
    assert " ≤ " in line


def test_list_accepts_a_bare_postgresql_url(
    postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    key = unique_key()
    connect("cli-holder").execute("SELECT pg_advisory_lock(%s)", (key,))
    assert len(list_json(postgres_url.set(drivername="postgresql"), capsys, key)) == 1


def test_list_accepts_a_heroku_style_postgres_url(
    postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    key = unique_key()
    connect("cli-holder").execute("SELECT pg_advisory_lock(%s)", (key,))
    assert len(list_json(postgres_url.set(drivername="postgres"), capsys, key)) == 1


def test_list_accepts_an_async_driver_url(
    postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    key = unique_key()
    connect("cli-holder").execute("SELECT pg_advisory_lock(%s)", (key,))
    assert len(list_json(postgres_url.set(drivername="postgresql+asyncpg"), capsys, key)) == 1


@pytest.mark.parametrize("variable", ["ADVISORY_LOCKS_URL", "DATABASE_URL"])
def test_list_takes_the_url_from_the_environment(
    variable: str,
    postgres_url: URL,
    connect: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = unique_key()
    holder = connect("cli-holder")
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    monkeypatch.setenv(variable, url_text(postgres_url))
    assert main(["list", "--json"]) == 0
    rows = [row for row in json.loads(capsys.readouterr().out) if row["key"] == key]
    assert [row["pid"] for row in rows] == [holder.info.backend_pid]


def test_list_without_a_url_fails_with_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 2
    assert "--url" in capsys.readouterr().err


def test_list_reports_an_unreachable_server_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = "postgresql://postgres:s3cret@127.0.0.1:1/test"
    assert main(["list", "--url", url]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("advisory-locks list: cannot list locks on ")
    assert "127.0.0.1:1" in captured.err
    assert "s3cret" not in captured.err
    assert "Traceback" not in captured.err


def test_list_reports_a_malformed_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--url", "not a url"]) == 2
    assert "cannot list locks on not a url" in capsys.readouterr().err


def test_list_through_a_subprocess_fails_cleanly_for_an_unreachable_server() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "advisory_locks", "list", "--url", "postgresql://127.0.0.1:1/x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 2
    assert "Traceback" not in completed.stderr
    assert "cannot list locks" in completed.stderr


# --- list on MySQL/MariaDB: whichever driver is installed ------------------------------------


def list_in_subprocess(url: str, *, block: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """``advisory-locks list --url URL --json`` where the modules in ``block`` are missing."""
    script = (
        "import sys\n"
        + "".join(f"sys.modules[{module!r}] = None\n" for module in block)
        + "from advisory_locks.cli import main\n"
        + f"sys.exit(main(['list', '--url', {url!r}, '--json']))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )


def assert_listed_or_told_how_to_expose_locks(
    completed: subprocess.CompletedProcess[str], name: str
) -> None:
    # The server answered through the driver; MariaDB without performance_schema (or the
    # metadata_lock_info plugin) cannot list user locks, and the command says how to fix it.
    if completed.returncode == 0:
        assert name in [row["key"] for row in json.loads(completed.stdout)]
    else:
        assert completed.returncode == 2, completed.stderr
        assert "metadata_lock_info" in completed.stderr


@pytest.mark.parametrize("scheme", ["mysql", "mariadb"])
def test_list_on_a_plain_mysql_url_uses_pymysql_where_mysqlclient_is_missing(
    mysql_url: URL, scheme: str
) -> None:
    name = f"cli-test-{uuid.uuid4()}"
    holder = pymysql_connect(mysql_url)
    try:
        with holder.cursor() as cursor:
            cursor.execute("SELECT GET_LOCK(%s, 0)", (name,))
        url = url_text(mysql_url.set(drivername=scheme))
        completed = list_in_subprocess(url, block=("MySQLdb",))
    finally:
        holder.close()
    assert "MySQLdb" not in completed.stderr
    assert_listed_or_told_how_to_expose_locks(completed, name)


def test_list_on_a_mysql_url_without_any_driver_says_what_to_install() -> None:
    completed = list_in_subprocess("mysql://root@127.0.0.1:1/test", block=("MySQLdb", "pymysql"))
    assert completed.returncode == 2
    assert "pip install 'advisory-locks[mysql]'" in completed.stderr
    assert "Traceback" not in completed.stderr


def test_the_mysql_driver_is_mysqlclient_only_when_it_is_the_real_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pymysql

    monkeypatch.setitem(sys.modules, "MySQLdb", pymysql)  # pymysql.install_as_MySQLdb()
    assert installed_mysql_driver() == "pymysql"
    monkeypatch.setitem(sys.modules, "MySQLdb", None)
    assert installed_mysql_driver() == "pymysql"
    monkeypatch.setitem(sys.modules, "MySQLdb", types.ModuleType("MySQLdb"))
    assert installed_mysql_driver() == "mysqldb"


# --- list: names, the Rails gem's comments and schemes ---------------------------------------


def list_rows(url: URL, capsys: pytest.CaptureFixture[str], *options: str) -> list[dict[str, Any]]:
    assert main(["list", "--url", url_text(url), "--json", *options]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return rows


def row_for(rows: list[dict[str, Any]], key: object) -> dict[str, Any]:
    (row,) = [row for row in rows if row["key"] == key]
    return row


def identity(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["name"], row["name_source"], row["scheme"], row["scheme_certain"])


@pytest.mark.parametrize("scheme", ["sha256", "pglock", "rails", "hashtext"])
def test_list_names_a_key_given_with_name_and_tells_its_scheme(
    scheme: str, postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"cli-name-{uuid.uuid4()}"
    key = lock_key(name, scheme=scheme)
    holder = connect("cli-holder")
    holder.execute(
        f"SELECT pg_advisory_lock({', '.join(['%s'] * (2 if scheme == 'rails' else 1))})",
        key if isinstance(key, tuple) else (key,),
    )
    rows = list_rows(postgres_url, capsys, "--name", name, "--name", "another-job")
    expected_key = list(key) if isinstance(key, tuple) else key
    assert identity(row_for(rows, expected_key)) == (name, "given", scheme, True)


def test_list_hashes_given_names_with_the_prefix(
    postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"cli-name-{uuid.uuid4()}"
    key = lock_key(name, prefix="billing:")
    connect("cli-holder").execute("SELECT pg_advisory_lock(%s)", (key,))
    rows = list_rows(postgres_url, capsys, "--name", name, "--prefix", "billing:")
    assert identity(row_for(rows, key))[:2] == (name, "given")


def test_list_reads_names_from_a_file_and_shows_them_in_the_table(
    postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    name = f"cli-file-{uuid.uuid4()}"
    key = lock_key(name)
    connect("cli-holder").execute("SELECT pg_advisory_lock(%s)", (key,))
    names_file = tmp_path / "jobs.txt"
    names_file.write_text(f"# cron jobs\n\nnightly-report\n  {name}  \n", encoding="utf-8")
    assert main(["list", "--url", url_text(postgres_url), "--names-file", str(names_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:7] == ["PID", "STATUS", "MODE", "FOR", "KEY", "SCHEME", "NAME"]
    # KEY, SCHEME and NAME are neighbours (FOR before them holds spaces: "≤ 1.0s").
    assert any(re.search(rf" {key} +sha256 +'{name}' ", line) for line in lines)


def test_list_with_an_unreadable_names_file_fails_with_status_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    missing = tmp_path / "missing.txt"
    assert (
        main(["list", "--url", "postgresql://x@127.0.0.1:1/x", "--names-file", str(missing)]) == 2
    )
    assert "cannot read --names-file" in capsys.readouterr().err


def test_list_names_a_rails_gem_lock_from_its_query_comment(
    postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"cli-rails-{uuid.uuid4()}"
    first, prefix = lock_key(name, scheme="rails", prefix=7)  # type: ignore[misc]
    # What the with_advisory_lock gem sends, comment and all; then the holder is idle.
    connect("rails-worker").execute(
        f"SELECT pg_try_advisory_lock({first},{prefix}) AS t0a1b2c3 /* {name} */"
    )
    rows = list_rows(postgres_url, capsys)
    assert identity(row_for(rows, [first, prefix])) == (name, "query comment", "rails", True)


def test_list_does_not_take_a_comment_about_another_key(
    postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    held, later = (lock_key(f"cli-rails-{uuid.uuid4()}", scheme="rails") for _ in range(2))
    worker = connect("rails-worker")
    worker.execute(f"SELECT pg_try_advisory_lock({held[0]},0) AS t1 /* held-job */")  # type: ignore[index]
    worker.execute(f"SELECT pg_try_advisory_lock({later[0]},0) AS t2 /* later-job */")  # type: ignore[index]
    rows = list_rows(postgres_url, capsys)
    assert row_for(rows, list(held))["name"] is None  # type: ignore[arg-type]
    assert row_for(rows, list(later))["name"] == "later-job"  # type: ignore[arg-type]


def test_list_guesses_a_scheme_from_the_shape_of_an_unnamed_key(
    postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    rails_like = (unique_key() & 0x7FFFFFFF, 0)
    small = (unique_key() & 0x7FFFFFFF) or 1
    wide = unique_key() | (1 << 40)
    holder = connect("cli-holder")
    holder.execute("SELECT pg_advisory_lock(%s, %s)", rails_like)
    holder.execute("SELECT pg_advisory_lock(%s)", (small,))
    holder.execute("SELECT pg_advisory_lock(%s)", (wide,))
    holder.execute("SELECT 1")  # no lock call left in pg_stat_activity.query
    rows = list_rows(postgres_url, capsys)
    assert identity(row_for(rows, list(rails_like))) == (None, None, "rails", False)
    assert identity(row_for(rows, small)) == (None, None, "int4", False)
    assert identity(row_for(rows, wide)) == (None, None, None, False)
    assert main(["list", "--url", url_text(postgres_url)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(re.search(rf" {rails_like[0]},0 +rails\? +- ", line) for line in lines)
    assert "SCHEME? is guessed from the key's shape" in lines[-1]


def make_row(key: int | tuple[int, int] | str, query: str) -> LockedRow:
    return LockedRow(1, key, "exclusive", True, None, 1.0, "app", None, "idle", query)


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("SELECT pg_try_advisory_lock(5,0) AS t1 /* job */", "job"),
        ("select PG_TRY_ADVISORY_XACT_LOCK_SHARED( 5 , 0 ) as t1 /* a b */;", "a b"),
        ("SELECT pg_advisory_unlock(5,0) AS t1 /* job */", None),
        ("SELECT pg_try_advisory_lock(5,1) AS t1 /* job */", None),
        ("SELECT pg_try_advisory_lock(5,0) AS t1", None),
        ("SELECT pg_try_advisory_lock(5,0) AS t1 /* -- rewritten -- */", "-- rewritten --"),
    ],
)
def test_the_rails_comment_names_only_the_lock_its_statement_takes(
    query: str, name: str | None
) -> None:
    assert rails_comment_name(make_row((5, 0), query)) == name


def test_a_comment_name_that_does_not_hash_to_the_key_has_no_certain_scheme() -> None:
    row = make_row((5, 0), "SELECT pg_try_advisory_lock(5,0) AS t1 /* not-five */")
    assert identify(row) == Identity("not-five", "rails", False, "query comment")


# --- list --watch -------------------------------------------------------------------------

# A listing ends with the note under its table, or with the one line of an empty listing.
FRAME_ENDS = ("QUERY is the connection's current statement", "No advisory locks are held")
WATCH_INTERVAL = "2"  # the test releases a lock between two frames: ample time for that


def watch_command(url: URL, *options: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "advisory_locks",
        "list",
        "--url",
        url_text(url),
        "--watch",
        *options,
    ]


def read_frame(stream: Any) -> str:
    """Read one listing of ``list --watch`` (up to its closing note)."""
    lines = []
    while True:
        line = stream.readline()
        assert line, "list --watch ended before the frame did: " + "".join(lines)
        lines.append(line)
        if line.startswith(FRAME_ENDS):
            return "".join(lines)


def test_list_watch_lists_again_and_shows_what_changed_between_listings(
    postgres_url: URL, connect: Any
) -> None:
    key = unique_key()
    holder = connect("cli-watch-holder")
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    watcher = subprocess.Popen(
        watch_command(postgres_url, "--interval", WATCH_INTERVAL, "--count", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watcher.stdout is not None
        first = read_frame(watcher.stdout)
        holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
        rest = watcher.stdout.read()
        assert watcher.wait(timeout=60) == 0
    finally:
        watcher.kill()
        watcher.wait()
    assert first.startswith(f"Every {WATCH_INTERVAL}s: advisory locks on ")
    assert str(key) in first
    assert "cli-watch-holder" in first
    assert rest.count("Every 2s: advisory locks on ") == 1
    assert str(key) not in rest
    assert "\x1b[" not in first + rest  # no terminal codes in a pipe


def test_list_watch_clears_the_terminal_before_each_listing(
    postgres_url: URL, connect: Any
) -> None:
    import pty

    key = unique_key()
    connect("cli-watch-terminal").execute("SELECT pg_advisory_lock(%s)", (key,))
    controller, terminal = pty.openpty()
    watcher = subprocess.Popen(
        watch_command(postgres_url, "--interval", "0.2", "--count", "2"),
        stdout=terminal,
        stderr=subprocess.PIPE,
    )
    os.close(terminal)
    output = b""
    try:
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal closed: the command ended
                break
            if not chunk:
                break
            output += chunk
        assert watcher.wait(timeout=60) == 0
    finally:
        os.close(controller)
        watcher.kill()
        watcher.wait()
    frames = output.decode().split("\x1b[H\x1b[2J")
    assert frames[0] == ""
    assert len(frames) == 3
    for frame in frames[1:]:
        assert str(key) in frame
        assert "cli-watch-terminal" in frame


def test_list_watch_stops_on_ctrl_c_without_a_traceback(postgres_url: URL, connect: Any) -> None:
    import signal

    key = unique_key()
    connect("cli-watch-ctrl-c").execute("SELECT pg_advisory_lock(%s)", (key,))
    watcher = subprocess.Popen(
        watch_command(postgres_url, "--interval", "30"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watcher.stdout is not None
        assert str(key) in read_frame(watcher.stdout)
        watcher.send_signal(signal.SIGINT)
        status = watcher.wait(timeout=60)
    finally:
        watcher.kill()
        watcher.wait()
    assert watcher.stderr is not None
    assert (status, watcher.stderr.read()) == (0, "")


def test_list_watch_json_prints_one_array_per_line(
    postgres_url: URL, connect: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    key = unique_key()
    connect("cli-watch-json").execute("SELECT pg_advisory_lock(%s)", (key,))
    argv = ["list", "--url", url_text(postgres_url), "--watch", "--json"]
    assert main([*argv, "--interval", "0.1", "--count", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert [row["key"] for row in json.loads(line) if row["key"] == key] == [key]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--interval", "0"], "more than 0 seconds"),
        (["--interval", "soon"], "not a number of seconds"),
        (["--count", "0"], "at least 1"),
    ],
)
def test_list_watch_rejects_bad_timing(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["list", "--url", "postgresql://127.0.0.1:1/x", "--watch", *options]) == 2
    assert message in capsys.readouterr().err


def test_list_interval_without_watch_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--url", "postgresql://127.0.0.1:1/x", "--count", "2"]) == 2
    assert "go with --watch" in capsys.readouterr().err


def test_list_watch_reports_an_unreachable_server_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["list", "--url", "postgresql://127.0.0.1:1/x", "--watch"]) == 2
    assert "cannot list locks" in capsys.readouterr().err
