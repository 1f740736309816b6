"""A forked child never releases, unlocks or disturbs a lock its parent holds.

A child made by ``os.fork()`` or by ``multiprocessing`` with the fork start method (a
pre-fork server such as gunicorn ``--preload``) inherits the parent's lock objects, the
pool holding the lock's connection, and that connection's socket or file descriptor.
Whatever the child does with its copies -- leaves the ``with`` block, releases, drops the
lock object so the pool checks the connection in, closes its Connection or Session,
disposes the engine as SQLAlchemy's fork recipe says -- the parent still holds the lock
afterwards (another connection's ``timeout=0`` attempt fails), the child sent nothing on
the parent's connection, and the parent releases it cleanly.

In the child an inherited lock object says ``held`` False, ``ensure_held()`` raises
``LockLost``, ``release()`` gives up the child's copy without touching the parent's lock,
and taking it again is a new acquisition on a connection of the child's own.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from advisory_locks import LockLost, LockUsageError, advisory_lock
from tests.faults.conftest import inject
from tests.faults.servers import FaultDatabase, postgres_holder, postgres_kill
from tests.helpers import holder_pids, unique_name
from tests.test_raw_postgres import libpq_url

pytestmark = pytest.mark.faults

FORK = multiprocessing.get_context("fork")
CHILD_SECONDS = 30.0
BINDS = ["engine", "connection", "session"]
OK = "ok"
SETTLE_SECONDS = 0.1


# -- running code in a forked child ---------------------------------------------------------


def in_child(work: Callable[[], None], *, via: str = "os.fork") -> None:
    """Run ``work`` in a forked child and fail with its traceback if it raised.

    ``via`` is "os.fork" (the child leaves through os._exit, never back into pytest) or
    "multiprocessing" (a fork-context Process, which exits the way multiprocessing's
    children do).
    """
    inject("forked child")
    if via == "os.fork":
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            os.close(read)
            os.write(write, _outcome(work).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            outcome = pipe.read().decode()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    else:
        queue = FORK.SimpleQueue()
        process = FORK.Process(target=_report, args=(work, queue), daemon=True)
        process.start()
        process.join(CHILD_SECONDS)
        assert process.exitcode == 0, f"the child exited with {process.exitcode}"
        outcome = queue.get()
    assert outcome == OK, f"in the child:\n{outcome}"


def _outcome(work: Callable[[], None]) -> str:
    try:
        work()
    except BaseException:  # reported to the parent, which fails the test
        return traceback.format_exc()
    return OK


def _report(work: Callable[[], None], queue: Any) -> None:
    queue.put(_outcome(work))


# -- what the parent holds, kept only in a dict the child can empty --------------------------


def take(kind: str, engine: Engine, name: str, **options: Any) -> dict[str, Any]:
    """Take ``name`` through a bind of ``kind``; the lock and the bind live only in the
    returned dict, so a child that empties it drops its copies of both."""
    held: dict[str, Any] = {}
    if kind == "engine":
        held["bind"] = engine
    elif kind == "connection":
        held["bind"] = engine.connect()
    else:
        held["bind"] = Session(engine)
    held["lock"] = advisory_lock(held["bind"], name, **options)
    assert held["lock"].acquire()
    return held


def give_back(held: dict[str, Any]) -> None:
    """The parent: its lock is intact, it releases cleanly, its bind still works."""
    lock, bind = held["lock"], held["bind"]
    assert lock.held
    lock.ensure_held()
    lock.release()
    if not isinstance(bind, Engine):
        assert bind.execute(text("SELECT 1")).scalar() == 1
        bind.close()


@dataclass
class SessionActivity:
    """The server session a name is held on, and when it last ran a statement."""

    holder: object
    last_statement: object


def server_session(database: FaultDatabase, name: str, admin: Any) -> SessionActivity:
    holder = database.holder(name)
    assert holder is not None
    if database.name == "postgresql":
        row = admin.execute(
            "SELECT query, state, state_change FROM pg_stat_activity WHERE pid = %s", [holder]
        ).fetchone()
        return SessionActivity(holder, tuple(row))
    if database.name == "mariadb":
        # Let the last statement age, so a later one stands out from the rounding.
        time.sleep(SETTLE_SECONDS)
        with admin.cursor() as cursor:
            # TIME_MS restarts whenever the session runs a command: the moment it last
            # did is now minus TIME_MS, the same however long we wait, unless it ran one.
            cursor.execute(
                "SELECT UNIX_TIMESTAMP(NOW(6)) - TIME_MS / 1000 "
                "FROM information_schema.PROCESSLIST WHERE ID = %s",
                (holder,),
            )
            (started,) = cursor.fetchone()
        return SessionActivity(holder, float(started))
    return SessionActivity(holder, None)  # SQLite: no server to send anything to


def assert_untouched(
    database: FaultDatabase, name: str, admin: Any, before: SessionActivity
) -> None:
    """The same session still holds ``name`` and ran no statement since ``before``."""
    after = server_session(database, name, admin)
    assert after.holder == before.holder
    if database.name == "mariadb":
        assert isinstance(after.last_statement, float)
        assert isinstance(before.last_statement, float)
        assert abs(after.last_statement - before.last_statement) < SETTLE_SECONDS / 2, (
            "the child ran a statement on the parent's connection"
        )
    else:
        assert after.last_statement == before.last_statement


def assert_excluded(engine: Engine, name: str) -> None:
    """Another connection (of this process) cannot take ``name`` now."""
    with engine.connect() as connection:
        assert not advisory_lock(connection, name, timeout=0).acquire()


@pytest.fixture
def admin(database: FaultDatabase, request: pytest.FixtureRequest) -> Any:
    if database.name == "postgresql":
        return request.getfixturevalue("pg_admin")
    if database.name == "mariadb":
        return request.getfixturevalue("my_admin")
    return None


@pytest.fixture
def engines(database: FaultDatabase, make_engine: Callable[..., Engine]) -> tuple[Engine, Engine]:
    """The parent's engine, and another one for trying the parent's names from outside."""
    return make_engine(database.url), make_engine(database.url)


# -- the child's ways of letting go of its copy ------------------------------------------------


def leave_block(held: dict[str, Any]) -> None:
    lock = held["lock"]
    assert not lock.held
    with pytest.raises(LockLost, match="forked child"):
        lock.ensure_held()
    lock.__exit__(None, None, None)  # what leaving its `with` block runs
    assert not lock.held


def release(held: dict[str, Any]) -> None:
    lock = held["lock"]
    lock.release()
    with pytest.raises(LockUsageError):
        lock.release()  # the child's copy was given up once, like any lock object


def drop(held: dict[str, Any]) -> None:
    # The pool checks the connection in once the lock object (and a Connection or
    # Session the test made for it) is gone.
    held.clear()
    gc.collect()


def close_bind(held: dict[str, Any]) -> None:
    bind = held["bind"]
    if isinstance(bind, Engine):
        bind.dispose(close=False)
    else:
        bind.close()
    drop(held)


CHILD_ACTIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "leave the block": leave_block,
    "release": release,
    "drop the lock": drop,
    "close the bind": close_bind,
}


@pytest.mark.parametrize("action", CHILD_ACTIONS)
@pytest.mark.parametrize("kind", BINDS)
def test_a_child_leaves_the_parents_lock_alone(
    kind: str,
    action: str,
    database: FaultDatabase,
    engines: tuple[Engine, Engine],
    admin: Any,
) -> None:
    engine, other = engines
    name = unique_name("fork")
    held = take(kind, engine, name)
    before = server_session(database, name, admin)

    in_child(lambda: CHILD_ACTIONS[action](held))

    assert_untouched(database, name, admin, before)
    assert_excluded(other, name)
    give_back(held)
    assert database.holder(name) is None


@pytest.mark.parametrize("action", ["leave the block", "drop the lock"])
@pytest.mark.parametrize("kind", BINDS)
def test_a_multiprocessing_fork_child_leaves_the_parents_lock_alone(
    kind: str,
    action: str,
    database: FaultDatabase,
    engines: tuple[Engine, Engine],
    admin: Any,
) -> None:
    engine, other = engines
    name = unique_name("mp-fork")
    held = take(kind, engine, name)
    before = server_session(database, name, admin)

    in_child(lambda: CHILD_ACTIONS[action](held), via="multiprocessing")

    assert_untouched(database, name, admin, before)
    assert_excluded(other, name)
    give_back(held)
    assert database.holder(name) is None


def while_child_holds(hold: Callable[[], Any], check: Callable[[], None]) -> None:
    """Fork a child that enters the context ``hold()`` gives, run ``check`` in the parent
    while the child is inside it, then let the child leave and exit."""
    holding, checked = FORK.Event(), FORK.Event()
    queue = FORK.SimpleQueue()

    def child() -> None:
        with hold():
            holding.set()
            assert checked.wait(CHILD_SECONDS)

    process = FORK.Process(target=_report, args=(child, queue), daemon=True)
    inject("forked child")
    process.start()
    try:
        assert holding.wait(CHILD_SECONDS), "the child never got its lock"
        check()
    finally:
        checked.set()
        process.join(CHILD_SECONDS)
    assert process.exitcode == 0
    outcome = queue.get()
    assert outcome == OK, f"in the child:\n{outcome}"


def wait_until_free(database: FaultDatabase, name: str) -> None:
    deadline = time.monotonic() + CHILD_SECONDS
    while database.holder(name) is not None:
        assert time.monotonic() < deadline, f"{name} is still held"
        time.sleep(0.01)


@pytest.mark.parametrize("kind", BINDS)
def test_a_child_following_sqlalchemys_fork_recipe_is_excluded_by_its_parent(
    kind: str, database: FaultDatabase, engines: tuple[Engine, Engine], admin: Any
) -> None:
    # SQLAlchemy's recipe: engine.dispose(close=False) first thing in the child. The
    # child then locks on connections of its own, and parent and child exclude each
    # other like any two processes.
    engine, other = engines
    name, childs_own = unique_name("fork"), unique_name("fork-child")
    held = take(kind, engine, name)
    before = server_session(database, name, admin)

    def hold() -> Any:
        engine.dispose(close=False)
        drop(held)
        assert not advisory_lock(engine, name, timeout=0).acquire()
        return advisory_lock(engine, childs_own, timeout=0)

    def check() -> None:
        holder = database.holder(childs_own)
        assert holder is not None
        if database.name != "sqlite":  # a server session of the child's own
            assert holder != database.holder(name)
        assert_excluded(other, childs_own)

    while_child_holds(hold, check)

    assert_untouched(database, name, admin, before)
    wait_until_free(database, childs_own)
    assert_excluded(other, name)
    give_back(held)


@pytest.mark.parametrize("kind", BINDS)
def test_an_inherited_lock_taken_again_in_the_child_is_a_new_acquisition(
    kind: str, database: FaultDatabase, engines: tuple[Engine, Engine], admin: Any
) -> None:
    # Counting it as a re-entry would "grant" the child a lock only its parent holds.
    engine, _ = engines
    name = unique_name("fork")
    held = take(kind, engine, name, timeout=0)
    before = server_session(database, name, admin)

    def child() -> None:
        lock = held["lock"]
        if kind == "connection":
            # The Connection is the parent's: nothing may run on it in the child.
            with pytest.raises(LockUsageError, match="fork"):
                lock.acquire()
        else:
            # The child's own connection, where the parent's hold excludes it.
            assert not lock.acquire()
        assert not lock.held

    in_child(child)

    assert_untouched(database, name, admin, before)
    give_back(held)


def test_a_child_never_locks_on_an_idle_connection_its_parent_opened(
    database: FaultDatabase, engines: tuple[Engine, Engine]
) -> None:
    # Without engine.dispose() in the child, the child's pool hands out the connections
    # the parent opened. A lock taken on one would be held by a server session the parent
    # goes on using: the parent's own attempt there would be counted as a re-entry, and
    # both would hold the lock.
    engine, _ = engines
    name = unique_name("fork-idle")
    with engine.connect() as connection:  # one idle connection in the pool, the parent's
        connection.execute(text("SELECT 1"))

    def check() -> None:
        # The parent's pool hands it that idle connection.
        assert not advisory_lock(engine, name, timeout=0).acquire()

    while_child_holds(lambda: advisory_lock(engine, name, timeout=0), check)

    wait_until_free(database, name)  # the child's connection closed as it exited
    with advisory_lock(engine, name, timeout=0):
        pass


@pytest.mark.parametrize("kind", ["connection", "session"])
def test_a_child_never_ends_the_parents_transaction_lock(
    kind: str, postgres_url: URL, pg_admin: Any, make_engine: Callable[..., Engine]
) -> None:
    # PostgreSQL transaction locks end with the transaction. A child dropping its copy
    # of the Connection or Session would have the pool roll it back -- on the parent's
    # socket, ending the parent's transaction and its locks.
    database = FaultDatabase(
        "postgresql", postgres_url, postgres_holder(pg_admin), frozenset(), postgres_kill(pg_admin)
    )
    engine, other, admin = make_engine(), make_engine(), pg_admin
    name = unique_name("fork-xact")
    held: dict[str, Any] = {}
    held["bind"] = engine.connect() if kind == "connection" else Session(engine)
    held["bind"].begin()
    held["lock"] = advisory_lock(held["bind"], name, transaction=True)
    assert held["lock"].acquire()
    before = server_session(database, name, admin)

    in_child(lambda: drop(held))

    assert_untouched(database, name, admin, before)
    assert_excluded(other, name)
    bind = held["bind"]
    assert bind.execute(text("SELECT 1")).scalar() == 1  # the transaction goes on
    bind.commit()
    assert database.holder(name) is None
    bind.close()


@pytest.mark.parametrize("action", ["release", "drop the lock"])
def test_a_child_leaves_the_parents_lock_on_a_raw_pool_alone(
    action: str, postgres_url: URL, pg_admin: Any
) -> None:
    # A raw pool's borrow that is collected while it holds a lock gives its connection
    # back, closed: in a child, the collected copy is the parent's, and must stay alone.
    dsn = libpq_url(postgres_url)
    name = unique_name("fork-raw-pool")
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as pool:
        held: dict[str, Any] = {"lock": advisory_lock(pool, name)}
        assert held["lock"].acquire()
        (pid,) = holder_pids(pg_admin, name)

        def child() -> None:
            lock = held.pop("lock")
            if action == "release":
                lock.release()
            del lock
            gc.collect()

        in_child(child)
        assert holder_pids(pg_admin, name) == [pid]
        with psycopg.connect(dsn, autocommit=True) as other:
            assert not advisory_lock(other, name, timeout=0).acquire()
        held["lock"].release()
        assert holder_pids(pg_admin, name) == []


# -- raw driver connections the library first meets in the child ---------------------------


@dataclass
class RawParentBind:
    """A raw bind the parent opened and used, never for a lock, and how to look at it."""

    bind: Any
    # The holder of a name on the server, asked over a connection of the parent's own.
    holder: Callable[[str], object | None]
    # Something that changes whenever the bind's server session runs a statement
    # (asked from the parent, so it may itself run one on the session, always the same).
    activity: Callable[[], object]
    close: Callable[[], None]
    # Runs what a lock call returned to its end: an asyncio lock's coroutine in the loop
    # of the bind's connection.
    run: Callable[[Any], Any] = lambda outcome: outcome
    # Opens a blocking connection of the same kind (None: an asyncio driver).
    reopen: Callable[[], Any] | None = None


def socket_number(connection: Any) -> int:
    """The descriptor of a blocking driver connection's socket."""
    sock = getattr(connection, "_sock", None)  # PyMySQL
    return int(sock.fileno() if sock is not None else connection.fileno())


