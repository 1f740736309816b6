"""The admin's "Database locks" page: who may see it, what it shows on each database, and
(in a real browser, against a live server) a lock held by another connection, the page
refreshing itself, and a screenshot kept in artifacts/."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.db import connections
from django.test import Client
from psycopg.rows import TupleRow
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL

from advisory_locks import lease_lock
from advisory_locks.keys import lock_key
from advisory_locks_django import advisory_lock
from tests.databases import psycopg_connect, pymysql_connect
from tests.django.browser import artifacts_directory, chromium
from tests.helpers import unique_name, wait_for, waiter_pids

ALIASES = "__all__"  # every configured database is listed on the page
PAGE = "/admin/advisory_locks_django/databaselock/"
PASSWORD = "locks-staff-password"
REFRESHED_WITHIN_SECONDS = 20

pytestmark = [pytest.mark.postgresql, pytest.mark.mysql]


@pytest.fixture(autouse=True)
def _close_pools() -> Iterator[None]:
    """The page connects to every alias, a pooled one too (from the live server's threads):
    close its pool, or the test database could not be dropped after the run."""
    yield
    for wrapper in connections.all():
        if wrapper.settings_dict.get("OPTIONS", {}).get("pool"):
            wrapper.close()
            wrapper.close_pool()  # type: ignore[attr-defined]


def make_staff(*, may_view: bool) -> User:
    user = User.objects.create_user(f"ops-{uuid.uuid4().hex[:6]}", password=PASSWORD, is_staff=True)
    if may_view:
        user.user_permissions.add(Permission.objects.get(codename="view_databaselock"))
    return user


def program_connection(postgres_url: URL, application: str) -> psycopg.Connection[TupleRow]:
    """A connection to the default test database as another program has one: outside
    Django, with an application_name of its own."""
    name = connections["default"].settings_dict["NAME"]
    url = postgres_url.set(database=name).update_query_dict({"application_name": application})
    return psycopg_connect(url, autocommit=True)


@pytest.fixture
def holder(postgres_url: URL) -> Iterator[psycopg.Connection[TupleRow]]:
    with program_connection(postgres_url, "nightly-report-job") as connection:
        yield connection


@pytest.fixture
def waiter(postgres_url: URL) -> Iterator[psycopg.Connection[TupleRow]]:
    with program_connection(postgres_url, "report-mailer") as connection:
        yield connection


def mysql_can_list(mysql_url: URL) -> bool:
    """Whether this MariaDB/MySQL server has a table of its named locks to read."""
    connection = pymysql_connect(mysql_url)
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT @@performance_schema, (SELECT COUNT(*) FROM information_schema.PLUGINS"
                " WHERE PLUGIN_NAME = 'METADATA_LOCK_INFO' AND PLUGIN_STATUS = 'ACTIVE')"
            )
            performance_schema, plugin = cursor.fetchone()
    finally:
        connection.close()
    return bool(int(performance_schema)) or bool(plugin)


# -- who may see it, and what it says (Django's test client) -------------------------------


@pytest.mark.django_db(databases=ALIASES)
def test_anonymous_visitors_are_sent_to_the_login_page(client: Client) -> None:
    response = client.get(PAGE)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


@pytest.mark.django_db(databases=ALIASES)
def test_staff_without_the_view_permission_are_refused(client: Client) -> None:
    client.force_login(make_staff(may_view=False))
    assert client.get(PAGE).status_code == 403


@pytest.mark.django_db(databases=ALIASES)
def test_the_page_is_listed_under_the_apps_admin_for_staff_who_may_view_it(
    client: Client,
) -> None:
    client.force_login(make_staff(may_view=True))
    index = client.get("/admin/").content.decode()
    assert "Advisory locks" in index
    assert PAGE in index


@pytest.mark.django_db(databases=ALIASES)
def test_the_page_lists_a_lock_this_process_holds_with_its_name(
    client: Client, holder: psycopg.Connection[TupleRow]
) -> None:
    client.force_login(make_staff(may_view=True))
    name, other_name = unique_name("admin-named"), unique_name("admin-other")
    holder.execute("SELECT pg_advisory_lock(%s)", [lock_key(other_name)])
    with advisory_lock(name):
        page = client.get(PAGE).content.decode()
    assert name in page
    assert str(lock_key(name)) in page
    # Held by another program: its key, pid and application, no name.
    assert str(lock_key(other_name)) in page
    assert str(holder.info.backend_pid) in page
    assert "nightly-report-job" in page
    assert other_name not in page


LEASE_APPLICATION = "admin-page-leases"


@pytest.fixture
def lease_engine(postgres_url: URL) -> Iterator[Engine]:
    """A SQLAlchemy engine on the default test database, whose lease table exists (the
    test must be transactional, so that the engine sees the table)."""
    from django.db import connection

    from advisory_locks._dialects.lease import lease_backend_for_dialect

    with connection.cursor() as cursor:
        for statement in lease_backend_for_dialect("postgresql").create_table():
            cursor.execute(statement)
    database = connection.settings_dict["NAME"]
    engine = create_engine(
        postgres_url.set(database=database).update_query_dict(
            {"application_name": LEASE_APPLICATION}
        )
    )
    yield engine
    engine.dispose()
    # The lease renewer closes its own connection once the process holds no lease: wait
    # for it, or the test database could not be dropped after the run.
    with psycopg_connect(postgres_url, autocommit=True) as observer:
        wait_for(
            lambda: (
                not observer.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
                    (database, LEASE_APPLICATION),
                ).fetchall()
            ),
            "the lease renewer closed its connection",
        )


@pytest.mark.django_db(transaction=True, databases=ALIASES)
def test_the_page_lists_held_leases_with_holder_token_and_expiry(
    client: Client, lease_engine: Engine
) -> None:
    client.force_login(make_staff(may_view=True))
    name = unique_name("admin-lease")
    with lease_lock(lease_engine, name, ttl=60) as lease:
        page = client.get(PAGE).content.decode()
    default = page[page.index('id="database-default"') : page.index('id="database-other"')]
    row = default[default.index(name) :].split("</tr>")[0]
    assert f'<td class="token">{lease.token}</td>' in row
    assert '<td class="holder">' in row
    expires = row.split('<td class="expires">')[1].split("s</td>")[0]
    assert 0 < float(expires) <= 60


@pytest.mark.django_db(databases=ALIASES)
def test_the_page_says_why_it_cannot_list_sqlite_or_a_mysql_without_a_lock_table(
    client: Client, mysql_url: URL
) -> None:
    client.force_login(make_staff(may_view=True))
    page = client.get(PAGE).content.decode()
    sqlite = page[page.index('id="database-sqlite"') :]
    assert "Locks cannot be listed on this database: SQLite locks are operating-system" in sqlite
    mysql = page[page.index('id="database-mysql"') :]
    if mysql_can_list(mysql_url):
        assert "Locks cannot be listed on this database" not in mysql.split("</div>")[0]
    else:
        assert "Locks cannot be listed on this database:" in mysql
        assert "performance_schema" in mysql.split("</div>")[0]


@pytest.mark.django_db(databases=ALIASES)
def test_the_page_refreshes_itself_every_few_seconds_until_told_to_stop(
    client: Client,
) -> None:
    client.force_login(make_staff(may_view=True))
    assert '<meta http-equiv="refresh" content="5">' in client.get(PAGE).content.decode()
    stopped = client.get(PAGE, {"refresh": "0"}).content.decode()
    assert 'http-equiv="refresh"' not in stopped


@pytest.mark.django_db(databases=ALIASES)
def test_there_is_nothing_to_add_change_or_delete(client: Client) -> None:
    user = make_staff(may_view=True)
    user.is_superuser = True
    user.save()
    client.force_login(user)
    assert client.get(PAGE + "add/").status_code == 404
    assert client.get(PAGE + "1/change/").status_code == 404


@pytest.mark.django_db(databases=ALIASES)
def test_the_table_less_model_asks_the_project_for_no_migration() -> None:
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


# -- in a real browser ---------------------------------------------------------------------


@pytest.mark.django_db(transaction=True, databases=ALIASES)
def test_staff_see_a_lock_held_by_another_connection_in_a_browser(
    live_server: Any,
    postgres_url: URL,
    holder: psycopg.Connection[TupleRow],
    waiter: psycopg.Connection[TupleRow],
    lease_engine: Engine,
) -> None:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    staff = make_staff(may_view=True)
    held_elsewhere, held_here = unique_name("report"), unique_name("checkout")
    key = lock_key(held_elsewhere)

    def texts(page: Any, selector: str) -> list[str]:
        # The page reloads itself every second, so an element found before a reload is
        # gone when its text is read. One script reads every match at once; a read that
        # met a reload, or a page still loading, is tried again.
        script = "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.innerText)"
        for _ in range(30):
            try:
                found: list[str] = page.execute_script(script, selector)
            except WebDriverException:
                found = []
            if found:
                return found
            time.sleep(0.1)
        return []

    def row_of(page: Any, pid: int) -> str:
        rows = texts(page, "#database-default tbody tr")
        return next((row for row in rows if f" {pid} " in f" {' '.join(row.split())} "), "")

    # The browser first: where it is missing, nothing is left waiting on a lock.
    with (
        chromium() as browser,
        advisory_lock(held_here),
        lease_lock(lease_engine, "cron:nightly-report", ttl=30) as lease,
    ):
        holder.execute("SELECT pg_advisory_lock(%s)", [key])
        queued = threading.Thread(
            target=waiter.execute, args=("SELECT pg_advisory_lock(%s)", [key]), daemon=True
        )
        queued.start()
        try:
            with program_connection(postgres_url, "observer") as observer:
                wait_for(
                    lambda: waiter_pids(observer, held_elsewhere) == [waiter.info.backend_pid],
                    "the second program waits for the lock",
                )
            browser.get(f"{live_server.url}/admin/login/?next={PAGE}?refresh=1")
            browser.find_element(By.ID, "id_username").send_keys(staff.username)
            browser.find_element(By.ID, "id_password").send_keys(PASSWORD)
            browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
            WebDriverWait(browser, REFRESHED_WITHIN_SECONDS).until(
                lambda page: "Database locks" in page.title
            )
            holding = row_of(browser, holder.info.backend_pid)
            assert str(key) in holding
            assert "held" in holding
            assert "nightly-report-job" in holding
            waiting = row_of(browser, waiter.info.backend_pid)
            assert "waiting" in waiting
            assert "report-mailer" in waiting
            assert held_here in "".join(texts(browser, "#database-default"))  # named
            sqlite = "".join(texts(browser, "#database-sqlite"))
            assert "Locks cannot be listed on this database" in sqlite
            leases = "".join(texts(browser, "#database-default table.advisory-locks-leases"))
            assert "cron:nightly-report" in leases
            assert str(lease.token) in leases
            browser.save_screenshot(str(artifacts_directory() / "admin-database-locks.png"))
        finally:
            # The page refreshes itself: once the first program lets go, the second holds.
            holder.execute("SELECT pg_advisory_unlock(%s)", [key])
            queued.join(REFRESHED_WITHIN_SECONDS)
        WebDriverWait(browser, REFRESHED_WITHIN_SECONDS).until(
            lambda page: (
                "held" in row_of(page, waiter.info.backend_pid)
                and not row_of(page, holder.info.backend_pid)
            )
        )
        # Stop the refreshing (a page loaded to its end) before the browser goes: a
        # request cut off midway can leave its database connection open on the server.
        browser.get(f"{live_server.url}{PAGE}?refresh=0")
    waiter.execute("SELECT pg_advisory_unlock(%s)", [key])
