"""``advisory_locks.opentelemetry``: metrics and a span per wait, read back through the
OpenTelemetry SDK's in-memory exporters, on PostgreSQL, MariaDB and SQLite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import StatusCode
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from advisory_locks import LockLost, advisory_lock, lock_key, opentelemetry
from tests.helpers import unique_name
from tests.otel_support import Telemetry, instrumented

pytestmark = pytest.mark.timeout(60)

DATABASES = ("postgresql", "mariadb", "sqlite")


@pytest.fixture(params=DATABASES)
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "postgresql":
        url = request.getfixturevalue("postgres_url")
    elif request.param == "mariadb":
        url = request.getfixturevalue("mysql_url")
    else:
        url = make_url(f"sqlite:///{tmp_path / 'otel.sqlite'}")
    engine = create_engine(url)
    yield engine
    engine.dispose()


def _system(engine: Engine) -> str:
    return {"postgresql": "postgresql", "mysql": "mariadb", "sqlite": "sqlite"}[engine.dialect.name]


def test_a_held_lock_is_counted_held_and_its_wait_and_hold_are_recorded(
    engine: Engine, telemetry: Telemetry
) -> None:
    name = unique_name("otel")
    with advisory_lock(engine, name):
        (held,) = telemetry.points("advisory_lock.held", name)
        assert held.value == 1
    (held,) = telemetry.points("advisory_lock.held", name)
    assert held.value == 0
    (wait,) = telemetry.points("advisory_lock.wait.duration", name)
    assert wait.count == 1
    assert wait.attributes["advisory_lock.outcome"] == "acquired"
    assert wait.attributes["db.system.name"] == _system(engine)
    (hold,) = telemetry.points("advisory_lock.hold.duration", name)
    assert hold.count == 1
    assert hold.attributes["advisory_lock.release_reason"] == "unlock"
    assert telemetry.points("advisory_lock.not_acquired", name) == []


def test_each_wait_is_a_span_with_the_database_conventions_attributes(
    engine: Engine, telemetry: Telemetry
) -> None:
    name = unique_name("otel-span")
    with advisory_lock(engine, name):
        pass
    (span,) = telemetry.waits(name)
    assert span.attributes is not None
    assert span.attributes["db.system.name"] == _system(engine)
    assert span.attributes["advisory_lock.mode"] == "exclusive"
    assert span.attributes["advisory_lock.scope"] == "session"
    assert span.attributes["advisory_lock.binding"] == "sqlalchemy"
    assert span.attributes["advisory_lock.key"] == lock_key(name)
    assert span.attributes["advisory_lock.outcome"] == "acquired"
    assert span.status.status_code is StatusCode.UNSET
    assert span.start_time is not None
    assert span.end_time is not None
    assert span.start_time <= span.end_time


def test_a_timed_out_wait_is_counted_and_its_span_is_an_error_as_long_as_the_wait(
    engine: Engine, telemetry: Telemetry
) -> None:
    name = unique_name("otel-timeout")
    with advisory_lock(engine, name), engine.connect() as other:
        assert advisory_lock(other, name, timeout=0.3).acquire() is False
    (refused,) = telemetry.points("advisory_lock.not_acquired", name)
    assert (refused.value, refused.attributes["advisory_lock.outcome"]) == (1, "timeout")
    timed_out = [
        span
        for span in telemetry.waits(name)
        if span.attributes and span.attributes["advisory_lock.outcome"] == "timeout"
    ]
    (span,) = timed_out
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None
    assert span.attributes["error.type"] == "timeout"
    assert span.start_time is not None
    assert span.end_time is not None
    assert span.end_time - span.start_time >= 0.25e9


def test_a_busy_try_is_counted_but_its_span_is_no_error(
    engine: Engine, telemetry: Telemetry
) -> None:
    name = unique_name("otel-busy")
    with advisory_lock(engine, name), engine.connect() as other:
        assert advisory_lock(other, name, timeout=0).acquire() is False
    (refused,) = telemetry.points("advisory_lock.not_acquired", name)
    assert refused.attributes["advisory_lock.outcome"] == "busy"
    busy = [
        span
        for span in telemetry.waits(name)
        if span.attributes and span.attributes["advisory_lock.outcome"] == "busy"
    ]
    assert [span.status.status_code for span in busy] == [StatusCode.UNSET]


def test_the_wait_span_is_a_child_of_the_span_current_where_the_lock_was_asked_for(
    pg_engine: Engine, telemetry: Telemetry
) -> None:
    name = unique_name("otel-parent")
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("checkout") as parent, advisory_lock(pg_engine, name):
        pass
    (span,) = telemetry.waits(name)
    assert span.parent is not None
    assert span.parent.span_id == parent.get_span_context().span_id


def test_a_lost_lock_is_counted_with_its_reason_and_leaves_nothing_held(
    pg_engine: Engine, telemetry: Telemetry
) -> None:
    name = unique_name("otel-lost")
    with pg_engine.connect() as connection:
        lock = advisory_lock(connection, name)
        lock.acquire()
        connection.execute(text("SELECT pg_advisory_unlock_all()"))
        with pytest.raises(LockLost):
            lock.ensure_held()
    (lost,) = telemetry.points("advisory_lock.lost", name)
    assert (lost.value, lost.attributes["advisory_lock.loss_reason"]) == (1, "not_held")
    (held,) = telemetry.points("advisory_lock.held", name)
    assert held.value == 0


def test_metrics_leave_lock_names_out_unless_asked(pg_engine: Engine) -> None:
    name = unique_name("otel-no-names")
    for telemetry in instrumented(False):
        with advisory_lock(pg_engine, name):
            pass
        data = telemetry.reader.get_metrics_data()
        assert data is not None
        attributes = [
            point.attributes
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for recorded in scope.metrics
            for point in recorded.data.data_points
        ]
        assert attributes
        assert all("advisory_lock.name" not in (point or {}) for point in attributes)
        # Spans carry the name all the same.
        assert len(telemetry.waits(name)) == 1


def test_after_uninstrument_nothing_more_is_recorded(
    pg_engine: Engine, telemetry: Telemetry
) -> None:
    opentelemetry.uninstrument()
    name = unique_name("otel-off")
    with advisory_lock(pg_engine, name):
        pass
    assert telemetry.waits(name) == []
    assert telemetry.points("advisory_lock.wait.duration", name) == []
