"""MySQL/MariaDB-only behaviour: the server-side name mapping, deadlocks, lost locks,
drivers and monitoring. What every database shares is in tests/contract."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL

from advisory_locks import (
    LockDeadlock,
    LockLost,
    LockTimeout,
    UnsupportedFeature,
    advisory_lock,
    current_advisory_locks,
)
from advisory_locks._core.executors import DBAPIExecutor, protocol_session_id
from advisory_locks._core.steps import on, run_steps
from advisory_locks._dialects import backend_for_dialect
from advisory_locks._dialects.mysql import server_lock_name
from advisory_locks.cli import main
from advisory_locks.keys import derive_key
from tests.databases import import_mysqlclient, pymysql_connect
from tests.helpers import unique_name, wait_for


@pytest.fixture
def mysql_engine(mysql_url: URL) -> Iterator[Engine]:
    engine = create_engine(mysql_url)
    yield engine
    engine.dispose()


def _admin_value(url: URL, sql: str, *params: Any) -> Any:
    admin = pymysql_connect(url)
    try:
        with admin.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchone()[0]
    finally:
        admin.close()


@pytest.mark.parametrize(
    ("name", "prefix", "expected"),
    [
        ("nightly-report", None, "nightly-report"),
        ("report", "shop:", "shop:report"),
        (42, None, "#int:42"),
        ((1, -2), None, "#pair:1:-2"),
    ],
)
def test_lower_case_ascii_names_and_integers_map_to_readable_server_names(
    name: Any, prefix: str | None, expected: str
) -> None:
    assert server_lock_name(derive_key(name, prefix=prefix)) == expected


def test_names_with_capitals_are_hashed_so_case_never_merges_two_names() -> None:
    digest = hashlib.sha256(b"Job").hexdigest()[:32]
    assert server_lock_name(derive_key("Job")) == f"Job#{digest}"
    assert server_lock_name(derive_key("job")) == "job"


def test_long_and_unusual_names_map_within_64_characters() -> None:
    for name in ("x" * 65, "é" * 200, "a b'c\\d", "a#b"):
        mapped = server_lock_name(derive_key(name))
        assert len(mapped) <= 64
        assert "#" in mapped
        assert mapped == server_lock_name(derive_key(name))  # deterministic


def md5_key(name: str) -> int:
    return int.from_bytes(hashlib.md5(name.encode()).digest()[:8], "big", signed=True)


@pytest.mark.parametrize("scheme", ["sha256", "pglock", "hashtext", md5_key])
def test_every_scheme_but_rails_maps_text_the_same_way(scheme: Any) -> None:
    digest = hashlib.sha256(b"Job").hexdigest()[:32]
    assert server_lock_name(derive_key("Job", scheme=scheme, prefix="")) == f"Job#{digest}"
    assert server_lock_name(derive_key("job", scheme=scheme, prefix="")) == "job"


# --- the rails scheme: the with_advisory_lock gem's GET_LOCK names -------------------------


@pytest.mark.parametrize(
    ("name", "prefix", "expected"),
    [
        ("Nightly Report", None, "Nightly Report"),
        ("café", None, "café"),
        ("日本 🔒 job", None, "日本 🔒 job"),
        ("a'b\\c#d", None, "a'b\\c#d"),
        ("Job", 7, "7Job"),
        ("Job", "42", "42Job"),
        ("x" * 64, None, "x" * 64),
        ("é" * 62, 12, "12" + "é" * 62),
    ],
)
def test_rails_text_reaches_get_lock_as_the_gem_sends_it(
    name: str, prefix: int | str | None, expected: str
) -> None:
    # The gem on MySQL: GET_LOCK("#{ENV['WITH_ADVISORY_LOCK_PREFIX']}#{lock_name}", 0).
    assert server_lock_name(derive_key(name, scheme="rails", prefix=prefix)) == expected


@pytest.mark.parametrize(("name", "prefix"), [("x" * 65, None), ("é" * 63, 12), ("j" * 64, 7)])
def test_rails_text_over_64_characters_is_refused_as_the_gem_cannot_lock_it(
    name: str, prefix: int | None
) -> None:
    with pytest.raises(ValueError, match="at most 64"):
        server_lock_name(derive_key(name, scheme="rails", prefix=prefix))


@pytest.mark.parametrize(("name", "expected"), [(42, "#int:42"), ((1, -2), "#pair:1:-2")])
def test_rails_does_not_change_integer_and_pair_names(name: Any, expected: str) -> None:
    assert server_lock_name(derive_key(name, scheme="rails")) == expected


def rails_name(label: str) -> str:
    # Short enough for GET_LOCK with a prefix, unique on the shared server.
    return f"{label}-{uuid.uuid4().hex[:12]}"


RAILS_NAMES = [("Nightly-Report", None), ("Café-日本-🔒", None), ("Job", 7)]


@pytest.mark.parametrize(("label", "prefix"), RAILS_NAMES)
def test_a_rails_lock_taken_here_is_held_under_the_gems_name(
    mysql_engine: Engine, mysql_url: URL, label: str, prefix: int | None
) -> None:
    name = rails_name(label)
    gem_name = f"{'' if prefix is None else prefix}{name}"
    with (
        mysql_engine.connect() as connection,
        advisory_lock(connection, name, key_scheme="rails", key_prefix=prefix),
    ):
        ours = connection.execute(text("SELECT CONNECTION_ID()")).scalar_one()
        assert _admin_value(mysql_url, "SELECT IS_USED_LOCK(%s)", gem_name) == ours
    assert _admin_value(mysql_url, "SELECT IS_USED_LOCK(%s)", gem_name) is None


@pytest.mark.parametrize(("label", "prefix"), RAILS_NAMES)
def test_a_lock_taken_under_the_gems_name_excludes_the_rails_scheme(
    mysql_engine: Engine, mysql_url: URL, label: str, prefix: int | None
) -> None:
    name = rails_name(label)
    gem_name = f"{'' if prefix is None else prefix}{name}"
    gem = pymysql_connect(mysql_url)  # stands in for the Rails app's connection
    try:
        with gem.cursor() as cursor:
            cursor.execute("SELECT GET_LOCK(%s, 0)", (gem_name,))
            assert cursor.fetchone()[0] == 1
            lock = advisory_lock(
                mysql_engine, name, key_scheme="rails", key_prefix=prefix, timeout=0
            )
            assert lock.acquire() is False
            cursor.execute("SELECT RELEASE_LOCK(%s)", (gem_name,))
    finally:
        gem.close()
    with advisory_lock(mysql_engine, name, key_scheme="rails", key_prefix=prefix, timeout=0):
        assert _admin_value(mysql_url, "SELECT IS_USED_LOCK(%s)", gem_name) is not None


def test_a_rails_name_too_long_for_mysql_fails_before_get_lock(
    mysql_engine: Engine, mysql_url: URL
) -> None:
    name = rails_name("Long") + "x" * 60
    with mysql_engine.connect() as connection:
        with pytest.raises(ValueError, match="at most 64"):
            advisory_lock(connection, name, key_scheme="rails", timeout=0).acquire()
        assert _admin_value(mysql_url, "SELECT IS_USED_LOCK(%s)", name) is None
        # Nothing was recorded for the refused name: the connection locks on as before.
        with advisory_lock(connection, rails_name("After"), key_scheme="rails", timeout=0):
            pass


def test_names_reach_the_server_as_parameters(mysql_engine: Engine, mysql_url: URL) -> None:
    name = unique_name("quote'back\\slash")
    with mysql_engine.connect() as connection, advisory_lock(connection, name):
        holder = _admin_value(
            mysql_url, "SELECT IS_USED_LOCK(%s)", server_lock_name(derive_key(name))
        )
        assert holder is not None


def test_a_deadlock_between_two_connections_raises_lock_deadlock(
    mysql_engine: Engine, mysql_url: URL
) -> None:
    first_name, second_name = unique_name("deadlock-a"), unique_name("deadlock-b")
    outcomes: dict[str, BaseException | None] = {}
    with mysql_engine.connect() as first, mysql_engine.connect() as second:
        advisory_lock(first, first_name).acquire()
        advisory_lock(second, second_name).acquire()

        def first_waits() -> None:
            try:
                advisory_lock(first, second_name, timeout=20).acquire()
                outcomes["first"] = None
            except BaseException as error:
                outcomes["first"] = error

        thread = threading.Thread(target=first_waits)
        thread.start()
        server_name = server_lock_name(derive_key(second_name))
        wait_for(
            lambda: _admin_value(
                mysql_url,
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                "WHERE STATE = 'User lock' AND INFO LIKE %s",
                f"%{server_name}%",
            ),
            "the first connection waits",
        )
        try:
            advisory_lock(second, first_name, timeout=20).acquire()
            outcomes["second"] = None
        except BaseException as error:
            outcomes["second"] = error
        # The victim's lock stays held until released: give it back so the other wakes.
        second.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": server_name})
        thread.join(30)
    assert any(isinstance(error, LockDeadlock) for error in outcomes.values())


def test_release_after_the_connection_was_killed_raises_lock_lost(
    mysql_engine: Engine, mysql_url: URL
) -> None:
    name = unique_name("killed")
    with mysql_engine.connect() as connection:
        lock = advisory_lock(connection, name)
        lock.acquire()
        connection_id = connection.execute(text("SELECT CONNECTION_ID()")).scalar_one()
        admin = pymysql_connect(mysql_url)
        try:
            with admin.cursor() as cursor:
                cursor.execute(f"KILL {int(connection_id)}")
        finally:
            admin.close()
        with pytest.raises(LockLost):
            lock.release()


def test_names_whose_keys_collide_are_two_locks_on_one_connection(
    mysql_engine: Engine,
) -> None:
    # GET_LOCK locks names: two names with the same rails (CRC32) key must not be counted
    # as one re-entrant lock, which would leave the second one unlocked on the server.
    first, second = "job:ecf5d2a9e70c", "job:88c08bef7e3f"
    assert derive_key(first, scheme="rails").ints == derive_key(second, scheme="rails").ints
    with (
        mysql_engine.connect() as connection,
        mysql_engine.connect() as rival,
        advisory_lock(connection, first, key_scheme="rails"),
    ):
        with advisory_lock(connection, second, key_scheme="rails"):
            assert advisory_lock(rival, second, key_scheme="rails", timeout=0).acquire() is False
        assert advisory_lock(rival, first, key_scheme="rails", timeout=0).acquire() is False


def test_a_busy_lock_inside_a_transaction_leaves_the_transaction_usable(
    mysql_engine: Engine,
) -> None:
    name = unique_name("in-transaction")
    with (
        mysql_engine.connect() as holder,
        advisory_lock(holder, name),
        mysql_engine.connect() as connection,
        connection.begin(),
    ):
        assert advisory_lock(connection, name, timeout=0).acquire() is False
        assert connection.execute(text("SELECT 1")).scalar_one() == 1


def _statement_time_limit(engine: Engine) -> str:
    """The statement that limits this session's statements to 0.3 s."""
    with engine.connect() as connection:
        version = connection.execute(text("SELECT VERSION()")).scalar_one()
    if "mariadb" not in str(version).lower():
        # MySQL's limit, in milliseconds: it ends GET_LOCK's wait with error 3024 (see
        # test_a_wait_ended_by_mysqls_execution_time_limit_...).
        return "SET SESSION max_execution_time = 300"
    return "SET SESSION max_statement_time = 0.3"


