"""The hard requirements: locks versus transactions, pools, dead backends and deadlocks.

Sync SQLAlchemy on psycopg 3 against the real PostgreSQL. What the server holds is read
from ``pg_locks`` on a separate admin connection; what the library sent is recorded in a
psycopg cursor.
"""

from __future__ import annotations

import contextlib
import gc
import random
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from advisory_locks import (
    LockDeadlock,
    LockLost,
    LockNotAcquired,
    LockTimeout,
    UnsupportedFeature,
    advisory_lock,
    current_advisory_locks,
)
from tests.helpers import (
    advisory_locks_held,
    advisory_statements,
    backend_alive,
    engine_backends_with_advisory_locks,
    holder_pids,
    lock_rows,
    open_bind,
    record_statements,
    run_crossed,
    unique_name,
    wait_for,
)

JOIN_SECONDS = 30.0

Admin = psycopg.Connection[TupleRow]


def backend_pid(connection: Connection) -> int:
    """The server process behind a Connection, asked of psycopg (no SQL, no autobegin)."""
    pid = connection.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
    assert isinstance(pid, int)
    return pid


def backend_state(admin: Admin, pid: int) -> str | None:
    row = admin.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
    return None if row is None else row[0]


def engine_backends(admin: Admin, application_name: str) -> set[int]:
    rows = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s", [application_name]
    ).fetchall()
    return {row[0] for row in rows}


def driver_transaction_status(connection: Connection) -> TransactionStatus:
    return connection.connection.dbapi_connection.info.transaction_status  # type: ignore[union-attr,no-any-return]


def assert_idle(connection: Connection, admin: Admin, pid: int) -> None:
    """No transaction open on ``connection``: not in SQLAlchemy, the driver or the server."""
    assert not connection.in_transaction()
    assert driver_transaction_status(connection) == TransactionStatus.IDLE
    assert backend_state(admin, pid) == "idle"


@pytest.fixture
def make_engine(postgres_url: URL) -> Iterator[Callable[..., Engine]]:
    """Engines a test configures itself (pool size, application_name); disposed after."""
    engines: list[Engine] = []

    def make(**options: Any) -> Engine:
        engine = create_engine(postgres_url, **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.dispose()


@pytest.fixture
def scratch_table(pg_admin: Admin) -> Iterator[str]:
    """A real table (rows must be visible from another connection after commit)."""
    name = f"advisory_locks_scratch_{uuid.uuid4().hex}"
    pg_admin.execute(
        sql.SQL("CREATE TABLE {} (id serial PRIMARY KEY, note text NOT NULL)").format(
            sql.Identifier(name)
        )
    )
    yield name
    pg_admin.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(name)))


def insert_note(connection: Connection, table: str, note: str) -> None:
    connection.execute(text(f'INSERT INTO "{table}" (note) VALUES (:note)'), {"note": note})


def committed_notes(admin: Admin, table: str) -> list[str]:
    query = sql.SQL("SELECT note FROM {} ORDER BY id").format(sql.Identifier(table))
    return [row[0] for row in admin.execute(query).fetchall()]


# -- (a) session locks survive commit and rollback inside their block ----------------------


def test_a_session_with_only_per_mapper_binds_is_refused_before_any_sql(
    pg_engine: Engine,
) -> None:
    from sqlalchemy import MetaData, Table

    table = Table("advisory_locks_test_unbound", MetaData())
    with Session(binds={table: pg_engine}) as session:
        with pytest.raises(ValueError, match="no bind of its own"):
            advisory_lock(session, unique_name())
        assert pg_engine.pool.checkedout() == 0
        assert not session.in_transaction()