def _postgres_activity(admin: Any, pid: int) -> Callable[[], object]:
    def activity() -> object:
        row = admin.execute(
            "SELECT state, state_change FROM pg_stat_activity WHERE pid = %s", [pid]
        ).fetchone()
        return tuple(row)

    return activity


def _raw_parent_bind(kind: str, request: pytest.FixtureRequest) -> RawParentBind:
    if kind in ("pymysql", "mysqlclient"):
        import pymysql

        from tests.faults.servers import mysql_holder
        from tests.test_raw_mysql import Driver, questions

        driver = Driver(kind, request.getfixturevalue("mysql_url"))
        admin = pymysql.connect(**driver.arguments(), autocommit=True)
        connection = driver.connect()
        # The session's statement count, less this look's own SHOW and every earlier one.
        looks = itertools.count()

        def close() -> None:
            driver.close()
            admin.close()

        return RawParentBind(
            connection,
            mysql_holder(admin),
            lambda: questions(connection) - next(looks),
            close,
            reopen=driver.connect,
        )

    connection: Any

    dsn = libpq_url(request.getfixturevalue("postgres_url"))
    pg_admin = request.getfixturevalue("pg_admin")
    if kind == "psycopg_pool":
        pool = ConnectionPool(dsn, min_size=1, max_size=1, open=True)
        with pool.connection() as pooled:  # its one connection, opened and idle
            pid = pooled.info.backend_pid
        return RawParentBind(
            pool,
            postgres_holder(pg_admin),
            _postgres_activity(pg_admin, pid),
            pool.close,
        )
    if kind == "asyncpg":
        import asyncpg

        # The parent's connection lives in a loop of its own, which stays open; the child
        # and the parent each run their lock in a loop of their own.
        loop = asyncio.new_event_loop()
        connection = loop.run_until_complete(asyncpg.connect(dsn))
        loop.run_until_complete(connection.execute("SELECT 1"))
        pid = connection.get_server_pid()

        def close() -> None:
            loop.run_until_complete(connection.close())
            loop.close()

        return RawParentBind(
            connection,
            postgres_holder(pg_admin),
            _postgres_activity(pg_admin, pid),
            close,
            loop.run_until_complete,
        )
    if kind == "psycopg":
        connect: Callable[[str], Any] = psycopg.connect
        connection = psycopg.connect(dsn, autocommit=True)
        connection.execute("SELECT 1")
        pid = connection.info.backend_pid
    else:
        import psycopg2

        connect = psycopg2.connect
        connection = psycopg2.connect(dsn)
        connection.cursor().execute("SELECT 1")
        connection.rollback()
        pid = connection.get_backend_pid()
    return RawParentBind(
        connection,
        postgres_holder(pg_admin),
        _postgres_activity(pg_admin, pid),
        connection.close,
        reopen=lambda: connect(dsn),
    )


