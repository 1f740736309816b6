"""What a new Django project gets wrong in its first hour, caught early with a hint.

Each test starts a fresh interpreter with a project's settings, as `manage.py` would:
the app's startup (a driver, the system checks) and the first lock are what is
specified, so nothing of this test process's Django setup may leak into them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

from tests.helpers import unique_name

ROOT = Path(__file__).resolve().parents[2]

# Makes `import MySQLdb` fail as it does where mysqlclient is not installed (CI installs it).
WITHOUT_MYSQLCLIENT = "import sys; sys.modules['MySQLdb'] = None\n"
WITHOUT_ANY_MYSQL_DRIVER = WITHOUT_MYSQLCLIENT + "sys.modules['pymysql'] = None\n"


def run_project(
    tmp_path: Path, settings: dict[str, Any], body: str, *, prelude: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run ``body`` after ``django.setup()`` with ``settings``; fail on a non-zero exit."""
    script = (
        prelude
        + "import django\nfrom django.conf import settings\n"
        + f"settings.configure(**{settings!r}, SECRET_KEY='x', USE_TZ=True)\n"
        + "django.setup()\n"
        + textwrap.dedent(body)
    )
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DJANGO_", "ADVISORY_LOCKS_"))
    }
    environment["PYTHONPATH"] = str(ROOT)
    completed = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed


def mysql_database(url: URL) -> dict[str, Any]:
    return {
        "ENGINE": "django.db.backends.mysql",
        "NAME": url.database,
        "USER": url.username or "",
        "PASSWORD": url.password or "",
        "HOST": url.host or "",
        "PORT": str(url.port or ""),
    }


def sqlite_database(name: object, test_name: object = None) -> dict[str, Any]:
    database: dict[str, Any] = {"ENGINE": "django.db.backends.sqlite3", "NAME": name}
    if test_name is not None:
        database["TEST"] = {"NAME": test_name}
    return database


CHECK_IDS = """
from django.core import checks
print(json.dumps([[m.id, m.obj, m.msg, m.hint] for m in checks.run_checks()]))
"""


def check_messages(completed: subprocess.CompletedProcess[str]) -> list[list[str]]:
    messages: list[list[str]] = json.loads(completed.stdout.splitlines()[-1])
    return [message for message in messages if message[0].startswith("advisory_locks.")]


# --- MySQL/MariaDB with PyMySQL only ------------------------------------------------------


@pytest.mark.mysql
def test_django_locks_on_mariadb_with_only_pymysql_installed(
    mysql_url: URL, tmp_path: Path
) -> None:
    name = unique_name("pymysql-only")
    completed = run_project(
        tmp_path,
        {
            # A models module imported before this app's ready(): defining a model loads
            # the default database's backend, and so its driver.
            "INSTALLED_APPS": ["tests.django_app", "advisory_locks_django"],
            "DATABASES": {"default": mysql_database(mysql_url)},
        },
        f"""
        from django.db import connection
        from advisory_locks_django import advisory_lock, current_advisory_locks

        with advisory_lock({name!r}, timeout=0):
            print(connection.Database.__name__, current_advisory_locks())
        """,
        prelude=WITHOUT_MYSQLCLIENT,
    )
    assert completed.stdout.split(maxsplit=1) == ["pymysql", f"[{name!r}]\n"]


def test_a_mysql_database_without_any_driver_fails_the_checks_with_a_hint(
    tmp_path: Path,
) -> None:
    mysql = {"ENGINE": "django.db.backends.mysql", "NAME": "shop"}
    completed = run_project(
        tmp_path,
        {"INSTALLED_APPS": ["advisory_locks_django"], "DATABASES": {"default": mysql}},
        "import json\n" + CHECK_IDS,
        prelude=WITHOUT_ANY_MYSQL_DRIVER,
    )
    ((check_id, alias, message, hint),) = check_messages(completed)
    assert (check_id, alias) == ("advisory_locks.E008", "default")
    assert "neither mysqlclient nor PyMySQL" in message
    assert "advisory-locks[mysql]" in hint
    assert "docs/django.md#" in hint


