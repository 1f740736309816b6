"""The example's DATABASE_URL: one URL for Django and SQLAlchemy, whatever driver is installed."""

from __future__ import annotations

import sys
import types

import pytest


def test_a_plain_mysql_url_gets_pymysql_for_sqlalchemy_where_mysqlclient_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shopsite.database_url import sqlalchemy_url

    monkeypatch.setitem(sys.modules, "MySQLdb", None)
    assert sqlalchemy_url("mysql://root@db/shop").drivername == "mysql+pymysql"
    assert sqlalchemy_url("mariadb://root@db/shop").drivername == "mariadb+pymysql"


def test_pymysql_registered_as_mysqldb_is_not_taken_for_mysqlclient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pymysql

    from shopsite.database_url import sqlalchemy_url

    monkeypatch.setitem(sys.modules, "MySQLdb", pymysql)
    assert sqlalchemy_url("mysql://root@db/shop").drivername == "mysql+pymysql"


def test_a_plain_mysql_url_keeps_mysqlclient_where_it_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shopsite.database_url import sqlalchemy_url

    monkeypatch.setitem(sys.modules, "MySQLdb", types.ModuleType("MySQLdb"))
    assert sqlalchemy_url("mysql://root@db/shop").drivername == "mysql"


def test_a_url_that_names_its_driver_is_left_alone() -> None:
    from shopsite.database_url import sqlalchemy_url

    assert sqlalchemy_url("mysql+mysqldb://root@db/shop").drivername == "mysql+mysqldb"
    assert sqlalchemy_url("postgres://app@db/shop").drivername == "postgresql+psycopg"


def test_a_sqlite_file_gets_a_test_database_file_beside_it() -> None:
    from shopsite.database_url import database_from_url

    database = database_from_url("sqlite:////srv/shop.sqlite3")
    assert database["TEST"] == {"NAME": "/srv/shop.sqlite3.test"}