@pytest.mark.parametrize("timeout", [None, 5.0], ids=["no-timeout", "timeout"])
def test_a_wait_cut_by_the_sessions_statement_time_limit_is_a_lock_timeout(
    mysql_engine: Engine, mysql_url: URL, timeout: float | None
) -> None:
    # GET_LOCK answers NULL when interrupted; the library said AdvisoryLockError, where
    # PostgreSQL's statement_timeout is a LockTimeout.
    limited = create_engine(
        mysql_url, connect_args={"init_command": _statement_time_limit(mysql_engine)}
    )
    name = unique_name("time-limit")
    try:
        with (
            mysql_engine.connect() as holder,
            advisory_lock(holder, name),
            limited.connect() as connection,
        ):
            lock = advisory_lock(connection, name, timeout=timeout)
            with pytest.raises(LockTimeout, match="interrupted"):
                lock.acquire()
            assert not lock.held
            assert _admin_value(
                mysql_url, "SELECT IS_USED_LOCK(%s)", server_lock_name(derive_key(name))
            ) == protocol_session_id(holder.connection.driver_connection)
            assert connection.execute(text("SELECT 1")).scalar_one() == 1
    finally:
        limited.dispose()


def _execution_time_limit_cursor(*, after_grant: bool) -> type:
    """A PyMySQL cursor whose GET_LOCK ends as MySQL's max_execution_time ends one: with
    error 3024, ER_QUERY_TIMEOUT (mysql-server reports it when the timer kills an MDL
    wait, and GET_LOCK's handler turns only ER_QUERY_INTERRUPTED into NULL). MariaDB,
    which runs here, answers NULL instead, so the reply is MySQL's; the lock is the real
    server's: with ``after_grant`` the server runs GET_LOCK first, as when the timer
    fires between the grant and the reply."""
    import pymysql

    class ExecutionTimeLimitCursor(pymysql.cursors.Cursor):
        def execute(self, query: str, args: Any = None) -> int:
            if not query.startswith("SELECT GET_LOCK"):
                return super().execute(query, args)
            if after_grant:
                super().execute(query, args)
            raise pymysql.err.OperationalError(
                3024, "Query execution was interrupted, maximum statement execution time exceeded"
            )

    return ExecutionTimeLimitCursor