@pytest.fixture(params=["psycopg", "psycopg2", "psycopg_pool", "asyncpg", "pymysql", "mysqlclient"])
def raw_parent_bind(request: pytest.FixtureRequest) -> Any:
    opened = _raw_parent_bind(request.param, request)
    yield opened
    opened.close()


def test_a_child_never_locks_on_a_raw_connection_its_parent_opened_and_never_locked_on(
    raw_parent_bind: RawParentBind,
) -> None:
    # A raw driver tells the library nothing when it connects, so the library first meets
    # this connection at the child's lock. Taken there, the lock would be held by the
    # parent's server session, and the parent's own lock on its connection would be
    # counted by the server as a re-entry: both would hold it. The connection's socket,
    # open at the fork, tells the child the connection is the parent's.
    parent = raw_parent_bind
    name = unique_name("fork-raw-unseen")
    before = parent.activity()

    def child() -> None:
        for lock in (advisory_lock(parent.bind, name, timeout=0), advisory_lock(parent.bind, name)):
            with pytest.raises(LockUsageError, match="fork"):  # refused every time
                in_childs_loop(lock.acquire())
        if parent.reopen is not None:
            # A connection the child opens after the fork is the child's own, even on the
            # descriptor number of the parent's socket: the child lets go of its copy of
            # that descriptor (os.close sends nothing), and the next socket takes it.
            number = socket_number(parent.bind)
            os.close(number)
            own = parent.reopen()
            assert socket_number(own) == number
            try:
                with advisory_lock(own, f"{name}-child", timeout=0) as lock:
                    assert lock.held
            finally:
                own.close()

    in_child(child)

    assert parent.activity() == before, "the child ran a statement on the parent's connection"
    assert parent.holder(name) is None
    lock = advisory_lock(parent.bind, name, timeout=0)
    assert parent.run(lock.acquire())
    assert parent.holder(name) is not None
    parent.run(lock.release())
    assert parent.holder(name) is None


