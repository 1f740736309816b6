"""Raw driver connections for the contract suite, importable by its holder processes
without pytest: each records ``<connect>`` when its first statement is sent."""

from __future__ import annotations

import sqlite3
from typing import Any

from sqlalchemy.engine import URL


def raw_connect(driver: str, arguments: dict[str, Any], statements: list[str]) -> Any:
    """A connection that records ``<connect>`` when its first statement is sent.

    ``arguments``: ``{"dsn": ...}`` for the PostgreSQL drivers, the driver's connect
    keywords for the MySQL ones, ``{"database": path}`` for sqlite3.
    """

    def first_statement() -> None:
        if not sent:
            sent.append(True)
            statements.append("<connect>")

    sent: list[bool] = []
    if driver == "psycopg":
        import psycopg

        class Recording(psycopg.Cursor[Any]):
            def execute(self, *args: Any, **kwargs: Any) -> Any:
                first_statement()
                return super().execute(*args, **kwargs)

        connection: Any = psycopg.connect(arguments["dsn"], cursor_factory=Recording)
        return connection
    if driver == "psycopg2":
        import psycopg2
        import psycopg2.extensions

        class Recording2(psycopg2.extensions.cursor):  # type: ignore[misc]
            def execute(self, *args: Any, **kwargs: Any) -> Any:
                first_statement()
                return super().execute(*args, **kwargs)

        return psycopg2.connect(arguments["dsn"], cursor_factory=Recording2)
    if driver in ("pymysql", "mysqlclient"):
        # Both drivers send every statement through Connection.query(); the binding
        # finds a subclass of the driver's connection as it finds the driver's own.
        if driver == "pymysql":
            from pymysql.connections import Connection as MySQLConnection
        else:
            from MySQLdb.connections import Connection as MySQLConnection

        class RecordingMySQL(MySQLConnection):  # type: ignore[misc]
            def query(self, *args: Any, **kwargs: Any) -> Any:
                first_statement()
                return super().query(*args, **kwargs)

        return RecordingMySQL(**arguments)
    assert driver == "sqlite3", driver

    class RecordingSQLite(sqlite3.Connection):
        def cursor(self, *args: Any, **kwargs: Any) -> Any:
            first_statement()
            return super().cursor(*args, **kwargs)

    return sqlite3.connect(arguments["database"], factory=RecordingSQLite, check_same_thread=False)


def raw_connect_arguments(driver: str, url: URL) -> dict[str, Any]:
    """What ``raw_connect`` needs to reach the database at ``url`` with ``driver``."""
    if driver in ("psycopg", "psycopg2", "asyncpg"):
        return {"dsn": url.set(drivername="postgresql").render_as_string(hide_password=False)}
    if driver == "sqlite3":
        return {"database": url.database}
    arguments: dict[str, Any] = url.translate_connect_args(username="user")
    if driver == "mysqlclient":  # mysqlclient's older keyword names
        arguments["passwd"] = arguments.pop("password", "")
        arguments["db"] = arguments.pop("database")
    return arguments
