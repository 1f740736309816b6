"""Give Django's MySQL backend a driver on machines that cannot build mysqlclient.

Django's MySQL backend imports ``MySQLdb`` (mysqlclient), which compiles against the
MySQL/MariaDB client library, so a machine with only Python cannot install it. PyMySQL
is pure Python and can register itself under that name; the tests then run Django on
PyMySQL. Where mysqlclient is installed (CI installs it), Django uses mysqlclient.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["install_mysql_driver"]

# Django refuses a MySQLdb whose version_info is older than the mysqlclient it supports
# (Django 5.2: 1.4.3). PyMySQL reports a mysqlclient-like version there; raise it to a
# mysqlclient release Django versions up to 6.x accept, and only if it is lower.
MYSQLCLIENT_VERSION_DJANGO_ACCEPTS = (2, 2, 1, "final", 0)


def install_mysql_driver(*, force_pymysql: bool = False) -> str:
    """Make ``import MySQLdb`` work; return which driver it gives: mysqlclient or PyMySQL."""
    loaded = sys.modules.get("MySQLdb")
    if loaded is not None:
        return "PyMySQL" if loaded.__name__ == "pymysql" else "mysqlclient"
    if not force_pymysql and importlib.util.find_spec("MySQLdb") is not None:
        return "mysqlclient"
    import pymysql

    if pymysql.version_info < MYSQLCLIENT_VERSION_DJANGO_ACCEPTS:
        pymysql.version_info = MYSQLCLIENT_VERSION_DJANGO_ACCEPTS
    pymysql.install_as_MySQLdb()
    return "PyMySQL"
