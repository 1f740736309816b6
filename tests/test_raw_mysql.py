"""Raw MySQL drivers as binds: PyMySQL and mysqlclient (``MySQLdb``) connections.

No SQLAlchemy in the path: ``advisory_lock(conn, ...)`` on the driver's own connection.
What every database promises runs in tests/contract (legs ``mariadb-pymysql`` and
``mariadb-mysqlclient``); here is what is particular to a raw MySQL connection: the
caller's transaction and autocommit mode are left alone, and killed, closed, reconnected
and dropped connections. ``IS_USED_LOCK()`` over a separate admin connection is the
witness of what the server holds; ``@@in_transaction`` of what the lock did to the
caller's transaction.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pymysql
import pymysql.cursors
import pytest
from sqlalchemy.engine import URL

from advisory_locks import (
    AdvisoryLock,
    LockConnectionLost,
    LockLost,
    LockNotAcquired,
    UnsupportedFeature,
    advisory_lock,
    advisory_lock_set,
    current_advisory_locks,
    declare_pooler,
)
from advisory_locks._dialects.mysql import server_lock_name
from advisory_locks.keys import LockName, derive_key
from tests.databases import import_mysqlclient
from tests.helpers import unique_name, wait_for
from tests.test_mysql import HandshakeRewritingProxy

pytestmark = pytest.mark.timeout(60)

DRIVERS = ["pymysql", "mysqlclient"]


class Driver:
    """Makes connections of one MySQL driver to the test server, and closes them all."""

    def __init__(self, name: str, url: URL) -> None:
        self.name = name
        self.url = url
        self.module: Any = pymysql if name == "pymysql" else import_mysqlclient(os.environ)
        self._opened: list[Any] = []

    def arguments(self, **options: Any) -> dict[str, Any]:
        arguments: dict[str, Any] = self.url.translate_connect_args(username="user")
        if self.name == "mysqlclient":
            arguments["passwd"] = arguments.pop("password", "")
            arguments["db"] = arguments.pop("database")
        return {**arguments, **options}

    def connect(self, **options: Any) -> Any:
        connection = self.module.connect(**self.arguments(**options))
        self._opened.append(connection)
        return connection

    @property
    def dict_cursor(self) -> type:
        return self.module.cursors.DictCursor  # type: ignore[no-any-return]

    def close(self) -> None:
        for connection in self._opened:
            with contextlib.suppress(Exception):
                connection.close()


@pytest.fixture(params=DRIVERS)
def driver(request: pytest.FixtureRequest, mysql_url: URL) -> Iterator[Driver]:
    driver = Driver(request.param, mysql_url)
    yield driver
    driver.close()


@pytest.fixture
def admin(mysql_url: URL) -> Iterator[Any]:
    """A separate autocommit PyMySQL connection that looks at the server from outside."""
    connection = pymysql.connect(
        **mysql_url.translate_connect_args(username="user"), autocommit=True
    )
    yield connection
    connection.close()


def value(connection: Any, sql: str, *params: Any) -> Any:
    cursor = connection.cursor()
    try:
        cursor.execute(sql, params or None)
        row = cursor.fetchone()
        return None if row is None else row[0]
    finally:
        cursor.close()


def holder(admin: Any, name: LockName) -> int | None:
    """The connection id holding ``name`` on the server (None: nobody)."""
    return value(admin, "SELECT IS_USED_LOCK(%s)", server_lock_name(derive_key(name)))  # type: ignore[no-any-return]


def connection_id(connection: Any) -> int:
    return int(value(connection, "SELECT CONNECTION_ID()"))


def in_transaction(connection: Any) -> bool:
    return bool(value(connection, "SELECT @@in_transaction"))


def kill(admin: Any, session: int) -> None:
    value(admin, f"KILL CONNECTION {int(session)}")
    alive = "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s"
    wait_for(lambda: not value(admin, alive, session), "the killed session is gone")


@pytest.fixture
def table(admin: Any) -> Iterator[str]:
    """A fresh InnoDB table (one row, n=1) for the transaction specs, dropped afterwards."""
    name = f"raw_mysql_{uuid.uuid4().hex[:12]}"
    value(admin, f"CREATE TABLE {name} (n INT) ENGINE=InnoDB")
    value(admin, f"INSERT INTO {name} VALUES (1)")
    yield name
    value(admin, f"DROP TABLE IF EXISTS {name}")


# -- a session lock -------------------------------------------------------------------------


@pytest.mark.parametrize("autocommit", [False, True])
def test_a_lock_is_held_by_the_server_for_its_connection_and_released_after(
    driver: Driver, admin: Any, autocommit: bool
) -> None:
    name = unique_name("raw-mysql")
    connection = driver.connect(autocommit=autocommit)
    with advisory_lock(connection, name, timeout=2) as lock:
        assert isinstance(lock, AdvisoryLock)
        assert lock.held
        assert holder(admin, name) == connection_id(connection)
        assert current_advisory_locks(connection) == [name]
        with advisory_lock(connection, name, timeout=0):  # counted on the connection
            pass
        assert holder(admin, name) is not None
    assert not lock.held
    assert holder(admin, name) is None
    assert current_advisory_locks(connection) == []


def test_a_busy_lock_is_refused_and_a_lock_set_takes_all_on_one_connection(
    driver: Driver, admin: Any
) -> None:
    first, second = unique_name("raw-mysql-a"), unique_name("raw-mysql-b")
    connection, other = driver.connect(), driver.connect()
    with advisory_lock_set(connection, [second, first], timeout=2):
        assert holder(admin, first) == holder(admin, second) == connection_id(connection)
        with pytest.raises(LockNotAcquired), advisory_lock(other, first, timeout=0):
            pytest.fail("the block must not run")
    assert holder(admin, first) is None
    assert holder(admin, second) is None


def questions(connection: Any) -> int:
    """How many statements this session sent so far (this one included)."""
    cursor = connection.cursor()
    try:
        cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
        return int(cursor.fetchone()[1])
    finally:
        cursor.close()


@pytest.mark.parametrize("mode", [{"shared": True}, {"transaction": True}])
def test_what_mysql_cannot_do_is_refused_before_any_statement(
    driver: Driver, mode: dict[str, bool]
) -> None:
    connection = driver.connect()
    before = questions(connection)
    with pytest.raises(UnsupportedFeature, match="instead"):
        advisory_lock(connection, unique_name("raw-mysql-refused"), **mode)
    assert questions(connection) == before + 1  # the SHOW itself


# -- the caller's transaction -----------------------------------------------------------------


def test_a_lock_on_an_idle_connection_begins_no_transaction(driver: Driver) -> None:
    name = unique_name("raw-mysql-idle")
    connection = driver.connect()  # not in autocommit, as DB-API makes it
    lock = advisory_lock(connection, name, timeout=1)
    assert lock.acquire()
    assert not in_transaction(connection)
    lock.release()
    assert not in_transaction(connection)
    assert connection.get_autocommit() is False


def test_a_lock_taken_and_released_inside_a_transaction_commits_nothing(
    driver: Driver, admin: Any, table: str
) -> None:
    name = unique_name("raw-mysql-inside")
    connection = driver.connect()
    value(connection, f"INSERT INTO {table} VALUES (2)")
    with advisory_lock(connection, name, timeout=1):
        assert in_transaction(connection)
    assert in_transaction(connection)
    connection.rollback()
    # Neither the lock nor its release committed the insert (SET autocommit=1 would).
    assert value(admin, f"SELECT COUNT(*) FROM {table}") == 1
    assert connection.get_autocommit() is False


def test_the_callers_snapshot_is_neither_begun_nor_ended_by_a_lock(
    driver: Driver, admin: Any, table: str
) -> None:
    connection = driver.connect()
    # Begun by nothing: a lock taken on an idle connection, then a row committed by
    # another client before the first read. The read must see it, as it would without
    # the lock (lock, then read current data: the usual reason to take one).
    with advisory_lock(connection, unique_name("raw-mysql-snapshot"), timeout=1):
        value(admin, f"INSERT INTO {table} VALUES (2)")
        assert value(connection, f"SELECT COUNT(*) FROM {table}") == 2
        # Ended by nothing: the read began the caller's REPEATABLE READ snapshot; a lock
        # taken and released inside it leaves it open (MySQL sets no IN_TRANS flag for a
        # transaction that only read, so only leaving autocommit alone keeps it).
        with advisory_lock(connection, unique_name("raw-mysql-snapshot-2"), timeout=1):
            value(admin, f"INSERT INTO {table} VALUES (3)")
        assert value(connection, f"SELECT COUNT(*) FROM {table}") == 2
    assert value(connection, f"SELECT COUNT(*) FROM {table}") == 2
    connection.commit()
    assert value(connection, f"SELECT COUNT(*) FROM {table}") == 3
    connection.rollback()  # ends the read, which would hold the table against DROP


def test_a_busy_lock_inside_a_transaction_leaves_it_usable(
    driver: Driver, admin: Any, table: str
) -> None:
    name = unique_name("raw-mysql-busy")
    holder_connection, connection = driver.connect(), driver.connect()
    with advisory_lock(holder_connection, name):
        value(connection, f"INSERT INTO {table} VALUES (2)")
        assert advisory_lock(connection, name, timeout=0.2).acquire() is False
        value(connection, f"INSERT INTO {table} VALUES (3)")
        connection.commit()
    assert value(admin, f"SELECT COUNT(*) FROM {table}") == 3


def test_autocommit_stays_on(driver: Driver, admin: Any, table: str) -> None:
    connection = driver.connect(autocommit=True)
    with advisory_lock(connection, unique_name("raw-mysql-autocommit"), timeout=1):
        value(connection, f"INSERT INTO {table} VALUES (2)")
        assert value(admin, f"SELECT COUNT(*) FROM {table}") == 2  # committed at once
    assert connection.get_autocommit() is True
    assert not in_transaction(connection)


# -- lost connections ------------------------------------------------------------------------


@pytest.mark.parametrize("check", ["release", "ensure_held"])
def test_a_killed_connection_makes_its_held_lock_report_lock_lost(
    driver: Driver, admin: Any, check: str
) -> None:
    name = unique_name("raw-mysql-killed")
    connection = driver.connect()
    lock = advisory_lock(connection, name, timeout=1)
    assert lock.acquire()
    kill(admin, connection_id(connection))
    assert holder(admin, name) is None
    with pytest.raises(LockLost):
        lock.release() if check == "release" else lock.ensure_held()
    assert not lock.held
    assert current_advisory_locks(connection) == []


def test_acquire_on_a_killed_connection_raises_a_typed_error(driver: Driver, admin: Any) -> None:
    connection = driver.connect()
    with advisory_lock(connection, unique_name("raw-mysql-first"), timeout=0):
        pass  # the connection was checked by a first lock
    kill(admin, connection_id(connection))
    name = unique_name("raw-mysql-dead")
    with pytest.raises(LockConnectionLost) as raised:
        advisory_lock(connection, name, timeout=1).acquire()
    assert isinstance(raised.value.__cause__, driver.module.OperationalError)
    assert holder(admin, name) is None


def test_a_closed_connection_reports_its_locks_lost_and_refuses_new_ones(
    driver: Driver, admin: Any
) -> None:
    name = unique_name("raw-mysql-closed")
    connection = driver.connect()
    lock = advisory_lock(connection, name, timeout=0)
    assert lock.acquire()
    connection.close()
    assert not lock.held
    with pytest.raises(LockLost):
        lock.release()
    with pytest.raises(LockConnectionLost, match="closed"):
        advisory_lock(connection, unique_name("raw-mysql-after-close")).acquire()
    wait_for(lambda: holder(admin, name) is None, "the server let go of the closed session")


def test_a_reconnected_connection_does_not_pass_its_old_locks_for_held(
    driver: Driver, admin: Any
) -> None:
    # ping(reconnect=True) opens a new server session on the same connection object:
    # the old session's locks are gone, and the lock must say so.
    name = unique_name("raw-mysql-reconnect")
    connection = driver.connect()
    lock = advisory_lock(connection, name, timeout=1)
    assert lock.acquire()
    kill(admin, connection_id(connection))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # PyMySQL deprecates reconnect
        connection.ping(True)
    assert not lock.held
    with pytest.raises(LockLost):
        lock.release()
    with advisory_lock(connection, name, timeout=1):  # the new session locks as usual
        assert holder(admin, name) == connection_id(connection)


def test_a_dropped_connection_is_collected_and_its_session_ends(driver: Driver, admin: Any) -> None:
    name = unique_name("raw-mysql-dropped")
    connection = driver.module.connect(**driver.arguments())  # not kept by the fixture
    lock = advisory_lock(connection, name, timeout=1)
    assert lock.acquire()
    assert holder(admin, name) is not None
    del connection, lock
    gc.collect()
    wait_for(lambda: holder(admin, name) is None, "the dropped connection's session ends")


def test_an_interrupted_wait_closes_the_connection_it_waited_on(mysql_url: URL, admin: Any) -> None:
    # The server may still grant an abandoned GET_LOCK; only closing the connection makes
    # sure nobody inherits that grant. (PyMySQL only: mysqlclient waits in C, where a
    # signal handler runs only once GET_LOCK has returned.)
    class Interrupted(BaseException):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    driver = Driver("pymysql", mysql_url)
    name, kept = unique_name("raw-mysql-interrupted"), unique_name("raw-mysql-kept")
    try:
        holder_connection, connection = driver.connect(), driver.connect()
        advisory_lock(holder_connection, name).acquire()
        kept_lock = advisory_lock(connection, kept, timeout=1)
        assert kept_lock.acquire()
        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(Interrupted):
                advisory_lock(connection, name, timeout=20).acquire()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert not connection.open
        assert not kept_lock.held  # it went with the connection
        holder_connection.close()
        wait_for(lambda: holder(admin, name) is None, "nobody was granted the abandoned wait")
        assert holder(admin, kept) is None
    finally:
        driver.close()


# -- how the application made its connection -----------------------------------------------


def test_a_dict_cursor_connection_locks_as_any_other(driver: Driver, admin: Any) -> None:
    name = unique_name("raw-mysql-dict")
    connection = driver.connect(cursorclass=driver.dict_cursor)
    with advisory_lock(connection, name, timeout=1):
        assert holder(admin, name) is not None
    assert holder(admin, name) is None


def test_a_subclass_of_the_drivers_connection_is_a_bind(driver: Driver, admin: Any) -> None:
    class AppConnection(driver.module.connections.Connection):  # type: ignore[name-defined,misc]
        pass

    name = unique_name("raw-mysql-subclass")
    connection = AppConnection(**driver.arguments())
    try:
        with advisory_lock(connection, name, timeout=1):
            assert holder(admin, name) is not None
    finally:
        connection.close()


def test_pymysql_installed_as_mysqldb_is_pymysql(mysql_url: URL, admin: Any) -> None:
    # pymysql.install_as_MySQLdb() (Django setups on PyMySQL) hands out PyMySQL's own
    # connections under the MySQLdb name: they lock as PyMySQL's.
    name = unique_name("raw-mysql-as-mysqldb")
    connection = pymysql.connect(**mysql_url.translate_connect_args(username="user"))
    try:
        assert type(connection).__module__ == "pymysql.connections"
        with advisory_lock(connection, name, timeout=1):
            assert holder(admin, name) is not None
    finally:
        connection.close()


# -- poolers and proxies -----------------------------------------------------------------------


@pytest.fixture
def proxy(mysql_url: URL) -> Iterator[HandshakeRewritingProxy]:
    proxy = HandshakeRewritingProxy(mysql_url.host or "127.0.0.1", mysql_url.port or 3306)
    yield proxy
    proxy.close()


def test_session_locks_through_an_undeclared_proxy_are_refused_until_declared(
    driver: Driver, proxy: HandshakeRewritingProxy, admin: Any
) -> None:
    connection = driver.connect(host="127.0.0.1", port=proxy.port)
    name = unique_name("raw-mysql-proxy")
    with pytest.raises(UnsupportedFeature, match="pooler or proxy"):
        advisory_lock(connection, name).acquire()
    declare_pooler(connection, "session")
    with advisory_lock(connection, name, timeout=1):
        assert holder(admin, name) is not None