def in_childs_loop(outcome: Any) -> Any:
    """What a lock call returned, an asyncio lock's coroutine run in a loop of the
    child's own (one refused before it awaits anything never needs the parent's)."""
    if asyncio.iscoroutine(outcome):
        return asyncio.new_event_loop().run_until_complete(outcome)
    return outcome


# -- SQLAlchemy connections opened before advisory_locks.sqlalchemy hooked the pools ------

# Run in a process of its own, which has not imported advisory_locks.sqlalchemy when the
# engine opens its connection (the test process imported it long ago). Prints what the
# child's lock did, then whether the parent's lock was granted while the child held its.
UNHOOKED_PARENT = """
import os, sys
from sqlalchemy import create_engine, text

engine = create_engine(sys.argv[1], pool_size=1, max_overflow=0)
kind, name = sys.argv[2], sys.argv[3]
connection = engine.connect()  # opened before the library's pool hook exists
connection.execute(text("SELECT 1"))
connection.commit()
if kind == "engine":
    connection.close()  # back to the pool, idle: the parent's only pooled connection
    bind = engine
else:
    bind = connection

import advisory_locks.sqlalchemy  # noqa: F401, E402
from advisory_locks import LockUsageError, advisory_lock  # noqa: E402

held, checked = os.pipe(), os.pipe()
pid = os.fork()
if pid == 0:
    try:
        lock = advisory_lock(bind, name, timeout=0)
        outcome = "held" if lock.acquire() else "busy"
    except LockUsageError as error:
        outcome = "refused" if "fork" in str(error) else repr(error)
    os.write(held[1], outcome.encode())
    os.read(checked[0], 1)  # holds its lock (if any) until the parent looked
    os._exit(0)
print("child:", os.read(held[0], 100).decode())
print("parent:", "held" if advisory_lock(bind, name, timeout=0).acquire() else "busy")
os.write(checked[1], b"x")
os.waitpid(pid, 0)
"""


