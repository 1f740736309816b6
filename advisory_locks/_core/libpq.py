"""A lock statement sent straight through psycopg 3's libpq wrapper.

A psycopg cursor spends most of a lock's client CPU: it parses the query for
placeholders, picks a dumper per parameter, keeps its prepared-statement cache, builds
a result set and a row maker, for a statement with two small parameters and one value
back. On a connection in autocommit and idle, which is where every session lock's
statements run (the executors switch a non-autocommit connection first), a lock
statement does not need any of that: ``LibpqStatements`` sends it with
``PGconn.send_query_params`` / ``send_query_prepared`` (``psycopg.pq``, psycopg's
public libpq interface) and lets the connection's own ``wait()`` drive psycopg's
``execute`` generator, which is how a cursor sends it too. So the connection's lock is
held for the round trip, an interrupted wait cancels the query on the server, and
notifications and notices reach the connection's handlers as before; errors are the
exceptions a cursor raises (``psycopg.errors.error_from_result`` on the result).

What the cursor decides, this decides the same way:

- parameters: ``int`` as int2, int4 or int8 by its size and ``str`` as unknown, in text,
  as psycopg's default dumpers send them, so the server resolves the same functions;
- preparing: after ``prepare_threshold`` unprepared executions of a statement, never
  with ``prepare_threshold=None`` (Django's default, and what a transaction pooler
  needs); the statement is prepared under a name of its own text and types, so that a
  name always means one statement;
- the value: ``bool``, integer types and a void as psycopg's default loaders make them;
  any other type through psycopg's ``Transformer``.

A caller that alone uses an idle connection and needs its statement outside any
transaction (an engine lock's own checkout: see ``value``'s ``outside``) has it sent
there whatever the connection's autocommit mode: without a BEGIN, a statement runs as
its own transaction, as in autocommit.

Anything else returns ``NOT_SENT`` before a byte is sent, and the executor sends the
statement through its cursor: a transaction open, a pipeline, or a non-autocommit
connection (where psycopg begins a transaction, and where a prepared statement that the
application deallocated would fail the application's transaction), all asked under the
connection's lock; another parameter type, a non-ASCII text parameter, placeholders
other than ``%s`` or not one per parameter; a connection that is not OK; and any
statement whose executor's cursor is not psycopg's own class (see
``libpq_statements``). A prepared statement the server no longer has (``DEALLOCATE
ALL``, ``DISCARD ALL``, a pool's reset) fails without running, outside any transaction,
and is sent again unprepared.

Behind PgBouncer >= 1.21 with ``max_prepared_statements``, which keeps a client's
prepared statements itself, a statement it does not know ends the client's connection
rather than failing with "does not exist", so the resend cannot help there; the same
holds for psycopg's own prepared statements, and ``prepare_threshold=None`` prepares
nothing.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Final

from advisory_locks._core.steps import Statement

__all__ = ["NOT_SENT", "LibpqStatements", "libpq_statements"]

NOT_SENT: Final = object()
"""``LibpqStatements.value``: not sent; send the statement through the cursor."""

# psycopg.pq's enums, as the values they compare equal to.
_IDLE: Final = 0  # TransactionStatus.IDLE
_OK: Final = 0  # ConnStatus.OK
_TUPLES_OK: Final = 2  # ExecStatus.TUPLES_OK
_COMMAND_OK: Final = 1  # ExecStatus.COMMAND_OK
_FATAL_ERROR: Final = 7  # ExecStatus.FATAL_ERROR
_SQLSTATE: Final = ord("C")  # DiagnosticField.SQLSTATE
# The server's "prepared statement does not exist" and "... already exists".
_UNDEFINED: Final = b"26000"
_EXISTS: Final = b"42P05"

_INT2: Final = 21
_INT4: Final = 23
_INT8: Final = 20
_BOOL: Final = 16
_VOID: Final = 2278
_INT_TYPES: Final = frozenset((_INT2, _INT4, _INT8, 26))  # oid too

_STATE_KEY: Final = "advisory_locks.libpq"

_PLACEHOLDER: Final = re.compile(r"%(.|$)", re.DOTALL)


class _Plan:
    """One statement text with one set of parameter types, on one connection."""

    __slots__ = ("command", "count", "name", "types")

    def __init__(self, command: bytes, types: tuple[int, ...]) -> None:
        self.command = command
        self.types = types
        self.count = 0  # executions unprepared so far
        self.name: bytes | None = None  # prepared under this name


def _command(sql: str, params: int) -> bytes | None:
    """``sql`` with ``%s`` as ``$1``, ``$2``...; None where it has other placeholders, a
    lone ``%`` or not ``params`` of them (the cursor then raises what psycopg raises)."""
    number = 0
    refused = False

    def replace(match: re.Match[str]) -> str:
        nonlocal number, refused
        char = match.group(1)
        if char == "%":
            return "%"
        if char != "s":
            refused = True  # %(name)s, %b, %t, a trailing %: the cursor's business
            return ""
        number += 1
        return f"${number}"

    converted = _PLACEHOLDER.sub(replace, sql)
    if refused or number != params or not converted.isascii():
        return None
    return converted.encode()


class LibpqStatements:
    """Sends the value statements of one psycopg 3 connection through libpq (see the
    module). Made with an executor's cursor, for psycopg's own cursor classes only, and
    shared by the connection's executors. Safe to call from several threads or tasks at
    once: a statement's round trips and a plan's prepared state change under the
    connection's lock, and what is made outside it (a plan, a statement's encoding) is
    the same whoever makes it (a plan made twice at once is prepared twice, the second
    time finding the first's: "already exists")."""

    __slots__ = ("_execute", "_plans", "connection", "pgconn")

    def __init__(self, connection: Any) -> None:
        from psycopg import generators

        self.connection = connection
        self.pgconn = connection.pgconn
        self._execute = generators.execute
        # Statement text and parameter types -> its plan; None: the cursor's to send.
        self._plans: dict[tuple[str, tuple[int, ...]], _Plan | None] = {}

    def value(self, statement: Statement, outside: bool = False) -> object:
        """Run the VALUE ``statement`` on a blocking connection: its value, or
        ``NOT_SENT``. With ``outside``, the caller, which alone uses the connection,
        asks for it to run outside any transaction whatever the connection's autocommit
        mode: on an idle connection it then does, without a BEGIN (never for a statement
        that must join the transaction a BEGIN would open: a transaction lock)."""
        # self._plan(statement), written out: run for every lock statement.
        encoded = statement.encoded
        if encoded is None:
            # Kept with the statement, which the dialect keeps for a recently used key.
            encoded = statement.encoded = _encode(statement)
        if encoded is False:
            return NOT_SENT
        key, values = encoded
        try:
            plan = self._plans[key]
        except KeyError:
            plan = self._new_plan(key, len(values))
        if plan is None:
            return NOT_SENT
        connection, pgconn = self.connection, self.pgconn
        with connection.lock:
            # self._send(plan, values, outside), written out: run for every lock
            # statement.
            if (
                pgconn.transaction_status != _IDLE
                or not (connection._autocommit or outside)
                or connection._pipeline is not None
                or pgconn.status != _OK
            ):
                return NOT_SENT
            threshold = connection.prepare_threshold
            name = plan.name
            if threshold is None:  # nothing prepared, nor counted (as psycopg counts none)
                pgconn.send_query_params(plan.command, values, plan.types)
                rounds = self._execute(pgconn)
            elif name is not None:
                pgconn.send_query_prepared(name, values)
                rounds = self._execute(pgconn)
            else:
                rounds = self._unprepared(plan, values, threshold)
            result = connection.wait(rounds)[-1]
            status = result.status
            if status == _FATAL_ERROR and plan.name is not None:
                again = self._send_again(plan, values, result)
                if again is not None:
                    result = connection.wait(again)[-1]
                    status = result.status
        if status == _TUPLES_OK and result.ntuples:  # a lock's answers, at once
            kind = result.ftype(0)
            if kind == _BOOL:
                value = result.get_value(0, 0)
                return None if value is None else value == b"t"
            if kind == _VOID:
                return ""  # psycopg's text loader, for a void's empty text
        return self._answer(result)

    async def avalue(self, statement: Statement) -> object:
        """``value()`` on an ``AsyncConnection``."""
        planned = self._plan(statement)
        if planned is None:
            return NOT_SENT
        plan, values = planned
        connection = self.connection
        async with connection.lock:
            rounds = self._send(plan, values, False)
            if rounds is None:
                return NOT_SENT
            result = (await connection.wait(rounds))[-1]
            if result.status == _FATAL_ERROR and plan.name is not None:
                again = self._send_again(plan, values, result)
                if again is not None:
                    result = (await connection.wait(again))[-1]
        return self._answer(result)

    def _plan(self, statement: Statement) -> tuple[_Plan, list[bytes]] | None:
        """The statement's plan and parameter values; None: the cursor's to send. (Whether
        the connection is ready for it is asked under its lock.)"""
        encoded = statement.encoded
        if encoded is None:
            encoded = statement.encoded = _encode(statement)
        if encoded is False:
            return None
        key, values = encoded
        try:
            plan = self._plans[key]
        except KeyError:
            plan = self._new_plan(key, len(values))
        return None if plan is None else (plan, values)

    def _new_plan(self, key: tuple[str, tuple[int, ...]], params: int) -> _Plan | None:
        command = _command(key[0], params)
        plan = self._plans[key] = None if command is None else _Plan(command, key[1])
        return plan

    def _send(self, plan: _Plan, values: list[bytes], outside: bool) -> Any:
        """With the connection's lock held: the round trips that run the statement, for
        the connection's ``wait()``, their last result the statement's (sent now where one
        round trip runs it; where its time to be prepared has come, nothing is sent yet:
        ``_prepare_and_run`` does both); None, with nothing sent, where the connection is
        not idle in autocommit (or idle, with ``outside``) outside a pipeline. Asked under
        the lock, which another thread or task may hold to open a transaction or a
        pipeline."""
        connection, pgconn = self.connection, self.pgconn
        if (
            pgconn.transaction_status != _IDLE
            or not (connection._autocommit or outside)
            or connection._pipeline is not None
            or pgconn.status != _OK
        ):
            return None
        threshold = connection.prepare_threshold
        if threshold is None:  # nothing prepared, nor counted (as psycopg counts none)
            pgconn.send_query_params(plan.command, values, plan.types)
            return self._execute(pgconn)
        name = plan.name
        if name is not None:
            pgconn.send_query_prepared(name, values)
            return self._execute(pgconn)
        return self._unprepared(plan, values, threshold)

    def _unprepared(self, plan: _Plan, values: list[bytes], threshold: int) -> Any:
        """``_send``'s round trips for a statement not prepared yet: sent unprepared
        until it has been ``threshold`` times, as psycopg counts, then prepared."""
        if plan.count < threshold:
            plan.count += 1
            self.pgconn.send_query_params(plan.command, values, plan.types)
            return self._execute(self.pgconn)
        return self._prepare_and_run(plan, values)

    def _prepare_and_run(self, plan: _Plan, values: list[bytes]) -> Any:
        """Prepare the statement, then run it: round trips for the connection's
        ``wait()`` (psycopg's ``PQGen``), returning results whose last is the statement's
        (or the preparation's error), as psycopg's ``execute`` generator does."""
        pgconn, execute = self.pgconn, self._execute
        name = _name(plan)
        pgconn.send_prepare(name, plan.command, plan.types)
        result = (yield from execute(pgconn))[-1]
        # "Already exists": prepared on this server session through an earlier connection
        # object (behind a session pooler), under the name of this very text and these
        # types.
        if result.status == _FATAL_ERROR and result.error_field(_SQLSTATE) != _EXISTS:
            return [result]
        plan.name = name
        pgconn.send_query_prepared(name, values)
        return (yield from execute(pgconn))

    def _send_again(self, plan: _Plan, values: list[bytes], result: Any) -> Any:
        """After a statement of a prepared ``plan`` failed with ``result``: where the
        server no longer has it (DEALLOCATE ALL, DISCARD ALL, a pool's reset), and so did
        not run it, outside any transaction, it is sent again unprepared, and its result
        comes from the generator returned, for the connection's ``wait()``; None where
        ``result`` stands."""
        if result.error_field(_SQLSTATE) != _UNDEFINED:
            return None
        plan.name = None
        plan.count = 1
        pgconn = self.pgconn
        pgconn.send_query_params(plan.command, values, plan.types)
        return self._execute(pgconn)

    def _answer(self, result: Any) -> object:
        """The first column of the first row, loaded as psycopg's cursor would; an error
        result raised as the cursor would raise it."""
        status = result.status
        if status == _TUPLES_OK:
            if not result.ntuples:
                return None
            value = result.get_value(0, 0)
            if value is None:
                return None
            kind = result.ftype(0)
            if kind == _BOOL:
                return value == b"t"
            if kind in _INT_TYPES:
                return int(value)
            from psycopg.adapt import Transformer

            # One per answer: threads sharing the connection may load answers at once.
            transformer = Transformer(self.connection)
            transformer.set_pgresult(result)
            return transformer.load_row(0, tuple)[0]
        from psycopg import errors

        if status == _FATAL_ERROR:
            raise errors.error_from_result(result, encoding=self.connection.info.encoding)
        if status == _COMMAND_OK:
            raise errors.ProgrammingError("the last operation didn't produce records")
        raise errors.InternalError(f"unexpected result status from query: {status}")


def _name(plan: _Plan) -> bytes:
    """The name ``plan`` is prepared under: one text and one set of types per name."""
    digest = hashlib.sha256(plan.command + repr(plan.types).encode()).hexdigest()
    return f"_advisory_locks_{digest[:24]}".encode()


def _encode(statement: Statement) -> tuple[tuple[str, tuple[int, ...]], list[bytes]] | bool:
    """The statement's text with its parameters' types, and the parameters as text, as
    psycopg's default dumpers type and write them; False where one is not an ``int`` in
    int8's range or an ASCII ``str`` (the cursor's to send). The values are a list, never
    changed once made: psycopg 3.1's compiled libpq wrapper takes no other sequence."""
    values: list[bytes] = []
    types: list[int] = []
    for param in statement.params:
        if type(param) is int:
            if -0x80000000 <= param <= 0x7FFFFFFF:
                types.append(_INT2 if -0x8000 <= param <= 0x7FFF else _INT4)
            elif -0x8000000000000000 <= param <= 0x7FFFFFFFFFFFFFFF:
                types.append(_INT8)
            else:
                return False  # psycopg sends it as numeric
            values.append(b"%d" % param)
        elif type(param) is str and param.isascii():
            types.append(0)
            values.append(param.encode())
        else:
            return False
    return (statement.sql, tuple(types)), values


def libpq_statements(cursor: Any, state: dict[str, Any]) -> LibpqStatements | None:
    """The ``LibpqStatements`` of the connection of an executor's new ``cursor``, kept in
    the connection's ``state`` (one per connection, so that its executors share what is
    prepared), where that cursor is psycopg's own ``Cursor`` or ``AsyncCursor``; None
    for any other cursor, so that a cursor class the application set (one that logs or
    traces, as OpenTelemetry's psycopg instrumentation sets) still sees every
    statement."""
    import psycopg

    cls = type(cursor)
    if cls is not psycopg.Cursor and cls is not psycopg.AsyncCursor:
        return None
    statements: LibpqStatements | None = state.get(_STATE_KEY)
    if statements is None or statements.connection is not cursor.connection:
        statements = state[_STATE_KEY] = LibpqStatements(cursor.connection)
    return statements