# --- the app missing from INSTALLED_APPS --------------------------------------------------


def test_the_first_lock_without_the_app_installed_warns_at_the_callers_line(
    tmp_path: Path,
) -> None:
    completed = run_project(
        tmp_path,
        {"INSTALLED_APPS": [], "DATABASES": {"default": sqlite_database("app.sqlite3")}},
        """
        import warnings
        from advisory_locks_django import advisory_lock

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with advisory_lock("first"):
                pass
            with advisory_lock("second"):
                pass
        for warning in caught:
            print(warning.category.__name__, warning.filename, warning.message)
        """,
    )
    (line,) = completed.stdout.splitlines()
    category, filename, message = line.split(" ", 2)
    assert (category, filename) == ("RuntimeWarning", "<string>")
    assert message.startswith("advisory_locks_django is not in INSTALLED_APPS")
    assert 'Add "advisory_locks_django" to INSTALLED_APPS' in message


def test_locks_with_the_app_installed_do_not_warn(tmp_path: Path) -> None:
    completed = run_project(
        tmp_path,
        {
            "INSTALLED_APPS": ["advisory_locks_django"],
            "DATABASES": {"default": sqlite_database("app.sqlite3", "test.sqlite3")},
        },
        """
        import warnings
        from advisory_locks_django import advisory_lock

        warnings.simplefilter("error")
        with advisory_lock("first"):
            print("locked")
        """,
    )
    assert completed.stdout == "locked\n"


# --- SQLite databases in memory -----------------------------------------------------------


def test_a_sqlite_database_with_the_default_test_database_gets_a_warning(
    tmp_path: Path,
) -> None:
    completed = run_project(
        tmp_path,
        {
            "INSTALLED_APPS": ["advisory_locks_django"],
            "DATABASES": {
                "default": sqlite_database("app.sqlite3"),
                "files": sqlite_database("files.sqlite3", "test_files.sqlite3"),
            },
        },
        "import json\n" + CHECK_IDS,
    )
    ((check_id, alias, message, hint),) = check_messages(completed)
    assert (check_id, alias) == ("advisory_locks.W005", "default")
    assert "in-memory SQLite test database" in message
    assert 'DATABASES["default"]["TEST"]["NAME"]' in hint
    assert "docs/django.md#" in hint


def test_an_in_memory_sqlite_database_gets_a_warning(tmp_path: Path) -> None:
    completed = run_project(
        tmp_path,
        {
            "INSTALLED_APPS": ["advisory_locks_django"],
            "DATABASES": {"default": sqlite_database(":memory:")},
        },
        "import json\n" + CHECK_IDS,
    )
    assert [message[:2] for message in check_messages(completed)] == [
        ["advisory_locks.W004", "default"]
    ]


def test_manage_py_test_on_in_memory_sqlite_warns_and_the_lock_error_names_test_name(
    tmp_path: Path,
) -> None:
    # The test runner's way: in-memory test databases, checks run after they exist.
    (tmp_path / "test_locking.py").write_text(
        textwrap.dedent(
            """
            from django.test import TestCase

            from advisory_locks_django import UnsupportedFeature, advisory_lock


            class LockTest(TestCase):
                def test_lock(self):
                    with self.assertRaises(UnsupportedFeature) as raised:
                        with advisory_lock("nightly-report"):
                            pass
                    print("LOCK ERROR:", raised.exception)
            """
        ),
        encoding="utf-8",
    )
    completed = run_project(
        tmp_path,
        {
            "INSTALLED_APPS": ["advisory_locks_django"],
            "DATABASES": {"default": sqlite_database("app.sqlite3")},
        },
        """
        import sys
        from django.test.utils import get_runner

        runner = get_runner(settings)(verbosity=1)
        sys.exit(runner.run_tests(["test_locking"]))
        """,
        prelude="import sys; sys.path.insert(0, '.')\n",
    )
    output = completed.stdout + completed.stderr
    assert "(advisory_locks.W004)" in output
    (error,) = [line for line in output.splitlines() if line.startswith("LOCK ERROR:")]
    assert 'DATABASES[alias]["TEST"]["NAME"]' in error