@pytest.mark.parametrize("after_grant", [False, True], ids=["while-waiting", "after-the-grant"])
def test_a_wait_ended_by_mysqls_execution_time_limit_is_a_lock_timeout_and_keeps_no_lock(
    mysql_url: URL, after_grant: bool
) -> None:
    engine = create_engine(
        mysql_url,
        connect_args={"cursorclass": _execution_time_limit_cursor(after_grant=after_grant)},
    )
    name = unique_name("execution-time")
    try:
        with engine.connect() as connection:
            lock = advisory_lock(connection, name, timeout=5)
            with pytest.raises(LockTimeout, match="interrupted"):
                lock.acquire()
            assert not lock.held
            assert current_advisory_locks(connection) == []
            # A grant the error hid is given back, not left with the pooled connection.
            assert (
                _admin_value(
                    mysql_url, "SELECT IS_USED_LOCK(%s)", server_lock_name(derive_key(name))
                )
                is None
            )
            assert connection.execute(text("SELECT 1")).scalar_one() == 1
    finally:
        engine.dispose()


def test_a_wait_ended_by_kill_query_is_a_lock_timeout(mysql_engine: Engine, mysql_url: URL) -> None:
    name = unique_name("killed")
    outcome: list[BaseException | bool] = []
    with (
        mysql_engine.connect() as holder,
        advisory_lock(holder, name),
        mysql_engine.connect() as connection,
    ):
        waiter = protocol_session_id(connection.connection.driver_connection)

        def wait() -> None:
            try:
                outcome.append(advisory_lock(connection, name).acquire())
            except BaseException as error:  # handed to the test's thread
                outcome.append(error)

        thread = threading.Thread(target=wait)
        thread.start()
        wait_for(
            lambda: (
                _admin_value(
                    mysql_url,
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                    "WHERE ID = %s AND INFO LIKE 'SELECT GET_LOCK%%'",
                    waiter,
                )
                == 1
            ),
            "the waiter in GET_LOCK",
        )
        admin = pymysql_connect(mysql_url)  # a DBA's session
        try:
            with admin.cursor() as cursor:
                cursor.execute(f"KILL QUERY {int(waiter)}")
        finally:
            admin.close()
        thread.join(10)
        assert len(outcome) == 1
        assert isinstance(outcome[0], LockTimeout), outcome
        assert connection.execute(text("SELECT 1")).scalar_one() == 1


