"""Raw driver connections and pools as binds: what every raw binding shares.

A raw binding (psycopg, asyncpg, psycopg2, and the MySQL and sqlite3 drivers) is a small
``RawDriver`` subclass that says how its connections look: closed or not, their
transaction status, autocommit, how to run a statement, how to discard one. Everything
else is here, written once for blocking and asyncio drivers alike (the preparation of a
borrow is steps, run by ``run_steps`` or awaited by ``arun_steps``):

- ``ConnectionSite``: locks on a connection the caller owns. Its ``RawConnectionState``
  (re-entrancy counts, the server check) is kept per physical driver connection, on the
  connection itself where it has a ``__dict__``, else in a ``WeakKeyDictionary`` (the
  driver's ``find_state`` / ``keep_state``), so it lives as long as that connection.
- ``PoolSite``: a pool bind checks a connection out per lock, like an Engine, in
  autocommit, and returns it when the lock is released (a lock set shares one).

A raw connection has no events, so the state reads the driver on each use (``observe``):
a closed connection, or one its pool took back and reset (asyncpg's pool runs
``pg_advisory_unlock_all()``), has lost its locks; a connection that is idle again has
ended the transaction its transaction locks belonged to.

Transactions, decided here for every raw driver:

- A session lock runs inside the caller's transaction when one is open (session locks
  survive its end). On a non-autocommit connection that is idle, each statement runs
  with the driver switched to autocommit for that statement only (no round trip), so
  the lock never opens a transaction the application does not know about, neither when
  it is taken nor when it is released after the application's transaction ended.
  Drivers whose lock statements begin no transaction (MySQL's ``GET_LOCK``, SQLite's
  file locks) send them as they are instead (``autocommit_for_session_locks``): there,
  switching autocommit on would commit the caller's transaction.
- A transaction lock needs the driver's own transaction: ``conn.transaction()``, or a
  non-autocommit connection, where the lock statement begins the transaction as any
  statement does (DB-API's implicit BEGIN) and the lock lasts until ``commit()`` or
  ``rollback()``. An autocommit connection outside a transaction, an asyncpg connection
  outside ``conn.transaction()`` and a pool bind refuse it (``UnsupportedFeature``).
- Transaction locks are forgotten when the connection is seen idle, but the caller may
  commit and begin the next transaction (or roll a savepoint back) between two calls
  of the library, and the driver cannot tell one transaction from the next. So a
  transaction lock still counted by a lock object when a later transaction lock is
  asked for is checked with the server (``forget_ended_transaction_locks``); one no
  lock object counts on any more is forgotten; and a lock object that takes its own
  transaction lock again sends the lock statement (``sees_transaction_ends`` is False
  here): the server grants a lock its own transaction holds at once, and one whose
  transaction ended is then really acquired, not counted.

Errors that mean the connection is gone become ``ConnectionGone`` (an
``AdvisoryLockError``) at acquire and ``LockLost`` for a held lock, never a raw driver
error. An acquire interrupted by cancellation (``asyncio.wait_for``, KeyboardInterrupt)
closes the connection it waited on: the server may still grant the abandoned wait, and
only closing makes sure nobody inherits that grant. A pool replaces it. (Locks this
process holds itself, SQLite's, leave nothing to grant: the connection stays.)

Poolers: a connection whose server process id (told by the driver at connect) is not the
one its statements run in reaches the server through a pooler or proxy; session locks
are then refused unless the application declared the pooler with ``declare_pooler``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import queue
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Final

from advisory_locks._core.advisory import (
    AdvisoryLock,
    AdvisoryLockSet,
    AsyncAdvisoryLock,
    AsyncAdvisoryLockSet,
)
from advisory_locks._core.connection import (
    POOLER_MODES,
    ConnectionState,
    check_server,
    finish_pending_releases,
    opened_before_fork,
    release_session_locks,
)
from advisory_locks._core.contract import LockOptions, Timeout
from advisory_locks._core.executors import (
    DBAPIExecutor,
    driver_autocommit,
    driver_in_transaction,
    socket_descriptor,
)
from advisory_locks._core.steps import Statement, Steps, arun_steps, on, run_steps
from advisory_locks._dialects import Backend, backend_for_dialect
from advisory_locks.errors import (
    AdvisoryLockError,
    LockConnectionLost,
    LockUsageError,
    UnsupportedFeature,
)
from advisory_locks.keys import LockKey, LockName

__all__ = [
    "FAILED",
    "IDLE",
    "IN_TRANSACTION",
    "AsyncRawDriver",
    "ConnectionGone",
    "RawBinding",
    "RawDriver",
    "declare_pooler",
    "declared_pooler",
    "execute_in_autocommit",
    "holds_at_checkin",
    "locks_named",
    "release_at_checkin",
    "translate_error",
]

# Transaction status, as libpq numbers it (psycopg 3 and psycopg2 report these values).
IDLE: Final = 0
ACTIVE: Final = 1
IN_TRANSACTION: Final = 2
FAILED: Final = 3
UNKNOWN: Final = 4

DECLARE_POOLER: Final = (
    "advisory_locks.declare_pooler(pool_or_connection, 'session') once, where the pool "
    "or connection is made"
)


logger = logging.getLogger("advisory_locks")
_running_loop = asyncio._get_running_loop

# The attribute a connection that has a __dict__ keeps its state in.
STATE_ATTRIBUTE: Final = "_advisory_locks_state"


class ConnectionGone(LockConnectionLost):
    """The driver connection failed or was closed: nothing can be locked on it (an acquire
    reports it as ``LockConnectionLost``, a held lock as ``LockLost``)."""


# -- declared poolers -------------------------------------------------------------------

_declared_weak: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
# The weak mapping's own dict, whose truthiness every lock reads at C speed (the
# mapping's __len__ is Python code); an entry leaves it when its key is collected.
_declared_entries: dict[Any, str] = vars(_declared_weak)["data"]
# Objects that cannot be weakly referenced (asyncpg's Pool): kept with their declaration.
_declared_strong: dict[int, tuple[object, str]] = {}
_declared_mutex = threading.Lock()


def declare_pooler(bind: object, pooler: str) -> None:
    """Say what sits between a raw driver pool or connection and the PostgreSQL server.

    The raw-driver counterpart of SQLAlchemy's ``advisory_locks_pooler`` execution option
    and Django's ``ADVISORY_LOCKS["POOLERS"]``. Session locks through a pooler that was
    not declared are refused, because the library sees that statements run in another
    server session than the one the driver connected to.

    :param bind: a psycopg / psycopg2 / asyncpg connection, or a ``psycopg_pool`` or
        asyncpg pool (connections checked out of a declared pool inherit its declaration).
    :param pooler: ``"session"`` for a pooler that pins each client connection to one
        server connection (PgBouncer ``pool_mode=session``): session locks are safe;
        ``"transaction"`` for a transaction pooler: session locks are refused, take
        ``transaction=True`` locks inside a transaction; ``"none"`` to declare a direct
        connection.
    :raises ValueError: for any other ``pooler``.
    """
    if pooler not in POOLER_MODES:
        raise ValueError(f"pooler must be one of {POOLER_MODES}, not {pooler!r}")
    with _declared_mutex:
        try:
            _declared_weak[bind] = pooler
        except TypeError:
            _declared_strong[id(bind)] = (bind, pooler)


def declared_pooler(*candidates: object) -> str | None:
    """The declaration of the first candidate (connection, then its pool) that has one."""
    if not _declared_entries and not _declared_strong:
        return None
    for candidate in candidates:
        if candidate is None:
            continue
        try:
            found = _declared_weak.get(candidate)
        except TypeError:
            entry = _declared_strong.get(id(candidate))
            found = entry[1] if entry is not None and entry[0] is candidate else None
        if found is not None:
            return found
    return None


# -- drivers ----------------------------------------------------------------------------


class RawDriver:
    """How one blocking DB-API driver's connections look to the raw bindings.

    The defaults fit DB-API drivers; a binding overrides what its driver does otherwise.
    """

    dialect: str = "postgresql"
    # The driver's package, as lock events name the binding.
    name: str = "dbapi"
    # How to open a transaction with this driver, for the refusal of transaction locks.
    open_transaction: str = "open one first (e.g. `with conn.transaction():`)"
    # Whether a session lock's statements on an idle non-autocommit connection run with
    # the driver switched to autocommit for that statement, so that they begin no
    # transaction (PostgreSQL: any statement would). False where the lock statements
    # never begin one and switching could end the caller's transaction (MySQL's SET
    # autocommit=1 commits; sqlite3's isolation_level=None commits).
    autocommit_for_session_locks: bool = True

    @functools.cached_property
    def backend(self) -> Backend:
        """The dialect backend of this driver's locks (looked up once)."""
        return backend_for_dialect(self.dialect)

    def physical(self, bind: Any) -> Any:
        """The driver connection ``bind`` stands for (None: no longer usable by it)."""
        return bind

    def pool_of(self, connection: Any) -> Any:
        """The pool ``connection`` is checked out of, where the driver tells (else None)."""
        return None

    def is_closed(self, connection: Any) -> bool:
        return bool(getattr(connection, "closed", False))

    def status(self, connection: Any) -> int:
        """IDLE, IN_TRANSACTION, FAILED (or ACTIVE/UNKNOWN) as the driver knows it now."""
        in_transaction = driver_in_transaction(connection)
        if in_transaction is None:
            return UNKNOWN
        return IN_TRANSACTION if in_transaction else IDLE

    def autocommit(self, connection: Any) -> bool:
        return driver_autocommit(connection)

    def epoch(self, connection: Any) -> object:
        """A value that changes whenever a pool took the connection back and reset its
        session (unlocking everything); None where no pool does that."""
        return None

    def executor(self, connection: Any, scratch: dict[str, Any]) -> Any:
        return DBAPIExecutor(connection, scratch)

    def lock_executor(self, connection: Any, scratch: dict[str, Any], backend: Backend) -> Any:
        """The executor of lock statements on ``connection``: the driver's own
        (``executor``), raising an error that means the connection is gone as
        ``ConnectionGone``. A driver may return one that does both in a single call."""
        return RaisingExecutor(self.executor(connection, scratch), backend)

    def session_lock_executor(
        self, connection: Any, scratch: dict[str, Any], backend: Backend
    ) -> Any:
        """An executor of session-lock statements that also carries out the rule of
        ``SyncAutocommitExecutor`` itself, in one call per statement; None: that class
        wraps ``lock_executor``'s."""
        return None

    # Whether the executors of ``new_executors`` refer to their connection weakly, so
    # that a state kept in the weak mapping may keep them (see ``keep_state``).
    weak_lock_executors: bool = False

    def set_autocommit(self, connection: Any, value: bool) -> None:
        if callable(getattr(connection, "get_autocommit", None)):
            connection.autocommit(value)
        else:
            connection.autocommit = value

    def discard(self, bind: Any) -> None:
        """Close a connection that must not be used again (its server session ends)."""
        bind.close()

    def refuse(self, connection: Any) -> None:
        """Raise, before a connection's first lock sends anything, where the driver made
        it in a mode no lock can run on (asked once per connection)."""

    def socket_of(self, connection: Any) -> int | None:
        """The file descriptor of the socket ``connection`` talks to its server on (None:
        none, or the driver does not tell), asked once, when its state is made, to tell
        whether a forked child inherited the connection."""
        return socket_descriptor(connection)

    # The state of a connection, kept for exactly as long as the connection lives.
    def new_state(self, backend: Backend) -> RawConnectionState:
        return RawConnectionState(backend=backend)

    def find_state(self, connection: Any) -> RawConnectionState | None:
        """The state kept for ``connection`` (None before its first lock)."""
        namespace = getattr(connection, "__dict__", None)
        if namespace is not None:
            found: RawConnectionState | None = namespace.get(STATE_ATTRIBUTE)
            return found
        return _states.get(connection)

    def keep_state(self, connection: Any, state: RawConnectionState) -> None:
        """Keep ``state`` for as long as ``connection`` lives (called once, under a
        mutex); a driver whose connections can be neither given an attribute nor weakly
        referenced (sqlite3) overrides this and ``find_state``."""
        state.connection = weakref.ref(connection)
        namespace = getattr(connection, "__dict__", None)
        if namespace is not None:
            # On the connection itself (psycopg 3, PyMySQL, mysqlclient): the state's
            # executors refer to the connection, a cycle the garbage collector frees with
            # it, so a connection dropped without close() still closes.
            namespace[STATE_ATTRIBUTE] = state
        else:
            # In the weak mapping (psycopg2 and asyncpg connections have no __dict__),
            # where a value that refers to its key keeps it alive: the state must not
            # keep executors that refer to the connection.
            state.keeps_executors = self.weak_lock_executors
            _states[connection] = state

    # A pool bind's connections (for drivers that have pools).
    def checkout(self, pool: Any) -> Any:  # pragma: no cover - drivers with pools override
        raise TypeError(f"{type(pool).__name__} is not a pool")

    def pool_refusal(
        self, pool: Any, error: Exception, names: tuple[LockName, ...], *, lease: bool = False
    ) -> Exception | None:
        """The library's error for ``error``, raised by ``checkout`` (``acheckout``) of
        ``pool`` for the locks ``names`` (with ``lease``, for one statement of a lease
        lock, whose name the lease's rules fill in), where it means the pool lent
        nothing: no connection came free in the pool's time limit, or the pool is
        closed. It is also the pool's own exception class, so the application's handlers
        for that keep working. None lets ``error`` through as it is (opening a
        connection failed, say).
        """
        return None

    def checkin(self, pool: Any, bind: Any) -> None:  # pragma: no cover - as above
        raise TypeError(f"{type(pool).__name__} is not a pool")

    def abandon(self, pool: Any, bind: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        """Give back, from the garbage collector, the connection of a borrow collected
        while it still held locks (its lock object dropped unreleased): closed, so that
        its server session ends and its locks with it, then returned to ``pool``, which
        replaces it. Called without awaiting; ``loop`` is the event loop the borrow was
        made in (None outside one)."""
        try:
            self.discard(bind)
        finally:
            self.checkin(pool, bind)

    def guard_checkin(self, connection: Any) -> None:
        """Called once per connection, at its first lock: where ``connection`` belongs to
        a pool that does not end its session locks when it takes it back (psycopg_pool),
        make that pool run ``release_at_checkin`` on every connection it takes back.
        Nothing to do for drivers without pools, or whose pool unlocks everything itself
        (asyncpg's: ``epoch`` tells)."""


class AsyncRawDriver(RawDriver):
    """An asyncio driver: statements, autocommit switches, closes and pools are awaited."""

    # Whether every statement outside the driver's own transaction runs in autocommit
    # (asyncpg has no other mode): session locks then need no autocommit switch.
    always_autocommit: bool = False

    def lock_executor(self, connection: Any, scratch: dict[str, Any], backend: Backend) -> Any:
        return AsyncRaisingExecutor(self.executor(connection, scratch), backend)

    async def aset_autocommit(self, connection: Any, value: bool) -> None:
        raise NotImplementedError

    async def adiscard(self, bind: Any) -> None:
        raise NotImplementedError

    async def acheckout(self, pool: Any) -> Any:  # pragma: no cover - pools override
        raise TypeError(f"{type(pool).__name__} is not a pool")

    async def acheckin(self, pool: Any, bind: Any) -> None:  # pragma: no cover - as above
        raise TypeError(f"{type(pool).__name__} is not a pool")


# -- per-connection state -----------------------------------------------------------------


class RawConnectionState(ConnectionState):
    """What this library holds on one physical driver connection, read against the driver
    each time it is used (raw connections have no events)."""

    observes: ClassVar[bool] = True
    sees_transaction_ends: ClassVar[bool] = False
    driver: RawDriver
    connection: weakref.ReferenceType[Any]
    epoch: object
    _executors: tuple[Any, Any] | None = None
    # False where the state must not refer to its connection (see ``keep_state``): the
    # executors are then made for each borrow, and live as long as it does.
    keeps_executors: bool = True
    # Whether the connection was found inherited by its socket (see ``state_for``).
    inherited_socket: bool = False

    def executors(self, connection: Any) -> tuple[Any, Any]:
        """The executors of session locks (switching a non-autocommit connection to
        autocommit while it is idle, where the driver needs that) and of transaction
        locks (in the driver's transaction), made once per connection."""
        executors = self._executors
        if executors is None:
            executors = new_executors(self.driver, connection, self)
            if self.keeps_executors:
                self._executors = executors
        return executors

    def observe(self) -> None:
        if not self.holdings and not self.pending_release:
            return
        connection = self.connection()
        driver = self.driver
        if connection is None or driver.is_closed(connection):
            self.connection_gone()
            return
        epoch = driver.epoch(connection)
        if epoch != self.epoch:
            # Its pool took the connection back and reset the session meanwhile.
            self.epoch = epoch
            self.connection_gone()
            return
        if driver.status(connection) == IDLE:
            # A copy: current_advisory_locks(pool), from another thread, observes the
            # states of connections whose own threads file and forget holdings meanwhile.
            for holding in list(self.holdings.values()):
                if holding.transaction:
                    # Committed or rolled back: the driver cannot tell which.
                    self.transaction_ended("transaction_ended")
                    return


_states: weakref.WeakKeyDictionary[Any, RawConnectionState] = weakref.WeakKeyDictionary()
_states_mutex = threading.Lock()


def state_for(driver: RawDriver, connection: Any, backend: Backend) -> RawConnectionState:
    """The state of ``connection``, made on first use and brought up to date."""
    state = driver.find_state(connection)
    if state is None or state.inherited_socket:
        with _states_mutex:
            state = driver.find_state(connection)
            if state is None or (
                # Reconnected since (PyMySQL's connect()): a session of this process's.
                state.inherited_socket and not opened_before_fork(connection, driver.socket_of)
            ):
                driver.refuse(connection)
                state = driver.new_state(backend)
                opener = opened_before_fork(connection, driver.socket_of)
                if opener:
                    # Opened before this process was forked, and first seen here: the
                    # server session is the parent's, and so is any lock taken on it.
                    state.pid = opener
                    state.inherited = state.inherited_socket = True
                state.driver = driver
                state.epoch = driver.epoch(connection)
                driver.keep_state(connection, state)
                driver.guard_checkin(connection)
                return state
    state.observe()
    # With nothing held, observe() did not look; a reset session has nothing to forget.
    state.epoch = driver.epoch(connection)
    return state


def holds_at_checkin(driver: RawDriver, connection: Any) -> bool:
    """Whether ``release_at_checkin`` may have anything to do for ``connection``: a pool
    guard asks this on every check-in, and the answer is nearly always no."""
    state = driver.find_state(connection)
    return state is not None and bool(state.holdings or state.pending_release)


def release_at_checkin(driver: RawDriver, connection: Any) -> Steps[None]:
    """Run when a pool takes ``connection`` back, after it rolled back the connection's
    transaction: unlock every session lock this library still records on it, so that the
    connection's next borrower cannot be granted them as its own (the server counts a
    lock its session holds as re-entrant). Their lock objects then report ``LockLost``.

    A lock left held there was never released: its object was dropped, or the connection
    was handed back inside the ``with`` block. If an unlock fails, the error reaches the
    pool, which closes the connection instead of reusing it (ending its session ends its
    locks).
    """
    state = driver.find_state(connection)
    if state is None or state.inherited:
        # A forked child's copy of the parent's connection: the locks are the parent's.
        return
    state.observe()
    if not state.session_holdings():
        return
    holdings = yield from release_session_locks(state, state.executors(connection)[0])
    logger.warning(
        "a connection (%s) went back to its pool holding advisory lock(s) %s that were "
        "never released; they were unlocked, and their lock objects report LockLost",
        driver.name,
        ", ".join(repr(holding.key.name) for holding in holdings),
    )


def new_executors(driver: RawDriver, connection: Any, state: RawConnectionState) -> tuple[Any, Any]:
    """(session-lock executor, transaction-lock executor) for ``connection``."""
    backend = state.backend
    assert backend is not None
    transaction = driver.lock_executor(connection, state.driver_state, backend)
    if isinstance(driver, AsyncRawDriver):
        if driver.always_autocommit:
            return transaction, transaction
        return AutocommitExecutor(driver, connection, transaction), transaction
    if not driver.autocommit_for_session_locks:
        return transaction, transaction
    session = driver.session_lock_executor(connection, state.driver_state, backend)
    if session is None:
        session = SyncAutocommitExecutor(driver, connection, transaction)
    return session, transaction


# -- executors ------------------------------------------------------------------------------


class RaisingExecutor:
    """Runs statements on the driver's executor; an error that means the connection is gone
    becomes ``ConnectionGone`` (the lock turns it into ``LockLost`` for a held lock)."""

    __slots__ = ("_backend", "_execute", "executor")

    def __init__(self, executor: Any, backend: Backend) -> None:
        self.executor = executor
        self._execute = executor.execute
        self._backend = backend

    @property
    def state(self) -> dict[str, Any]:
        scratch: dict[str, Any] = self.executor.state
        return scratch

    def execute(self, statement: Statement) -> Any:
        try:
            return self._execute(statement)
        except Exception as error:
            raise translate_error(error, self._backend) from error


class AsyncRaisingExecutor(RaisingExecutor):
    __slots__ = ()

    async def execute(self, statement: Statement) -> Any:
        try:
            return await self._execute(statement)
        except Exception as error:
            raise translate_error(error, self._backend) from error


def translate_error(error: Exception, backend: Backend) -> Exception:
    """``ConnectionGone`` for an error that means the connection is gone, else ``error``."""
    if isinstance(error, AdvisoryLockError) or not backend.is_connection_failure(error):
        return error
    return ConnectionGone(f"the database connection is gone: {error}")


class SyncAutocommitExecutor:
    """Runs a statement with a non-autocommit connection switched to autocommit while no
    transaction is open, so that it opens none; inside a transaction, in it."""

    __slots__ = ("_autocommit", "_connection", "_driver", "_inner", "_status")

    def __init__(self, driver: RawDriver, connection: Any, inner: Any) -> None:
        self._driver = driver
        self._connection = connection
        self._inner = inner
        # Read before every statement: bound once.
        self._autocommit = driver.autocommit
        self._status = driver.status

    @property
    def state(self) -> dict[str, Any]:
        scratch: dict[str, Any] = self._inner.state
        return scratch

    def execute(self, statement: Statement) -> Any:
        connection = self._connection
        if self._autocommit(connection) or self._status(connection) != IDLE:
            return self._inner.execute(statement)
        return execute_in_autocommit(self._driver, connection, self._inner.execute, statement)


def execute_in_autocommit(
    driver: RawDriver, connection: Any, execute: Callable[[Statement], Any], statement: Statement
) -> Any:
    """``execute(statement)`` with the connection switched to autocommit for it alone."""
    driver.set_autocommit(connection, True)
    try:
        result = execute(statement)
    except BaseException:
        # A connection that broke cannot be switched back, and the statement's own
        # error is the one to report.
        with contextlib.suppress(Exception):
            driver.set_autocommit(connection, False)
        raise
    driver.set_autocommit(connection, False)
    return result


class AutocommitExecutor(SyncAutocommitExecutor):
    """The asyncio twin of ``SyncAutocommitExecutor``."""

    __slots__ = ()

    async def execute(self, statement: Statement) -> Any:
        connection = self._connection
        if self._autocommit(connection) or self._status(connection) != IDLE:
            return await self._inner.execute(statement)
        driver = self._driver
        assert isinstance(driver, AsyncRawDriver)
        await driver.aset_autocommit(connection, True)
        try:
            result = await self._inner.execute(statement)
        except BaseException:
            with contextlib.suppress(Exception):
                await driver.aset_autocommit(connection, False)
            raise
        await driver.aset_autocommit(connection, False)
        return result


# -- a caller's connection ---------------------------------------------------------------------


class ConnectionBorrow:
    """A caller's connection lent to a lock: never closed by it unless broken."""

    __slots__ = ("_broken", "connection", "epoch", "executor", "in_transaction", "site", "state")

    def __init__(
        self,
        site: ConnectionSite,
        connection: Any,
        executor: Any,
        state: RawConnectionState,
        in_transaction: bool,
    ) -> None:
        self.site = site
        self.connection = connection
        self.executor = executor
        self.state = state
        self.in_transaction = in_transaction
        self.epoch = state.epoch
        self._broken = False

    # settle() has work only after broken(), which the lock always follows with it.
    settled_by_done = True

    def done(self) -> None:
        pass

    def broken(self, error: BaseException) -> None:
        if not isinstance(error, Exception) and not self.site.backend.locks_on_server:
            # An interrupted wait for a lock this process holds itself (SQLite's file
            # locks) leaves nothing behind that could be granted later: the backend
            # closed its file. The caller's connection and its other locks stay.
            return
        self._broken = True

    def _still_ours(self) -> bool:
        driver = self.site.driver
        connection = driver.physical(self.site.bind)
        return (
            connection is self.connection
            and driver.epoch(connection) == self.epoch
            and not driver.is_closed(connection)
        )

    def settle(self) -> None:
        if self._broken:
            self._broken = False
            if self._still_ours():
                self.site.driver.discard(self.site.bind)
            self.state.connection_gone()

    async def asettle(self) -> None:
        if self._broken:
            self._broken = False
            driver = self.site.driver
            if self._still_ours():
                assert isinstance(driver, AsyncRawDriver)
                await driver.adiscard(self.site.bind)
            self.state.connection_gone()


class ConnectionSite:
    """Locks on a raw driver connection the caller owns."""

    __slots__ = ("backend", "bind", "driver")

    def __init__(self, driver: RawDriver, bind: Any) -> None:
        self.driver = driver
        self.bind = bind
        self.backend = driver.backend

    @property
    def binding(self) -> str:
        """The driver, as lock events name the binding."""
        return self.driver.name

    def borrow(self, *, transaction: bool) -> ConnectionBorrow:
        borrow = None if transaction else self._ready()
        return borrow if borrow is not None else run_steps(self.prepare(transaction))

    async def aborrow(self, *, transaction: bool) -> ConnectionBorrow:
        borrow = None if transaction else self._ready()
        return borrow if borrow is not None else await arun_steps(self.prepare(transaction))

    def _ready(self) -> ConnectionBorrow | None:
        """The usual session-lock borrow, which needs no statement: the server was checked
        on this connection before (no pooler in between), no pooler is declared anywhere
        and no unlock waits. None sends the borrow down the full path (``prepare``)."""
        if _declared_entries or _declared_strong:
            return None
        driver = self.driver
        connection = driver.physical(self.bind)
        state = None if connection is None else driver.find_state(connection)
        if state is None or state.behind_proxy is not False or driver.is_closed(connection):
            return None
        if state.holdings:
            state.observe()
        state.epoch = driver.epoch(connection)
        status = driver.status(connection)
        if state.pending_release or status == FAILED:
            return None
        executors = state._executors or state.executors(connection)
        return ConnectionBorrow(self, connection, executors[0], state, status != IDLE)

    def run(self, steps: Steps[Any]) -> Awaitable[Any]:
        return arun_steps(steps, self)

    def held_names(self) -> list[LockName]:
        connection = self.driver.physical(self.bind)
        state = None if connection is None else self.driver.find_state(connection)
        if state is None:
            return []
        state.observe()
        return state.names()

    def prepare(self, transaction: bool) -> Steps[ConnectionBorrow]:
        driver, backend = self.driver, self.backend
        connection = driver.physical(self.bind)
        if connection is None:
            raise ConnectionGone(
                "this connection was released back to its pool; take locks on a connection "
                "while it is checked out"
            )
        if driver.is_closed(connection):
            raise ConnectionGone("the database connection is closed")
        state = state_for(driver, connection, backend)
        status = driver.status(connection)
        if status == FAILED:
            raise LockUsageError(
                "the connection's transaction failed; roll it back before taking a lock"
            )
        in_transaction = status != IDLE
        session_executor, transaction_executor = state.executors(connection)
        if transaction:
            if not in_transaction and driver.autocommit(connection):
                raise UnsupportedFeature(
                    "transaction=True needs a transaction, and this connection has none "
                    f"open: {driver.open_transaction}, or take a session lock instead"
                )
            executor = transaction_executor
            if in_transaction:
                yield from forget_ended_transaction_locks(state, executor)
            # On an idle non-autocommit connection the lock statement begins the driver's
            # transaction, which the lock must then protect like the caller's own.
            in_transaction = True
        else:
            executor = session_executor
        yield from check_server(
            state,
            executor,
            connection,
            pooler=declared_pooler(self.bind, connection, driver.pool_of(self.bind)),
            session_lock=not transaction,
            declare_pooler=DECLARE_POOLER,
            transaction_pooler_declared="it was declared behind a transaction pooler",
        )
        if state.pending_release and status == IDLE:
            # A failed transaction postponed these unlocks and has ended since.
            yield from finish_pending_releases(state, session_executor)
        return ConnectionBorrow(self, connection, executor, state, in_transaction)


def forget_ended_transaction_locks(state: RawConnectionState, executor: Any) -> Steps[None]:
    """Before a transaction lock is looked up: drop the transaction locks that may belong
    to an earlier transaction (the driver cannot tell transactions apart).

    One that no lock object counts on is forgotten (taking it again costs one round trip,
    harmless in the same transaction). One still counted is asked of the server: gone
    means its transaction (or savepoint) ended. pg_locks cannot tell it from a session
    lock of the same key and mode on this connection; then it is kept, and that session
    lock protects the block meanwhile.
    """
    backend = state.backend
    assert backend is not None
    for holding in [h for h in state.holdings.values() if h.transaction]:
        if holding.count <= 0:
            state.end(holding, "transaction_ended")
            continue
        held = yield from on(
            executor, backend.is_held(state.driver_state, holding.key, shared=holding.shared)
        )
        if not held:
            state.end(holding, "transaction_ended")


# -- a pool bind ---------------------------------------------------------------------------


class PooledBorrow:
    """A connection checked out of a pool for locks only, in autocommit, returned when its
    last lock is released; discarded (closed, then returned) when it broke."""

    __slots__ = (
        "__weakref__",
        "_action",
        "bind",
        "connection",
        "executor",
        "in_transaction",
        "previous_autocommit",
        "site",
        "state",
    )

    in_transaction: bool
    settled_by_done = False  # settle() returns or discards the connection

    def __init__(self, site: PoolSite, bind: Any) -> None:
        self.site = site
        self.bind = bind
        self.connection = site.driver.physical(bind)
        self.state = state_for(site.driver, self.connection, site.backend)
        self.executor = self.state.executors(self.connection)[1]
        self.in_transaction = False
        self.previous_autocommit: bool | None = None
        self._action: str | None = None

    @property
    def returned(self) -> bool:
        return self._action == "returned"

    def done(self) -> None:
        if self._action is None and not self.state.holdings and not self.state.pending_release:
            self._action = "return"

    def broken(self, error: BaseException) -> None:
        if self._action != "returned":
            self._action = "discard"

    def settle(self) -> None:
        action, driver, pool = self._action, self.site.driver, self.site.pool
        if action == "return":
            self._action = "returned"
            self.site.forget(self)
            try:
                if self.previous_autocommit is not None:
                    driver.set_autocommit(self.connection, self.previous_autocommit)
            except Exception:
                driver.discard(self.bind)
            driver.checkin(pool, self.bind)
        elif action == "discard":
            self._action = "returned"
            self.site.forget(self)
            self.state.connection_gone()
            try:
                driver.discard(self.bind)
            finally:
                driver.checkin(pool, self.bind)

    async def asettle(self) -> None:
        action, driver, pool = self._action, self.site.driver, self.site.pool
        assert isinstance(driver, AsyncRawDriver)
        if action == "return":
            self._action = "returned"
            self.site.forget(self)
            try:
                if self.previous_autocommit is not None:
                    await driver.aset_autocommit(self.connection, self.previous_autocommit)
            except Exception:
                await driver.adiscard(self.bind)
            await driver.acheckin(pool, self.bind)
        elif action == "discard":
            self._action = "returned"
            self.site.forget(self)
            self.state.connection_gone()
            try:
                await driver.adiscard(self.bind)
            finally:
                await driver.acheckin(pool, self.bind)


# The borrows alive on every pool, for current_advisory_locks(pool): id(borrow) -> a weak
# reference to it. One flat dict, not one per pool, because asyncpg's Pool cannot be weakly
# referenced (a per-pool entry keyed by the pool's id would outlive its pool) and because a
# WeakSet per pool, built and dropped around every lock on an otherwise idle pool, cost
# about 126 bytecodes per lock. Storing and popping a key are single dict operations,
# atomic without a mutex.
# A borrow that is settled pops its entry (its reference then calls back only where
# something else still holds it, and finds it gone); one dropped unsettled, its lock
# object collected while it held the lock, has its reference call back, which pops it and
# gives its connection back to the pool (RawDriver.abandon), as SQLAlchemy's pool takes
# back a connection whose checkout was collected: else the pool would count the
# connection out for good and, asyncpg's, keep its locks.
class _BorrowReference(weakref.ref["PooledBorrow"]):
    """The registry's reference to a borrow, with what gives its connection back."""

    __slots__ = ("bind", "key", "loop", "site", "state")

    bind: Any
    key: int
    loop: asyncio.AbstractEventLoop | None
    site: PoolSite
    state: RawConnectionState


_pool_borrows: dict[int, _BorrowReference] = {}


def _drop_dead_borrow(dead: _BorrowReference) -> None:
    # Its id is still its own while this runs (the memory is freed after), so no live
    # borrow shares the key.
    if _pool_borrows.get(dead.key) is not dead:
        # Settled (forget() popped it) while something else still held this reference,
        # as held_names() does while it reads them: its connection went back already,
        # and may be another caller's now.
        return
    _pool_borrows.pop(dead.key, None)
    site = dead.site
    if isinstance(site.driver, AsyncRawDriver):
        # Only schedules the give-back in the borrow's event loop.
        _abandon(site.driver, site.pool, dead.bind, dead.loop, dead.state)
    else:
        # A collector's callback may run inside any allocation, one made while this
        # thread holds the pool's own (non-reentrant) lock included, where putconn()
        # would wait for itself: a thread of the library's gives the connection back.
        # SimpleQueue.put() is safe in such a callback.
        _abandoned.put(
            functools.partial(_abandon, site.driver, site.pool, dead.bind, None, dead.state)
        )


def _abandon(
    driver: RawDriver,
    pool: Any,
    bind: Any,
    loop: asyncio.AbstractEventLoop | None,
    state: RawConnectionState,
) -> None:
    if state.inherited:
        # A forked child's copy of a parent's borrow (its lock object let go of it, or
        # was dropped): the connection and its locks are the parent's, never touched.
        return
    try:
        driver.abandon(pool, bind, loop)
    except Exception as error:  # never raised into the collector's caller
        logger.warning("a dropped lock's pool connection could not be given back: %s", error)


# Blocking pools' connections of dropped borrows, given back in order by one daemon thread
# that calls what is queued, started at a process's first borrow from a blocking pool (a
# forked child starts its own, with a queue of its own).
_abandoned: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_abandoner_started = False
_abandoner_mutex = threading.Lock()


def _give_back_abandoned() -> None:
    while True:
        give_back = _abandoned.get()
        give_back()
        del give_back  # kept no longer than the give-back


def _start_abandoner() -> None:
    global _abandoner_started
    with _abandoner_mutex:
        if _abandoner_started:
            return
        try:
            threading.Thread(
                target=_give_back_abandoned, name="advisory-locks-give-back", daemon=True
            ).start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown"
            return  # a dropped lock's connection then closes with the process
        _abandoner_started = True


def _abandoner_gone() -> None:
    # In a forked child: the parent's thread did not come along, nor what it had still
    # to do (the parent's), nor its mutex's state.
    global _abandoned, _abandoner_started, _abandoner_mutex
    _abandoned = queue.SimpleQueue()
    _abandoner_started = False
    _abandoner_mutex = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_abandoner_gone)