def test_session_lock_survives_session_commit_inside_its_block(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with Session(pg_engine) as session, advisory_lock(session, name):
        holder = holder_pids(pg_admin, name)
        session.execute(text("SELECT 1"))
        session.commit()
        assert holder_pids(pg_admin, name) == holder != []


def test_session_lock_survives_session_rollback_inside_its_block(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with Session(pg_engine) as session, advisory_lock(session, name):
        holder = holder_pids(pg_admin, name)
        session.execute(text("SELECT 1"))
        session.rollback()
        assert holder_pids(pg_admin, name) == holder != []


def test_session_lock_is_released_once_at_block_exit_by_the_connection_that_took_it(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine = make_engine()
    statements = record_statements(engine)
    name = unique_name()
    with Session(engine) as session:
        with advisory_lock(session, name):
            holder = holder_pids(pg_admin, name)
            for end_transaction in (session.commit, session.rollback, session.commit):
                session.execute(text("SELECT 1"))
                end_transaction()
                assert holder_pids(pg_admin, name) == holder
        assert lock_rows(pg_admin, name) == []
        unlocks = [s for s in advisory_statements(statements) if "unlock" in s]
        assert len(unlocks) == 1


def test_connection_session_lock_survives_commit_and_rollback_inside_its_block(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        pid = backend_pid(connection)
        with advisory_lock(connection, name):
            for end_transaction in (connection.commit, connection.rollback):
                connection.execute(text("SELECT 1"))
                end_transaction()
                assert holder_pids(pg_admin, name) == [pid]
        assert lock_rows(pg_admin, name) == []


def test_session_lock_taken_inside_a_transaction_outlives_its_commit(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        lock = advisory_lock(connection, name)
        with connection.begin():
            lock.acquire()
        assert len(holder_pids(pg_admin, name)) == 1
        lock.release()
        assert lock_rows(pg_admin, name) == []


def test_session_lock_before_the_first_statement_of_a_transaction_leaves_it_one(
    pg_engine: Engine,
) -> None:
    # The Session's transaction has its connection, but psycopg sends BEGIN only with the
    # first statement, so the driver still says idle: the lock must not take that for a
    # connection it may switch to autocommit, or the Session's statements would each
    # commit on their own.
    with advisory_lock(pg_engine, unique_name(), timeout=1):
        pass  # as in any process after its first lock: the driver's kind is known
    with Session(pg_engine) as session:
        connection = session.connection()
        assert driver_transaction_status(connection) == TransactionStatus.IDLE
        with advisory_lock(session, unique_name(), timeout=1):
            session.execute(text("SELECT 1"))
            assert driver_transaction_status(connection) == TransactionStatus.INTRANS
        session.execute(text("SELECT 1"))
        assert driver_transaction_status(connection) == TransactionStatus.INTRANS
        session.rollback()


def test_release_after_the_locking_transaction_ended_leaves_the_connection_idle(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        pid = backend_pid(connection)
        lock = advisory_lock(connection, name)
        with connection.begin():
            lock.acquire()
        lock.release()
        # The unlock must not open a transaction SQLAlchemy does not know about.
        assert_idle(connection, pg_admin, pid)


def test_session_lock_on_an_idle_connection_opens_no_transaction(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    with pg_engine.connect() as connection:
        pid = backend_pid(connection)
        with advisory_lock(connection, unique_name()):
            assert not connection.in_transaction()
            assert backend_state(pg_admin, pid) == "idle"


def test_connection_runs_its_next_transaction_in_its_own_mode_after_a_lock(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    # The lock's statements ran in autocommit and may leave the driver so until the next
    # transaction: that transaction must still be one (not autocommitted statements).
    with pg_engine.connect() as connection:
        pid = backend_pid(connection)
        for _ in range(2):  # the first lock switches the mode, the second finds it switched
            with advisory_lock(connection, unique_name(), timeout=1):
                pass
            connection.execute(text("SELECT 1"))
            assert driver_transaction_status(connection) == TransactionStatus.INTRANS
            assert backend_state(pg_admin, pid) == "idle in transaction"
            connection.rollback()
            assert backend_state(pg_admin, pid) == "idle"


def test_connection_isolation_level_set_after_a_lock_is_the_one_in_force(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    with pg_engine.connect() as connection:
        pid = backend_pid(connection)
        with advisory_lock(connection, unique_name(), timeout=1):
            pass
        connection.execution_options(isolation_level="AUTOCOMMIT")
        connection.execute(text("SELECT 1"))
        # Not turned back to the mode the connection had before the lock.
        assert driver_transaction_status(connection) == TransactionStatus.IDLE
        assert backend_state(pg_admin, pid) == "idle"
        connection.commit()  # SQLAlchemy's logical transaction, even in AUTOCOMMIT
        connection.execution_options(isolation_level="SERIALIZABLE")
        with advisory_lock(connection, unique_name(), timeout=1):
            pass
        connection.execute(text("SELECT 1"))
        level = connection.execute(text("SHOW transaction_isolation")).scalar()
        assert (level, driver_transaction_status(connection)) == (
            "serializable",
            TransactionStatus.INTRANS,
        )
        connection.rollback()


def test_transaction_lock_after_a_session_lock_on_the_same_connection(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        pid = backend_pid(connection)
        with advisory_lock(connection, unique_name(), timeout=1):
            pass
        lock = advisory_lock(connection, name, transaction=True)
        assert lock.acquire()
        assert connection.in_transaction()
        assert driver_transaction_status(connection) == TransactionStatus.INTRANS
        lock.release()
        assert holder_pids(pg_admin, name) == [pid]  # until the transaction ends
        connection.commit()
        assert lock_rows(pg_admin, name) == []


def test_release_after_a_transaction_inside_the_block_leaves_the_connection_idle(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        pid = backend_pid(connection)
        with advisory_lock(connection, unique_name(), timeout=1):
            pass  # leaves the mode switched for the next lock
        with advisory_lock(connection, name, timeout=1):
            connection.execute(text("SELECT 1"))
            connection.commit()
        assert lock_rows(pg_admin, name) == []
        assert_idle(connection, pg_admin, pid)


# -- (b) no pooled connection goes back to the pool holding a lock -------------------------


class MixedWorkload:
    """Random everyday uses (and misuses) of locks, each step leaving nothing behind.

    Every acquire uses timeout=0 and must succeed: the workload is single-threaded, so a
    busy lock can only be one an earlier step leaked.
    """

    def __init__(self, engine: Engine, seed: int) -> None:
        self.engine = engine
        self.random = random.Random(seed)
        self.names = [unique_name(f"mixed-{index}") for index in range(4)]

    def run(self, steps: int) -> None:
        operations = [
            getattr(self, attribute) for attribute in dir(self) if attribute.startswith("op_")
        ]
        for _ in range(steps):
            self.random.choice(operations)()

    def name(self) -> str:
        return self.random.choice(self.names)

    def other_name(self, name: str) -> str:
        return self.random.choice([other for other in self.names if other != name])

    def end_transaction(self, connection: Connection | Session) -> None:
        if self.random.random() < 0.5:
            connection.commit()
        else:
            connection.rollback()

    def op_session_lock_across_commits_and_rollbacks(self) -> None:
        with Session(self.engine) as session, advisory_lock(session, self.name(), timeout=0):
            for _ in range(self.random.randint(1, 3)):
                session.execute(text("SELECT 1"))
                self.end_transaction(session)

    def op_connection_lock_left_by_an_exception(self) -> None:
        with self.engine.connect() as connection:
            with (
                contextlib.suppress(ZeroDivisionError),
                advisory_lock(connection, self.name(), timeout=0),
            ):
                connection.execute(text("SELECT 1"))
                raise ZeroDivisionError
            self.end_transaction(connection)

    def op_engine_lock(self) -> None:
        with advisory_lock(self.engine, self.name(), timeout=0):
            pass

    def op_nested_locks(self) -> None:
        name = self.name()
        with (
            Session(self.engine) as session,
            advisory_lock(session, name, timeout=0),
            advisory_lock(session, name, timeout=0),
            advisory_lock(session, self.other_name(name), timeout=0, shared=True),
        ):
            session.execute(text("SELECT 1"))
            self.end_transaction(session)

    def op_transaction_lock_on_a_connection(self) -> None:
        with self.engine.connect() as connection:
            with advisory_lock(connection, self.name(), timeout=0, transaction=True):
                connection.execute(text("SELECT 1"))
            self.end_transaction(connection)

    def op_transaction_lock_in_a_session_savepoint(self) -> None:
        with Session(self.engine) as session:
            savepoint = session.begin_nested()
            advisory_lock(session, self.name(), timeout=0, transaction=True).acquire()
            if self.random.random() < 0.5:
                savepoint.rollback()
            else:
                savepoint.commit()
            self.end_transaction(session)

    def op_session_lock_inside_a_connection_transaction(self) -> None:
        with self.engine.connect() as connection:
            lock = advisory_lock(connection, self.name(), timeout=0)
            with connection.begin():
                lock.acquire()
            connection.execute(text("SELECT 1"))
            self.end_transaction(connection)
            lock.release()

    def op_dropped_connection_lock(self) -> None:
        with self.engine.connect() as connection:
            lock = advisory_lock(connection, self.name(), timeout=0)
            assert lock.acquire()
            del lock
            gc.collect()

    def op_dropped_session_lock(self) -> None:
        session = Session(self.engine)
        lock = advisory_lock(session, self.name(), timeout=0)
        assert lock.acquire()
        session.close()
        del lock, session
        gc.collect()

    def op_dropped_engine_lock(self) -> None:
        lock = advisory_lock(self.engine, self.name(), timeout=0)
        assert lock.acquire()
        del lock
        gc.collect()

    def op_connection_closed_inside_the_block(self) -> None:
        connection = self.engine.connect()
        with contextlib.suppress(LockLost), advisory_lock(connection, self.name(), timeout=0):
            connection.close()

    def op_sql_error_inside_a_locked_transaction(self) -> None:
        with self.engine.connect() as connection:
            with (
                contextlib.suppress(DBAPIError),
                connection.begin(),
                advisory_lock(connection, self.name(), timeout=0),
            ):
                connection.execute(text("SELECT 1/0"))
            if self.random.random() < 0.5:
                connection.execute(text("SELECT 1"))
                self.end_transaction(connection)

    def op_exclusion_between_binds(self) -> None:
        name = self.name()
        with advisory_lock(self.engine, name, timeout=0), Session(self.engine) as session:
            assert advisory_lock(session, name, timeout=0).acquire() is False

    def op_busy_try_inside_a_transaction(self) -> None:
        name = self.name()
        with (
            self.engine.connect() as holder,
            advisory_lock(holder, name, timeout=0),
            self.engine.connect() as connection,
            connection.begin(),
        ):
            assert advisory_lock(connection, name, timeout=0).acquire() is False
            connection.execute(text("SELECT 1"))


def test_no_pooled_connection_holds_an_advisory_lock_after_many_mixed_operations(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    application_name = f"al-mixed-{uuid.uuid4().hex[:16]}"
    engine = make_engine(
        pool_size=3, pool_timeout=10, connect_args={"application_name": application_name}
    )
    MixedWorkload(engine, seed=20261121).run(steps=400)
    gc.collect()
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]

    pooled = [engine.connect() for _ in range(engine.pool.checkedin())]  # type: ignore[attr-defined]
    try:
        pids = {backend_pid(connection) for connection in pooled}
        assert pids == engine_backends(pg_admin, application_name) != set()
        for pid in pids:
            assert advisory_locks_held(pg_admin, pid) == []
        assert engine_backends_with_advisory_locks(pg_admin, application_name) == []
    finally:
        for connection in pooled:
            connection.close()


def test_connection_closed_inside_the_block_releases_the_lock_at_checkin(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    connection = pg_engine.connect()
    lock = advisory_lock(connection, name)
    lock.acquire()
    connection.close()
    assert lock_rows(pg_admin, name) == []
    with pytest.raises(LockLost):
        lock.release()


def test_block_exit_after_its_connection_was_closed_raises_lock_lost(pg_engine: Engine) -> None:
    connection = pg_engine.connect()
    with pytest.raises(LockLost), advisory_lock(connection, unique_name()):
        connection.close()


def test_connection_lock_garbage_collected_while_held_is_released_at_checkin(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine = make_engine(pool_size=1, max_overflow=0)
    name = unique_name()
    with engine.connect() as connection:
        pid = backend_pid(connection)
        lock = advisory_lock(connection, name)
        lock.acquire()
        del lock
        gc.collect()
        assert holder_pids(pg_admin, name) == [pid]
    assert lock_rows(pg_admin, name) == []
    with engine.connect() as connection:
        assert backend_pid(connection) == pid  # cleaned and kept, not thrown away


def test_engine_lock_garbage_collected_while_held_is_released_at_checkin(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine = make_engine(pool_size=1, max_overflow=0)
    name = unique_name()
    lock = advisory_lock(engine, name)
    lock.acquire()
    assert len(holder_pids(pg_admin, name)) == 1
    del lock
    gc.collect()
    assert lock_rows(pg_admin, name) == []
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_session_lock_garbage_collected_with_its_session_is_released_at_checkin(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine = make_engine(pool_size=2, max_overflow=0)
    name = unique_name()
    session = Session(engine)
    lock = advisory_lock(session, name)
    lock.acquire()
    session.close()
    del lock, session
    gc.collect()
    assert lock_rows(pg_admin, name) == []
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_session_lock_dropped_while_its_session_lives_on_is_released(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    # A long-lived Session (scoped_session) must not keep a forgotten lock: only lock
    # objects keep the Session's lock connection checked out.
    engine = make_engine(pool_size=2, max_overflow=0)
    name = unique_name()
    with Session(engine) as session:
        lock = advisory_lock(session, name)
        lock.acquire()
        del lock
        gc.collect()
        assert lock_rows(pg_admin, name) == []
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        with advisory_lock(session, name, timeout=0):
            assert len(holder_pids(pg_admin, name)) == 1
        assert lock_rows(pg_admin, name) == []


def test_connection_cleaned_by_the_checkin_guard_goes_back_idle(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine = make_engine(pool_size=1, max_overflow=0)
    with engine.connect() as connection:
        pid = backend_pid(connection)
        lock = advisory_lock(connection, unique_name())
        lock.acquire()
        del lock
        gc.collect()
    # An open transaction would hand the next borrower a stale now() and a snapshot
    # horizon that stays pinned while the connection sits in the pool.
    assert backend_state(pg_admin, pid) == "idle"
    with engine.connect() as connection:
        assert driver_transaction_status(connection) == TransactionStatus.IDLE


# -- (c) transaction locks live until their transaction ends -------------------------------


@pytest.fixture(params=["connection", "session"])
def transactional(
    request: pytest.FixtureRequest, pg_engine: Engine
) -> Iterator[Connection | Session]:
    with open_bind(request.param, pg_engine) as opened:
        assert isinstance(opened, (Connection, Session))
        yield opened


def test_transaction_lock_outlives_its_block_until_the_transaction_ends(
    transactional: Connection | Session, pg_admin: Admin
) -> None:
    name = unique_name()
    with advisory_lock(transactional, name, transaction=True):
        pass
    assert len(holder_pids(pg_admin, name)) == 1
    transactional.rollback()


def test_transaction_lock_is_released_by_commit(
    transactional: Connection | Session, pg_admin: Admin
) -> None:
    name = unique_name()
    with advisory_lock(transactional, name, transaction=True):
        pass
    transactional.commit()
    assert lock_rows(pg_admin, name) == []


def test_transaction_lock_is_released_by_rollback(
    transactional: Connection | Session, pg_admin: Admin
) -> None:
    name = unique_name()
    with advisory_lock(transactional, name, transaction=True):
        pass
    transactional.rollback()
    assert lock_rows(pg_admin, name) == []


def test_transaction_lock_taken_in_a_savepoint_that_rolls_back_is_released(
    transactional: Connection | Session, pg_admin: Admin
) -> None:
    name = unique_name()
    outer = unique_name("outer")
    advisory_lock(transactional, outer, transaction=True).acquire()
    savepoint = transactional.begin_nested()
    advisory_lock(transactional, name, transaction=True).acquire()
    savepoint.rollback()
    assert lock_rows(pg_admin, name) == []
    assert len(holder_pids(pg_admin, outer)) == 1
    transactional.commit()


def test_transaction_lock_is_taken_again_after_its_savepoint_rolled_back(
    transactional: Connection | Session, pg_admin: Admin
) -> None:
    name = unique_name()
    savepoint = transactional.begin_nested()
    advisory_lock(transactional, name, transaction=True).acquire()
    savepoint.rollback()
    lock = advisory_lock(transactional, name, transaction=True)
    assert lock.acquire()
    assert len(holder_pids(pg_admin, name)) == 1
    transactional.commit()
    assert lock_rows(pg_admin, name) == []


def test_transaction_lock_taken_in_a_released_savepoint_lives_until_the_outer_commit(
    transactional: Connection | Session, pg_admin: Admin
) -> None:
    name = unique_name()
    savepoint = transactional.begin_nested()
    advisory_lock(transactional, name, transaction=True).acquire()
    savepoint.commit()
    assert len(holder_pids(pg_admin, name)) == 1
    transactional.commit()
    assert lock_rows(pg_admin, name) == []


def test_transaction_lock_taken_before_a_savepoint_survives_its_rollback(
    transactional: Connection | Session, pg_admin: Admin
) -> None:
    name = unique_name()
    advisory_lock(transactional, name, transaction=True).acquire()
    savepoint = transactional.begin_nested()
    savepoint.rollback()
    assert len(holder_pids(pg_admin, name)) == 1
    transactional.commit()


def test_transaction_lock_is_taken_again_in_a_new_transaction_on_the_same_connection(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine = make_engine()
    statements = record_statements(engine)
    name = unique_name()
    with engine.connect() as connection:
        with connection.begin():
            advisory_lock(connection, name, transaction=True).acquire()
        sent_before = len(advisory_statements(statements))
        with connection.begin():
            assert advisory_lock(connection, name, transaction=True).acquire()
            assert len(advisory_statements(statements)) == sent_before + 1
            assert len(holder_pids(pg_admin, name)) == 1
        assert lock_rows(pg_admin, name) == []


def test_transaction_lock_on_an_idle_connection_begins_a_transaction(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        advisory_lock(connection, name, transaction=True).acquire()
        assert connection.in_transaction()
        connection.commit()
        assert lock_rows(pg_admin, name) == []


def test_transaction_lock_excludes_other_connections_until_commit(
    transactional: Connection | Session, pg_engine: Engine
) -> None:
    name = unique_name()
    advisory_lock(transactional, name, transaction=True).acquire()
    with pg_engine.connect() as rival:
        assert advisory_lock(rival, name, timeout=0).acquire() is False
        transactional.commit()
        with advisory_lock(rival, name, timeout=0) as taken:
            assert taken.held


def test_transaction_lock_on_an_engine_is_refused_before_any_sql(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine()
    connects: list[object] = []
    event.listen(engine, "connect", lambda *arguments: connects.append(arguments))
    with pytest.raises(UnsupportedFeature):
        advisory_lock(engine, unique_name(), transaction=True)
    assert connects == []


def test_transaction_lock_on_an_autocommit_connection_is_refused_before_any_sql(
    make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine = make_engine()
    statements = record_statements(engine)
    name = unique_name()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        with pytest.raises(UnsupportedFeature):
            advisory_lock(connection, name, transaction=True).acquire()
        assert advisory_statements(statements) == []
    assert lock_rows(pg_admin, name) == []


def test_transaction_lock_on_an_autocommit_session_is_refused_before_any_sql(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(isolation_level="AUTOCOMMIT")
    statements = record_statements(engine)
    with Session(engine) as session, pytest.raises(UnsupportedFeature):
        advisory_lock(session, unique_name(), transaction=True).acquire()
    assert advisory_statements(statements) == []


# -- (d) a terminated backend is reported, and its connection is not reused ----------------


@pytest.mark.parametrize("kind", ["engine", "connection", "session"])
def test_release_after_the_backend_was_terminated_raises_lock_lost(
    kind: str, make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    engine = make_engine(pool_size=1, max_overflow=0, pool_timeout=5)
    name = unique_name()
    with open_bind(kind, engine) as bind:
        lock = advisory_lock(bind, name)
        lock.acquire()
        (pid,) = holder_pids(pg_admin, name)
        pg_admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        wait_for(lambda: not backend_alive(pg_admin, pid), "the backend has exited")
        with pytest.raises(LockLost):
            lock.release()


@pytest.mark.parametrize("kind", ["engine", "connection", "session"])
def test_connection_of_a_terminated_lock_is_not_reused_as_healthy(
    kind: str, make_engine: Callable[..., Engine], pg_admin: Admin
) -> None:
    # One pooled connection: the next checkout gets the same pool slot.
    engine = make_engine(pool_size=1, max_overflow=0, pool_timeout=5)
    name = unique_name()
    with open_bind(kind, engine) as bind:
        lock = advisory_lock(bind, name)
        lock.acquire()
        (pid,) = holder_pids(pg_admin, name)
        pg_admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        wait_for(lambda: not backend_alive(pg_admin, pid), "the backend has exited")
        with contextlib.suppress(LockLost):
            lock.release()
    with engine.connect() as connection:
        assert connection.scalar(text("SELECT 1")) == 1
        assert backend_pid(connection) != pid


def test_lock_lost_to_a_terminated_backend_is_no_longer_listed(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with Session(pg_engine) as session:
        lock = advisory_lock(session, name)
        lock.acquire()
        (pid,) = holder_pids(pg_admin, name)
        pg_admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        wait_for(lambda: not backend_alive(pg_admin, pid), "the backend has exited")
        with contextlib.suppress(LockLost):
            lock.release()
        assert current_advisory_locks(session) == []
        assert not lock.held


def test_session_takes_locks_again_after_its_lock_connection_was_terminated(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with Session(pg_engine) as session:
        lock = advisory_lock(session, name)
        lock.acquire()
        (pid,) = holder_pids(pg_admin, name)
        pg_admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        wait_for(lambda: not backend_alive(pg_admin, pid), "the backend has exited")
        with contextlib.suppress(LockLost):
            lock.release()
        with advisory_lock(session, name, timeout=0):
            assert holder_pids(pg_admin, name) not in ([], [pid])


# -- (e) deadlocks -------------------------------------------------------------------------


def run_crossed_locks(
    engine: Engine, *, in_transaction: bool, table: str | None = None
) -> list[str]:
    """Two threads each take one name, then ask for the other's; return their outcomes."""
    both_hold_one = threading.Barrier(2, timeout=JOIN_SECONDS)
    outcomes: list[str] = []

    def cross(mine: str, theirs: str) -> None:
        with engine.connect() as connection:
            transaction = connection.begin() if in_transaction else None
            if table is not None:
                insert_note(connection, table, f"before {mine}")
            with advisory_lock(connection, mine):
                both_hold_one.wait()
                try:
                    with advisory_lock(connection, theirs, timeout=None):
                        outcomes.append("granted")
                except LockDeadlock:
                    outcomes.append("deadlock")
            if transaction is not None:
                assert connection.scalar(text("SELECT 1")) == 1
                transaction.commit()

    run_crossed(cross, join_seconds=JOIN_SECONDS)
    return sorted(outcomes)


def test_crossed_lock_requests_raise_lock_deadlock_in_one_and_grant_the_other(
    pg_engine: Engine,
) -> None:
    assert run_crossed_locks(pg_engine, in_transaction=False) == ["deadlock", "granted"]


def test_deadlock_inside_a_transaction_leaves_it_usable_and_committable(
    pg_engine: Engine, scratch_table: str, pg_admin: Admin
) -> None:
    outcomes = run_crossed_locks(pg_engine, in_transaction=True, table=scratch_table)
    assert outcomes == ["deadlock", "granted"]
    assert len(committed_notes(pg_admin, scratch_table)) == 2


# -- (f) the caller's transaction stays usable after a failed acquire ----------------------


@pytest.mark.parametrize("timeout", [0, 0.2])
def test_transaction_is_usable_and_committable_after_a_failed_acquire_inside_it(
    timeout: float, pg_engine: Engine, scratch_table: str, pg_admin: Admin
) -> None:
    name = unique_name()
    with (
        pg_engine.connect() as holder,
        advisory_lock(holder, name),
        pg_engine.connect() as connection,
        connection.begin(),
    ):
        insert_note(connection, scratch_table, "written before the failed acquire")
        assert advisory_lock(connection, name, timeout=timeout).acquire() is False
        assert connection.scalar(text("SELECT 1")) == 1
        insert_note(connection, scratch_table, "written after it")
    assert committed_notes(pg_admin, scratch_table) == [
        "written before the failed acquire",
        "written after it",
    ]


@pytest.mark.parametrize("transaction", [False, True])
def test_with_block_failing_inside_a_transaction_leaves_it_committable(
    transaction: bool, pg_engine: Engine, scratch_table: str, pg_admin: Admin
) -> None:
    name = unique_name()
    with (
        pg_engine.connect() as holder,
        advisory_lock(holder, name),
        pg_engine.connect() as connection,
        connection.begin(),
    ):
        insert_note(connection, scratch_table, "kept")
        with (
            pytest.raises(LockNotAcquired),
            advisory_lock(connection, name, timeout=0.1, transaction=transaction),
        ):
            pytest.fail("the block must not run without the lock")
    assert committed_notes(pg_admin, scratch_table) == ["kept"]


@pytest.mark.parametrize("busy", [False, True], ids=["granted", "timed-out"])
def test_callers_local_lock_timeout_is_restored_after_an_acquire_with_a_timeout(
    busy: bool, pg_engine: Engine
) -> None:
    name = unique_name()
    with pg_engine.connect() as holder, pg_engine.connect() as connection:
        rival = advisory_lock(holder, name)
        if busy:
            rival.acquire()
        with connection.begin():
            connection.execute(text("SET LOCAL lock_timeout = '3s'"))
            granted = advisory_lock(connection, name, timeout=0.1).acquire()
            assert granted is not busy
            assert connection.scalar(text("SHOW lock_timeout")) == "3s"
        if busy:
            rival.release()


def test_callers_session_lock_timeout_is_kept_after_an_acquire_outside_a_transaction(
    pg_engine: Engine,
) -> None:
    with pg_engine.connect() as connection:
        connection.execute(text("SET lock_timeout = '4s'"))
        connection.commit()
        with advisory_lock(connection, unique_name(), timeout=0.5):
            assert connection.scalar(text("SHOW lock_timeout")) == "4s"


@pytest.mark.parametrize("in_transaction", [False, True], ids=["idle", "in-transaction"])
def test_a_wait_without_timeout_ended_by_the_callers_lock_timeout_raises(
    in_transaction: bool, pg_engine: Engine, pg_admin: Admin
) -> None:
    # The caller's lock_timeout bounds a wait without a timeout (tests/faults/
    # test_caller_timeouts.py). acquire() answered False for it, and a caller who passed
    # no timeout, and so did not look at the answer, ran its block beside the holder.
    name = unique_name()
    with pg_engine.connect() as holder, pg_engine.connect() as connection:
        connection.execute(text("SET lock_timeout = '100ms'"))
        connection.commit()
        rival = advisory_lock(holder, name)
        rival.acquire()
        if in_transaction:
            connection.begin()
        lock = advisory_lock(connection, name)
        with pytest.raises(LockTimeout, match="lock_timeout"):
            lock.acquire()
        assert not lock.held
        assert holder_pids(pg_admin, name) == [backend_pid(holder)]
        assert connection.in_transaction() is in_transaction
        assert connection.scalar(text("SHOW lock_timeout")) == "100ms"
        if in_transaction:
            connection.commit()
        rival.release()


# -- (g) an SQL error inside a locked transaction still releases the lock ------------------


def fail_inside_a_locked_transaction(connection: Connection, name: str) -> None:
    with pytest.raises(DBAPIError), connection.begin(), advisory_lock(connection, name):
        connection.execute(text("SELECT 1/0"))


def test_lock_released_in_a_failed_transaction_is_freed_by_that_transactions_rollback(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    # A worker that keeps its connection and goes idle must not keep blocking others.
    name = unique_name()
    with pg_engine.connect() as connection:
        fail_inside_a_locked_transaction(connection, name)
        assert lock_rows(pg_admin, name) == []
        assert not connection.in_transaction()


def test_release_after_the_connection_was_invalidated_raises_lock_lost(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        lock = advisory_lock(connection, name)
        lock.acquire()
        connection.invalidate()
        # The backend ends its session (and the lock) after the client has closed.
        wait_for(lambda: lock_rows(pg_admin, name) == [], "the invalidated backend let go")
        with pytest.raises(LockLost):
            lock.release()


def test_lock_released_in_a_failed_transaction_is_freed_when_the_connection_is_next_used(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        fail_inside_a_locked_transaction(connection, name)
        connection.execute(text("SELECT 1"))
        assert lock_rows(pg_admin, name) == []


def test_lock_released_in_a_failed_transaction_is_freed_when_the_connection_is_closed(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        fail_inside_a_locked_transaction(connection, name)
    assert lock_rows(pg_admin, name) == []


def test_lock_released_in_a_failed_transaction_is_no_longer_listed(pg_engine: Engine) -> None:
    with pg_engine.connect() as connection:
        fail_inside_a_locked_transaction(connection, unique_name())
        assert current_advisory_locks(connection) == []


def test_retaking_a_name_whose_release_was_deferred_leaves_it_free_after_the_block(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    name = unique_name()
    with pg_engine.connect() as connection:
        fail_inside_a_locked_transaction(connection, name)
        with advisory_lock(connection, name):
            pass
        assert lock_rows(pg_admin, name) == []


def test_deferred_release_leaves_other_locks_of_the_connection_held(
    pg_engine: Engine, pg_admin: Admin
) -> None:
    outer, inner = unique_name("outer"), unique_name("inner")
    with pg_engine.connect() as connection:
        with advisory_lock(connection, outer) as outer_lock:
            fail_inside_a_locked_transaction(connection, inner)
            connection.execute(text("SELECT 1"))
            assert lock_rows(pg_admin, inner) == []
            assert len(holder_pids(pg_admin, outer)) == 1
            assert outer_lock.held
        assert lock_rows(pg_admin, outer) == []
