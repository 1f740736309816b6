"""Django settings for the Django app's tests (pytest-django loads them for every run).

The databases point at the PostgreSQL server tests/databases.py finds; the
``django_db_modify_db_settings`` fixture in tests/conftest.py fills in the discovered
address before any test database is created. Test database names are unique per run, so
concurrent runs against one server never drop each other's databases.
"""

from __future__ import annotations

import os
import uuid

from sqlalchemy.engine import make_url

from tests.databases import POSTGRESQL

_url = make_url(os.environ.get(POSTGRESQL.environment_variable) or POSTGRESQL.local_default)
_run = f"{os.getpid()}_{uuid.uuid4().hex[:8]}"


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
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["advisory_locks_django", "tests.django_app"]
# Two aliases on one server, as a multi-database project would have them.
DATABASES = {"default": _database("default"), "other": _database("other")}
DATABASE_ROUTERS = ["tests.django_app.routers.LedgerRouter"]