def locks_named(names: tuple[LockName, ...]) -> str:
    """How an error names the lock, or the locks of a lock set, it is about."""
    if len(names) == 1:
        return f"advisory lock {names[0]!r}"
    return f"advisory locks {list(names)!r}" if names else "an advisory lock"


class PoolSite:
    """Each lock checks out its own connection of the pool."""

    __slots__ = ("backend", "driver", "keys", "pool")

    def __init__(self, driver: RawDriver, pool: Any, keys: tuple[LockKey, ...]) -> None:
        self.driver = driver
        self.pool = pool
        self.backend = driver.backend
        # The keys of the lock (or lock set) it serves, for the errors that name them.
        self.keys = keys

    @property
    def binding(self) -> str:
        """The driver, as lock events name the binding."""
        return self.driver.name

    def borrow(self, *, transaction: bool) -> PooledBorrow:
        if not _abandoner_started:
            _start_abandoner()  # for a blocking pool's dropped borrows (_drop_dead_borrow)
        driver = self.driver
        try:
            bind = driver.checkout(self.pool)
        except Exception as error:
            self._refuse(error)
            raise
        borrow = PooledBorrow(self, bind)
        try:
            if not driver.autocommit(borrow.connection):
                # Autocommit keeps each acquire and release to one statement and means
                # nothing the lock does can be rolled back underneath it.
                driver.set_autocommit(borrow.connection, True)
                borrow.previous_autocommit = False
            if self._checked(borrow):
                self._register(borrow)
            else:
                run_steps(self.prepare(borrow))
        except BaseException as error:
            borrow.broken(error)
            borrow.settle()
            raise
        return borrow

    async def aborrow(self, *, transaction: bool) -> PooledBorrow:
        driver = self.driver
        assert isinstance(driver, AsyncRawDriver)
        try:
            bind = await driver.acheckout(self.pool)
        except Exception as error:
            self._refuse(error)
            raise
        borrow = PooledBorrow(self, bind)
        try:
            if not driver.autocommit(borrow.connection):
                await driver.aset_autocommit(borrow.connection, True)
                borrow.previous_autocommit = False
            if self._checked(borrow):
                self._register(borrow)
            else:
                await arun_steps(self.prepare(borrow))
        except BaseException as error:
            borrow.broken(error)
            await borrow.asettle()
            raise
        return borrow

    def _refuse(self, error: Exception) -> None:
        """Raise the library's error for a checkout the pool refused (``pool_refusal``),
        from the pool's; return for any other error, which the caller re-raises as it
        is. Nothing was taken from the pool, so nothing goes back."""
        refusal = self.driver.pool_refusal(self.pool, error, tuple(key.name for key in self.keys))
        if refusal is not None:
            raise refusal from error

    def run(self, steps: Steps[Any]) -> Awaitable[Any]:
        return arun_steps(steps, self)

    def prepare(self, borrow: PooledBorrow) -> Steps[None]:
        connection, state = borrow.connection, borrow.state
        yield from check_server(
            state,
            borrow.executor,
            connection,
            pooler=declared_pooler(self.pool, connection),
            session_lock=True,
            declare_pooler=DECLARE_POOLER,
            transaction_pooler_declared="the pool was declared behind a transaction pooler",
        )
        if state.pending_release:
            yield from finish_pending_releases(state, borrow.executor)
        self._register(borrow)

    def _checked(self, borrow: PooledBorrow) -> bool:
        """Whether ``prepare`` would send nothing and refuse nothing: the server was checked
        on this connection (no pooler in between), no pooler is declared anywhere and no
        unlock waits. Every borrow of a connection after its first is this case."""
        state = borrow.state
        return (
            state.behind_proxy is False
            and not state.pending_release
            and not _declared_entries
            and not _declared_strong
        )

    def _register(self, borrow: PooledBorrow) -> None:
        reference = _BorrowReference(borrow, _drop_dead_borrow)
        reference.key = key = id(borrow)
        reference.site = self
        reference.bind = borrow.bind
        reference.state = borrow.state
        reference.loop = _running_loop()
        _pool_borrows[key] = reference

    def forget(self, borrow: PooledBorrow) -> None:
        _pool_borrows.pop(id(borrow), None)

    def held_names(self) -> list[LockName]:
        names: list[LockName] = []
        for ref in _pool_borrows.copy().values():
            borrow = ref()
            if borrow is not None and borrow.site.pool is self.pool:
                borrow.state.observe()
                names += borrow.state.names()
        return names


