"""Django's MySQL backend on PyMySQL where mysqlclient is not installed.

Django's MySQL backend imports ``MySQLdb``, the module of mysqlclient, which compiles
against the MySQL/MariaDB client library. advisory-locks' ``mysql`` extra installs
PyMySQL instead (pure Python), which can stand in for it under that name. So that a
project on MySQL/MariaDB with only that extra works without calling
``pymysql.install_as_MySQLdb()`` itself, the app does it at startup: only when a database
uses the MySQL backend, mysqlclient is not importable and PyMySQL is. With neither, the
system check ``advisory_locks.E008`` says what to install.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["install_pymysql_if_needed", "mysql_aliases", "mysql_driver"]

# Django refuses a MySQLdb whose version_info is below the mysqlclient it supports
# (Django 4.2-5.2: 1.4.3; 6.0: 2.2.1). Older PyMySQL releases report 1.4.6 there; raise
# it to a mysqlclient release those Django versions accept, never lower it.
MYSQLCLIENT_VERSION_DJANGO_ACCEPTS: Final = (2, 2, 1, "final", 0)


def mysql_aliases(databases: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The aliases whose ENGINE is Django's MySQL backend or a wrapper named like it."""
    return [
        alias
        for alias, database in databases.items()
        if str(database.get("ENGINE", "")).rsplit(".", 1)[-1] == "mysql"
    ]


def mysql_driver() -> str | None:
    """Which driver ``import MySQLdb`` gives: "mysqlclient", "PyMySQL", or None (neither)."""
    loaded = sys.modules.get("MySQLdb")
    if loaded is not None:
        return "mysqlclient" if loaded.__name__ == "MySQLdb" else "PyMySQL"
    if _importable("MySQLdb"):
        return "mysqlclient"
    return None


def install_pymysql_if_needed(databases: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Register PyMySQL as ``MySQLdb`` when a database needs it and mysqlclient is absent.

    Return the driver Django's MySQL backend will use (None: no database uses it, or no
    driver is installed).
    """
    if not mysql_aliases(databases):
        return None
    driver = mysql_driver()
    if driver is not None or not _importable("pymysql"):
        return driver
    import pymysql

    if pymysql.version_info < MYSQLCLIENT_VERSION_DJANGO_ACCEPTS:
        pymysql.version_info = MYSQLCLIENT_VERSION_DJANGO_ACCEPTS
    pymysql.install_as_MySQLdb()
    return "PyMySQL"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules[module] is None: imports of it are blocked
        return False
