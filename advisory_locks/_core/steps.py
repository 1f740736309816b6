"""Lock logic as steps: written once, run by a synchronous or an asynchronous driver.

Dialect backends and the lock object never call a database themselves. They are
generators that *yield* what they need done -- a statement on a connection, a connection
borrowed from a binding, a borrowed connection settled -- and receive the result (or
have the driver's exception thrown back in at the yield). ``run_steps`` performs the
requests with blocking calls; ``arun_steps`` awaits them. So psycopg and asyncpg, sync
and async, run one implementation of every rule, and neither needs greenlet.
"""

from __future__ import annotations

from collections.abc import Awaitable, Generator, Sequence
from typing import Any, Final, Generic, Protocol, TypeAlias, TypeVar, cast

__all__ = [
    "ROWS",
    "SCRIPT",
    "VALUE",
    "AsyncExecutor",
    "AsyncSite",
    "Borrow",
    "BorrowAnew",
    "Executor",
    "On",
    "Settle",
    "Site",
    "Statement",
    "Steps",
    "aperform",
    "arun_steps",
    "on",
    "perform",
    "run_steps",
]

T = TypeVar("T")

VALUE: Final = 0
"""Run one statement with ``%s`` placeholders; the first column of the first row."""
SCRIPT: Final = 1
"""Run several ``;``-separated statements without parameters in one round trip."""
ROWS: Final = 2
"""Run one statement (with ``%s`` placeholders if it has parameters); all rows as tuples
(none for a statement that returns no result)."""


class Statement:
    """One database request a step needs answered. Its parameters are not changed once
    it is made: a dialect keeps statements for reuse, and an executor may keep what it
    derives from them (``encoded``)."""

    __slots__ = ("encoded", "kind", "params", "sql")

    def __init__(self, kind: int, sql: str, params: Sequence[object] = ()) -> None:
        self.kind = kind
        self.sql = sql
        self.params = params
        # The libpq path's encoding of the parameters, made at its first use (libpq).
        self.encoded: Any = None

    def __repr__(self) -> str:
        return f"Statement({self.kind}, {self.sql!r}, {self.params!r})"


class Executor(Protocol):
    """Runs statements on one driver connection, blocking."""

    @property
    def state(self) -> dict[str, Any]:
        """Scratch space that lives exactly as long as the driver connection."""

    def execute(self, statement: Statement) -> object:
        """Run ``statement`` and return what its kind asks for."""


class AsyncExecutor(Protocol):
    """Runs statements on one driver connection, awaiting."""

    @property
    def state(self) -> dict[str, Any]:
        """Scratch space that lives exactly as long as the driver connection."""

    def execute(self, statement: Statement) -> Awaitable[object]:
        """Run ``statement`` and return what its kind asks for."""


class Borrow:
    """Ask the binding's site for the connection a lock of this scope runs on."""

    __slots__ = ("transaction",)

    def __init__(self, transaction: bool) -> None:
        self.transaction = transaction


class BorrowAnew:
    """Ask a lease site for a connection opened anew rather than one its pool kept idle:
    a statement found a pooled connection dead, and the pool's others may be too."""

    __slots__ = ()


class Settle:
    """Give a borrowed connection back as its lock decided (kept, returned or discarded)."""

    __slots__ = ("borrowed",)

    def __init__(self, borrowed: Any) -> None:
        self.borrowed = borrowed


# What steps yield to their driver (On: a backend's statements on an executor).
Request: TypeAlias = "On[Any] | Borrow | BorrowAnew | Settle"
Steps: TypeAlias = Generator[Any, Any, T]


class Site(Protocol):
    def borrow(self, *, transaction: bool) -> Any: ...


class AsyncSite(Protocol):
    async def aborrow(self, *, transaction: bool) -> Any: ...


class On(Generic[T]):
    """Run a backend's statement steps on ``executor``: ``yield from on(...)`` hands them
    to the driver, which performs every statement they yield (throwing a statement's
    error back into them) and sends their result back once.

    The statements never travel through the generators of the rules that asked for
    them: a lock's statement resumes one generator, not every frame of the chain.
    """

    __slots__ = ("executor", "steps")

    def __init__(self, executor: Any, steps: Generator[Statement, Any, T]) -> None:
        self.executor = executor
        self.steps = steps

    def __iter__(self) -> Generator[On[T], Any, T]:
        result: T = yield self
        return result


def on(executor: object, steps: Generator[Statement, Any, T]) -> On[T]:
    """Run a backend's statement steps on ``executor`` (``yield from on(executor, steps)``)."""
    return On(executor, steps)


def perform(
    executor: Any,
    statements: Generator[Statement, Any, T],
    first_failed: BaseException | None = None,
) -> T:
    """Run a backend's statement steps on a blocking ``executor``, each statement answered
    (or its error thrown back) in turn; return their result.

    ``first_failed``: the caller already ran the steps' first statement itself (a lock's
    ``lock_statement``), and it raised this error, which the steps get instead.
    """
    execute = executor.execute
    answer: Any = None
    failure = first_failed
    if failure is not None:
        statements.send(None)  # up to the first statement, already sent
    while True:
        try:
            statement = statements.send(answer) if failure is None else statements.throw(failure)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            answer, failure = execute(statement), None
        except BaseException as raised:
            answer, failure = None, raised


def run_steps(steps: Steps[T] | On[T], site: Site | None = None) -> T:
    """Perform every request of ``steps`` with blocking calls; return its result."""
    requests: Steps[T] = steps.__iter__() if isinstance(steps, On) else steps
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            request = requests.send(result) if error is None else requests.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        result = error = None
        try:
            if type(request) is On:
                result = perform(request.executor, request.steps)
            elif type(request) is Settle:
                request.borrowed.settle()
            elif type(request) is BorrowAnew:
                result = cast(Any, site).borrow_anew()
            else:
                assert site is not None, "these steps borrow a connection: pass the site"
                result = site.borrow(transaction=request.transaction)
        except BaseException as raised:
            error = raised


async def aperform(
    executor: Any,
    statements: Generator[Statement, Any, T],
    first_failed: BaseException | None = None,
) -> T:
    """``perform`` with an awaiting ``executor``."""
    execute = executor.execute
    answer: Any = None
    failure = first_failed
    if failure is not None:
        statements.send(None)
    while True:
        try:
            statement = statements.send(answer) if failure is None else statements.throw(failure)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            answer, failure = await execute(statement), None
        except BaseException as raised:
            answer, failure = None, raised


async def arun_steps(steps: Steps[T] | On[T], site: AsyncSite | None = None) -> T:
    """Perform every request of ``steps``, awaiting each; return its result."""
    requests: Steps[T] = steps.__iter__() if isinstance(steps, On) else steps
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            request = requests.send(result) if error is None else requests.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        result = error = None
        try:
            if type(request) is On:
                result = await aperform(request.executor, request.steps)
            elif type(request) is Settle:
                await request.borrowed.asettle()
            elif type(request) is BorrowAnew:
                result = await cast(Any, site).aborrow_anew()
            else:
                assert site is not None, "these steps borrow a connection: pass the site"
                result = await site.aborrow(transaction=request.transaction)
        except BaseException as raised:
            error = raised