class SharedPoolSite(PoolSite):
    """The locks of one lock set on a pool share one checked-out connection."""

    __slots__ = ("_borrow",)

    def __init__(self, driver: RawDriver, pool: Any, keys: tuple[LockKey, ...]) -> None:
        super().__init__(driver, pool, keys)
        self._borrow: PooledBorrow | None = None

    def borrow(self, *, transaction: bool) -> PooledBorrow:
        if self._borrow is None or self._borrow._action is not None:
            self._borrow = super().borrow(transaction=transaction)
        return self._borrow

    async def aborrow(self, *, transaction: bool) -> PooledBorrow:
        if self._borrow is None or self._borrow._action is not None:
            self._borrow = await super().aborrow(transaction=transaction)
        return self._borrow


# -- the binding ----------------------------------------------------------------------------


class RawBinding:
    """The core dispatch's binding for one driver's connections and pools."""

    def __init__(
        self,
        driver: RawDriver,
        *,
        is_pool: Callable[[object], bool] = lambda bind: False,
        lease: Any = None,
    ) -> None:
        self.driver = driver
        self.is_async = isinstance(driver, AsyncRawDriver)
        self._is_pool = is_pool
        # The binding's lease driver (raw_lease.LeaseDriver / AsyncLeaseDriver), or None.
        self._lease = lease

    def lease_site(self, bind: Any, *, connect: Any = None) -> Any:
        """Where ``lease_lock(bind, ...)`` runs its statements (``raw_lease``)."""
        if self._lease is None:
            raise UnsupportedFeature(
                f"lease locks are not available for {self.driver.name} binds; pass a "
                "SQLAlchemy Engine or another driver's pool"
            )
        from advisory_locks._bindings import raw_lease

        if not self._is_pool(bind):
            self.driver.refuse(bind)
        if self.is_async:
            return raw_lease.async_lease_site(self._lease, bind, connect)
        return raw_lease.lease_site(self._lease, bind, connect)

    def _site(
        self, bind: Any, keys: tuple[LockKey, ...], *, transaction: bool, lock_set: bool = False
    ) -> Any:
        if self._is_pool(bind):
            if transaction:
                raise UnsupportedFeature(
                    "transaction=True needs a transaction, and a pool has none: check a "
                    "connection out, open a transaction on it and pass the connection, or "
                    "take a session lock on the pool"
                )
            return (SharedPoolSite if lock_set else PoolSite)(self.driver, bind, keys)
        return ConnectionSite(self.driver, bind)

    def lock(self, bind: Any, key: LockKey, options: LockOptions) -> Any:
        site = self._site(bind, (key,), transaction=options.transaction)
        lock = AdvisoryLock(site, key, options)
        return AsyncAdvisoryLock(lock, site.run) if self.is_async else lock

    def lock_set(
        self, bind: Any, keys: list[LockKey], options: LockOptions, timeout: Timeout
    ) -> Any:
        site = self._site(bind, tuple(keys), transaction=options.transaction, lock_set=True)
        lock_set = AdvisoryLockSet(
            site, (AdvisoryLock(site, key, options) for key in keys), timeout=timeout
        )
        return AsyncAdvisoryLockSet(lock_set, site.run) if self.is_async else lock_set

    def held_names(self, bind: Any) -> list[LockName]:
        names: list[LockName] = self._site(bind, (), transaction=False).held_names()
        return names
