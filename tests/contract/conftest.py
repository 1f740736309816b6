"""The databases and bindings the contract suite runs against.

Every test in tests/contract takes a ``target``: one database reached through one ORM
binding. Databases: PostgreSQL and MariaDB (the servers of tests/databases.py) and
SQLite (a file in the test's temporary directory, or the Django alias's file). Bindings:
SQLAlchemy (a Session per client) and Django (a thread per client, since Django gives
each thread its own connection to an alias); and the raw drivers, a driver connection
per client, not in autocommit, as DB-API makes them: psycopg 3 and psycopg2 on
PostgreSQL, PyMySQL and mysqlclient on MariaDB, sqlite3 on SQLite (made with
``check_same_thread=False``, as a client's waits run in other threads); and on PostgreSQL
an asyncpg pool connection per client, driven from an event loop in a thread of its own
(``async with pool.acquire() as conn``, transaction locks in ``conn.transaction()``).

A raw client's connection is the caller's, made before any lock: for those legs
``statements`` records ``<connect>`` when the first statement reaches the server through
it, so "fails before connecting" reads "fails before any SQL".

A test sees the database only through the target: ``target.client()`` gives a client on
its own connection, ``target.waiting(name)`` says whether the server (or, for SQLite, the
operating system) has queued a waiter for a name, and ``target.hold_in_process(name)``
starts another process that takes the lock and keeps it until it is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session

from advisory_locks import advisory_lock
from advisory_locks._dialects.mysql import server_lock_name
from advisory_locks._dialects.sqlite import lock_file_path
from advisory_locks.keys import derive_key
from tests.contract.raw_clients import raw_connect, raw_connect_arguments
from tests.databases import import_mysqlclient, pymysql_connect
from tests.django_aliases import aim_django_alias
from tests.helpers import lock_rows

DATABASES = ("postgresql", "mariadb", "sqlite")
BINDINGS = ("sqlalchemy", "django")
# Raw driver legs, per database.
RAW_BINDINGS: dict[str, tuple[str, ...]] = {
    "postgresql": ("psycopg", "psycopg2", "asyncpg"),
    "mariadb": ("pymysql", "mysqlclient"),
    "sqlite": ("sqlite3",),
}
RAW_CLIENT_THREAD_PREFIX = "contract-asyncpg-loop"
# The aliases of tests/django_settings.py the Django binding locks on.
DJANGO_ALIASES = {"postgresql": "default", "mariadb": "mysql", "sqlite": "sqlite"}
CLIENT_THREAD_PREFIX = "contract-django-client"
# A call into a client's thread that takes longer has hung (test_contract's own timeout
# is 60 s; this one names the stuck call).
CALL_TIMEOUT_SECONDS = 50

# What each database refuses with UnsupportedFeature (everything else it must honour).
REFUSES: dict[str, frozenset[str]] = {
    "postgresql": frozenset(),
    "mariadb": frozenset({"shared", "transaction"}),
    "sqlite": frozenset({"transaction"}),
}

# Run in a child process: take the lock, say so, and hold it until killed.
HOLDER_SCRIPT = """
import sys
from sqlalchemy import create_engine
from advisory_locks import advisory_lock
engine = create_engine(sys.argv[1])
with engine.connect() as connection, advisory_lock(connection, sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()
"""
RAW_HOLDER_SCRIPT = """
import json
import sys
from advisory_locks import advisory_lock
from tests.contract.raw_clients import raw_connect
connection = raw_connect(sys.argv[1], json.loads(sys.argv[2]), [])
with advisory_lock(connection, sys.argv[3]):
    print("held", flush=True)
    sys.stdin.read()
"""
# The Django holder runs on PyMySQL even where the tests' own process has mysqlclient, so
# the contract covers Django on both MySQL drivers.
DJANGO_HOLDER_SCRIPT = """
import json
import sys
import django
from django.conf import settings
from tests.django_mysql_driver import install_mysql_driver
install_mysql_driver(force_pymysql=True)
settings.configure(
    DATABASES={"default": json.loads(sys.argv[1])}, INSTALLED_APPS=["advisory_locks_django"]
)
django.setup()
from advisory_locks_django import advisory_lock
with advisory_lock(sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()
"""


class Client:
    """One SQLAlchemy Session on its own connection, the way an application holds locks."""

    def __init__(self, engine: Engine) -> None:
        self.session = Session(engine)

    def lock(self, name: object, **options: Any) -> Any:
        return advisory_lock(self.session, name, **options)  # type: ignore[arg-type]

    def commit(self) -> None:
        self.session.commit()

    def rollback(self) -> None:
        self.session.rollback()

    def close(self) -> None:
        self.session.close()


class DjangoClient:
    """A thread of its own, so a connection of its own to ``alias``, the way each request
    or worker thread of a Django application has one; every call runs in that thread."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=CLIENT_THREAD_PREFIX)

    def run(self, function: Callable[..., Any], *args: Any) -> Any:
        return self._thread.submit(function, *args).result(timeout=CALL_TIMEOUT_SECONDS)

    def lock(self, name: object, **options: Any) -> LockInThread:
        from advisory_locks_django import advisory_lock as django_advisory_lock

        lock = self.run(lambda: django_advisory_lock(name, using=self.alias, **options))  # type: ignore[arg-type]
        return LockInThread(self, lock)

    def commit(self) -> None:
        self.run(self._transaction, False)

    def rollback(self) -> None:
        self.run(self._transaction, True)

    def _transaction(self, roll_back: bool) -> None:
        from django.db import connections, transaction

        with transaction.atomic(using=self.alias):
            with connections[self.alias].cursor() as cursor:
                cursor.execute("SELECT 1")
            transaction.set_rollback(roll_back, using=self.alias)

    def close(self) -> None:
        from django.db import connections

        try:
            self.run(connections.close_all)
        finally:
            self._thread.shutdown(wait=True)


class RawClient:
    """A raw driver connection, as DB-API makes it (not in autocommit)."""

    def __init__(self, driver: str, arguments: dict[str, Any], statements: list[str]) -> None:
        self.connection = raw_connect(driver, arguments, statements)

    def lock(self, name: object, **options: Any) -> Any:
        return advisory_lock(self.connection, name, **options)  # type: ignore[call-overload]

    def _transaction(self, roll_back: bool) -> None:
        cursor = self.connection.cursor()
        cursor.execute("SELECT 1")
        cursor.close()
        if roll_back:
            self.connection.rollback()
        else:
            self.connection.commit()

    def commit(self) -> None:
        self._transaction(False)

    def rollback(self) -> None:
        self._transaction(True)

    def close(self) -> None:
        self.connection.close()


class AsyncpgClient:
    """An asyncpg pool connection, held the way a FastAPI handler holds one; every call
    runs as a coroutine on an event loop in a thread of its own."""

    def __init__(self, dsn: str, statements: list[str]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=RAW_CLIENT_THREAD_PREFIX, daemon=True
        )
        self._thread.start()
        self._statements = statements
        self._sent = False
        self.pool, self.connection = self.run(self._open(dsn))

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(
            timeout=CALL_TIMEOUT_SECONDS
        )

    async def _open(self, dsn: str) -> tuple[Any, Any]:
        import asyncpg

        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
        connection = await pool.acquire()
        connection.add_query_logger(self._logged)
        return pool, connection

    def _logged(self, record: Any) -> None:
        if not self._sent:
            self._sent = True
            self._statements.append("<connect>")

    def lock(self, name: object, **options: Any) -> AsyncpgLock:
        return AsyncpgLock(self, advisory_lock(self.connection, name, **options))  # type: ignore[call-overload]

    def _transaction(self, roll_back: bool) -> None:
        async def run() -> None:
            transaction = self.connection.transaction()
            await transaction.start()
            await self.connection.execute("SELECT 1")
            await (transaction.rollback() if roll_back else transaction.commit())

        self.run(run())

    def commit(self) -> None:
        self._transaction(False)

    def rollback(self) -> None:
        self._transaction(True)

    def close(self) -> None:
        async def close() -> None:
            await self.pool.release(self.connection)
            await self.pool.close()

        try:
            self.run(close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


class AsyncpgLock:
    """An asyncpg lock driven from the test's thread; a transaction lock gets the
    ``conn.transaction()`` it needs, committed after the lock's block."""

    def __init__(self, client: AsyncpgClient, lock: Any) -> None:
        self._client = client
        self._lock = lock
        self._transaction: Any = None

    def acquire(self) -> bool:
        return bool(self._client.run(self._acquire()))

    async def _acquire(self) -> bool:
        if self._lock._lock.transaction and not self._client.connection.is_in_transaction():
            self._transaction = self._client.connection.transaction()
            await self._transaction.start()
        try:
            granted = await self._lock.acquire()
        except BaseException:
            await self._end_transaction()
            raise
        if not granted:
            await self._end_transaction()
        return bool(granted)

    async def _end_transaction(self) -> None:
        transaction, self._transaction = self._transaction, None
        if transaction is not None:
            await transaction.commit()

    def release(self) -> None:
        async def release() -> None:
            try:
                await self._lock.release()
            finally:
                await self._end_transaction()

        self._client.run(release())

    def __enter__(self) -> AsyncpgLock:
        if not self.acquire():
            raise self._lock._not_acquired()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


class LockInThread:
    """A Django lock whose every operation runs in its client's thread."""

    def __init__(self, client: DjangoClient, lock: Any) -> None:
        self._client = client
        self._lock = lock

    def acquire(self) -> bool:
        return bool(self._client.run(self._lock.acquire))

    def release(self) -> None:
        self._client.run(self._lock.release)

    def __enter__(self) -> LockInThread:
        self._client.run(self._lock.__enter__)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._client.run(self._lock.__exit__, *exc_info)


@dataclass
class Target:
    database: str
    binding: str
    url: URL
    refuses: frozenset[str]
    waiting: Callable[[str], bool]
    # The Django binding's alias and its settings (the databases the holder connects to).
    django_alias: str | None = None
    django_database: dict[str, Any] | None = None
    engines: list[Engine] = field(default_factory=list)
    statements: list[str] = field(default_factory=list)

    @property
    def raw_driver(self) -> str | None:
        return None if self.binding in BINDINGS else self.binding

    def engine(self) -> Engine:
        engine = create_engine(self.url)
        self.engines.append(engine)

        @event.listens_for(engine, "connect")
        def _connected(dbapi_connection: Any, record: Any) -> None:
            self.statements.append("<connect>")

        return engine

    @contextlib.contextmanager
    def client(self) -> Iterator[Client | DjangoClient | RawClient | AsyncpgClient]:
        client: Client | DjangoClient | RawClient | AsyncpgClient
        if self.django_alias is not None:
            client = DjangoClient(self.django_alias)
        elif self.binding == "asyncpg":
            client = AsyncpgClient(
                raw_connect_arguments("asyncpg", self.url)["dsn"], self.statements
            )
        elif self.raw_driver is not None:
            arguments = raw_connect_arguments(self.raw_driver, self.url)
            client = RawClient(self.raw_driver, arguments, self.statements)
        else:
            client = Client(self.engine())
        try:
            yield client
        finally:
            client.close()

    def is_free(self, name: str) -> bool:
        """Whether a fresh connection can take ``name`` at once (and it gives it back)."""
        with self.client() as other:
            lock = other.lock(name, timeout=0)
            if not lock.acquire():
                return False
            lock.release()
            return True

    def django_connected(self, sender: Any, connection: Any, **kwargs: Any) -> None:
        """connection_created receiver: count the clients' connects, not the test's own."""
        if connection.alias == self.django_alias and threading.current_thread().name.startswith(
            CLIENT_THREAD_PREFIX
        ):
            self.statements.append("<connect>")

    @contextlib.contextmanager
    def hold_in_process(self, name: str) -> Iterator[subprocess.Popen[str]]:
        if self.django_database is not None:
            command = [DJANGO_HOLDER_SCRIPT, json.dumps(self.django_database), name]
        elif self.raw_driver is not None:
            # asyncpg's holder holds through psycopg: the same server lock.
            driver = "psycopg" if self.raw_driver == "asyncpg" else self.raw_driver
            arguments = json.dumps(raw_connect_arguments(driver, self.url))
            command = [RAW_HOLDER_SCRIPT, driver, arguments, name]
        else:
            command = [HOLDER_SCRIPT, self.url.render_as_string(False), name]
        holder = subprocess.Popen(
            [sys.executable, "-c", *command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "held"
            yield holder
        finally:
            holder.kill()
            holder.wait()

    def dispose(self) -> None:
        for engine in self.engines:
            engine.dispose()


def _postgres_waiting(url: URL) -> Callable[[str], bool]:
    from tests.databases import psycopg_connect

    def waiting(name: str) -> bool:
        with psycopg_connect(url, autocommit=True) as admin:
            return any(not row.granted for row in lock_rows(admin, name))

    return waiting


def _mysql_waiting(url: URL) -> Callable[[str], bool]:
    def waiting(name: str) -> bool:
        server_name = server_lock_name(derive_key(name))
        admin = pymysql_connect(url)
        try:
            with admin.cursor() as cursor:
                # PyMySQL sends parameters inlined, so the waiting statement's text holds
                # the server-side name.
                cursor.execute(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                    "WHERE STATE = 'User lock' AND INFO LIKE %s",
                    ("%" + server_name + "%",),
                )
                return bool(cursor.fetchone()[0])
        finally:
            admin.close()

    return waiting


def _sqlite_waiting(database: Path) -> Callable[[str], bool]:
    def waiting(name: str) -> bool:
        # Linux lists blocked flock requests in /proc/locks with "->", by inode.
        inode = os.stat(lock_file_path(database, derive_key(name))).st_ino
        return any(
            "->" in line and line.split()[-3].endswith(f":{inode}")
            for line in Path("/proc/locks").read_text().splitlines()
        )

    return waiting


def _database_url(request: pytest.FixtureRequest, database: str, tmp_path: Path) -> URL:
    if database == "postgresql":
        url: URL = request.getfixturevalue("postgres_url")
    elif database == "mariadb":
        url = request.getfixturevalue("mysql_url")
    else:
        if not sys.platform.startswith("linux"):
            pytest.skip("observing SQLite file-lock waiters needs Linux's /proc/locks")
        url = make_url(f"sqlite:///{tmp_path / 'contract.sqlite'}")
    return url


@pytest.fixture(
    params=[
        *((d, b) for d in DATABASES for b in BINDINGS),
        *((d, b) for d, raw in RAW_BINDINGS.items() for b in raw),
    ],
    ids="-".join,
)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    database, binding = request.param
    if binding == "mysqlclient":
        import_mysqlclient(os.environ)  # skips (or, where CI requires it, fails) without it
    url = _database_url(request, database, tmp_path)
    alias = django_database = None
    with contextlib.ExitStack() as stack:
        if binding == "django":
            from django.db.backends.signals import connection_created

            # pytest-django blocks database access outside its own fixtures; these tests
            # need no test database (see tests/django_aliases.py).
            stack.enter_context(request.getfixturevalue("django_db_blocker").unblock())
            alias = DJANGO_ALIASES[database]
            django_database = aim_django_alias(alias, url, tmp_path / "contract-django.sqlite")
            if database == "sqlite":
                url = make_url(f"sqlite:///{django_database['NAME']}")
            else:
                url = url.set(database=django_database["NAME"])
        if database == "postgresql":
            waiting = _postgres_waiting(url)
        elif database == "mariadb":
            waiting = _mysql_waiting(url)
        else:
            assert url.database is not None
            waiting = _sqlite_waiting(Path(url.database))
        result = Target(database, binding, url, REFUSES[database], waiting, alias, django_database)
        if binding == "django":
            connection_created.connect(result.django_connected)
            stack.callback(connection_created.disconnect, result.django_connected)
        yield result
        result.dispose()