def test_mysqlclient_takes_and_releases_locks(mysql_url: URL) -> None:
    import_mysqlclient(os.environ)
    engine = create_engine(mysql_url.set(drivername="mysql+mysqldb"))
    name = unique_name("mysqlclient")
    try:
        with engine.connect() as first, engine.connect() as second:
            with advisory_lock(first, name, timeout=1):
                assert advisory_lock(second, name, timeout=0.2).acquire() is False
            lock = advisory_lock(second, name, timeout=0)
            assert lock.acquire() is True
            lock.release()
    finally:
        engine.dispose()


def test_list_locks_shows_the_held_lock_or_says_how_to_expose_locks(
    mysql_engine: Engine, mysql_url: URL
) -> None:
    name = unique_name("listed")
    backend = backend_for_dialect("mysql")
    sources = _admin_value(
        mysql_url,
        "SELECT @@performance_schema + (SELECT COUNT(*) FROM information_schema.PLUGINS "
        "WHERE PLUGIN_NAME = 'METADATA_LOCK_INFO' AND PLUGIN_STATUS = 'ACTIVE')",
    )
    with (
        mysql_engine.connect() as holder,
        advisory_lock(holder, name),
        mysql_engine.connect() as viewer,
    ):
        pooled = viewer.connection
        executor = DBAPIExecutor(pooled.dbapi_connection)
        if sources:
            keys = [row.key for row in run_steps(on(executor, backend.list_locks(executor.state)))]
            assert server_lock_name(derive_key(name)) in keys
        else:
            with pytest.raises(UnsupportedFeature, match="metadata_lock_info"):
                run_steps(on(executor, backend.list_locks(executor.state)))


