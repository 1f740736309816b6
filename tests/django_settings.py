"""Django settings for the Django app's tests (pytest-django loads them for every run).

The databases point at the servers tests/databases.py finds; the
``django_db_modify_db_settings`` fixture in tests/conftest.py fills in the discovered
addresses before any test database is created. Test database names are unique per run, so
concurrent runs against one server never drop each other's databases.

"default" and "other" are PostgreSQL; "pooled" (on Django 5.1+ only) is "default"'s
database through Django's native connection pool, one connection large, so that a
connection given back is the one the next borrower gets. "mysql" (MariaDB) and "sqlite"
are declared for the tests that ask for them with ``django_db(databases=[...])``:
pytest-django creates a test database only for aliases some collected test asks for, so
they cost the other tests nothing.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from pathlib import Path

import django
from sqlalchemy.engine import make_url

from tests.databases import MYSQL, POSTGRESQL
from tests.django_mysql_driver import install_mysql_driver

_url = make_url(os.environ.get(POSTGRESQL.environment_variable) or POSTGRESQL.local_default)
_mysql_url = make_url(os.environ.get(MYSQL.environment_variable) or MYSQL.local_default)
_run = f"{os.getpid()}_{uuid.uuid4().hex[:8]}"
MYSQL_DRIVER = install_mysql_driver()


def _database(test_name: str) -> dict[str, object]:
    return {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": _url.host or "",
        "PORT": _url.port or "",
        "USER": _url.username or "",
        "PASSWORD": _url.password or "",
        "NAME": _url.database or "postgres",
        "TEST": {"NAME": f"advisory_locks_{test_name}_{_run}"},
    }


SECRET_KEY = "advisory-locks-tests"
# Tests that run real requests serve tests/django_app/urls.py from a WSGI server on the
# loopback address (tests/django/real_requests.py); the admin is there too.
ROOT_URLCONF = "tests.django_app.urls"
ALLOWED_HOSTS = ["127.0.0.1"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# The example project's `shop` app is tested here too (tests/example); manage.py would put
# its folder on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "example_project"))
INSTALLED_APPS = [
    "advisory_locks_django",
    "tests.django_app",
    "shop",
    # The admin, for the "Database locks" page (tests/django/test_django_admin.py).
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
]
# The live server of the browser test serves the admin's CSS from here.
STATIC_URL = "/static/"
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
# SQLite locks are files next to the database file; Django's default SQLite test database
# is in memory, where they are refused, so the test database is a file too.
_sqlite_file = str(Path(tempfile.gettempdir()) / f"advisory_locks_{_run}.sqlite3")
# Two PostgreSQL aliases on one server, as a multi-database project would have them.
DATABASES = {
    "default": _database("default"),
    "other": _database("other"),
    "mysql": {
        "ENGINE": "django.db.backends.mysql",
        "HOST": _mysql_url.host or "",
        "PORT": _mysql_url.port or "",
        "USER": _mysql_url.username or "",
        "PASSWORD": _mysql_url.password or "",
        "NAME": _mysql_url.database or "test",
        "TEST": {"NAME": f"advisory_locks_mysql_{_run}"},
    },
    "sqlite": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": _sqlite_file,
        "TEST": {"NAME": _sqlite_file},
    },
}
if django.VERSION >= (5, 1):
    # Before 5.1 Django has no pool: psycopg would refuse the option, and the tests that
    # use this alias are skipped.
    DATABASES["pooled"] = {
        **_database("default"),
        "OPTIONS": {"pool": {"min_size": 1, "max_size": 1, "timeout": 10}},
        "TEST": {"MIRROR": "default"},
    }
DATABASE_ROUTERS = ["tests.django_app.routers.LedgerRouter"]