# (SQLite connections have no socket, and must not cross a fork at all.)
@pytest.mark.parametrize("database", ["postgresql", "mariadb"], indirect=True)
@pytest.mark.parametrize(
    ("kind", "child"), [("engine", "held"), ("connection", "refused")], ids=["engine", "connection"]
)
def test_a_child_tells_its_parents_connections_opened_before_the_library_was_imported(
    kind: str, child: str, database: FaultDatabase
) -> None:
    # advisory_locks.sqlalchemy records which process opened each connection from its
    # pool hook, which sees only connections opened after it was imported. The socket of
    # one opened before tells the child it is the parent's: an Engine's child takes its
    # lock on a fresh connection of its own, a Connection's child is refused. Either way
    # the parent's lock, on its own connection, is excluded or stands alone.
    name = unique_name("fork-unhooked")
    inject("forked child")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            UNHOOKED_PARENT,
            database.url.render_as_string(hide_password=False),
            kind,
            name,
        ],
        capture_output=True,
        text=True,
        timeout=CHILD_SECONDS,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    parent = "busy" if child == "held" else "held"
    assert result.stdout.split("\n")[:2] == [f"child: {child}", f"parent: {parent}"], (
        result.stdout,
        result.stderr,
    )
    assert database.holder(name) is None


def test_a_raw_connection_the_child_reconnected_is_its_own(mysql_url: URL) -> None:
    # PyMySQL's connect() gives a connection object a new socket and server session. Found
    # inherited by its socket before, the same object is then the child's own.
    import pymysql

    from tests.faults.servers import mysql_holder

    arguments: dict[str, Any] = mysql_url.translate_connect_args(username="user")
    connection = pymysql.connect(**arguments)
    parents_session = connection.thread_id()
    name = unique_name("fork-raw-reconnect")

    def child() -> None:
        with pytest.raises(LockUsageError, match="fork"):
            advisory_lock(connection, name, timeout=0).acquire()
        connection.connect()  # a socket and a session of the child's own
        assert connection.thread_id() != parents_session
        admin = pymysql.connect(**arguments, autocommit=True)
        with advisory_lock(connection, name, timeout=0) as lock:
            assert lock.held
            assert mysql_holder(admin)(name) == connection.thread_id()
        admin.close()

    in_child(child)

    assert connection.thread_id() == parents_session
    with advisory_lock(connection, name, timeout=0) as lock:  # the parent's session is up
        assert lock.held
    connection.close()