def test_cli_key_prints_the_mysql_lock_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["key", "Job", "--dialect", "mysql"]) == 0
    assert capsys.readouterr().out == server_lock_name(derive_key("Job")) + "\n"


# -- proxies: the connection id the driver was told at connect ------------------------------


@pytest.mark.parametrize("driver", ["pymysql", "mysqldb"])
def test_the_driver_reports_the_connection_id_its_statements_run_in(
    mysql_url: URL, driver: str
) -> None:
    if driver == "mysqldb":
        import_mysqlclient(os.environ)
    engine = create_engine(mysql_url.set(drivername=f"mysql+{driver}"))
    try:
        with engine.connect() as connection:
            told = protocol_session_id(connection.connection.driver_connection)
            assert told == connection.execute(text("SELECT CONNECTION_ID()")).scalar_one()
    finally:
        engine.dispose()


class HandshakeRewritingProxy:
    """A TCP proxy to the server that, like a pooler (ProxySQL, ...), greets clients with a
    connection id of its own while their statements run in the server's session."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.upstream)
            self.sockets += [client, upstream]
            greeting = _read_packet(upstream)
            # Handshake v10: protocol byte, NUL-terminated server version, then the
            # connection id as 4 little-endian bytes.
            id_at = greeting.index(0, 5) + 1
            made_up = (int.from_bytes(greeting[id_at : id_at + 4], "little") + 1_000_000) % 2**32
            greeting[id_at : id_at + 4] = made_up.to_bytes(4, "little")
            client.sendall(greeting)
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for open_socket in self.sockets:
            open_socket.close()


def _read_packet(source: socket.socket) -> bytearray:
    header = source.recv(4, socket.MSG_WAITALL)
    length = int.from_bytes(header[:3], "little")
    return bytearray(header + source.recv(length, socket.MSG_WAITALL))


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@pytest.fixture
def proxied_mysql_engine(mysql_url: URL) -> Iterator[Engine]:
    proxy = HandshakeRewritingProxy(mysql_url.host or "127.0.0.1", mysql_url.port or 3306)
    engine = create_engine(mysql_url.set(host="127.0.0.1", port=proxy.port))
    yield engine
    engine.dispose()
    proxy.close()


def test_a_session_lock_through_a_proxy_is_refused(proxied_mysql_engine: Engine) -> None:
    with (
        proxied_mysql_engine.connect() as connection,
        pytest.raises(UnsupportedFeature, match="pooler or proxy"),
    ):
        advisory_lock(connection, unique_name("proxied")).acquire()


def test_a_session_lock_through_a_proxy_declared_session_pinning_is_taken(
    proxied_mysql_engine: Engine,
) -> None:
    engine = proxied_mysql_engine.execution_options(advisory_locks_pooler="session")
    with engine.connect() as connection, advisory_lock(connection, unique_name("pinned")) as lock:
        assert lock.held
