"""OpenTelemetry's SDK with in-memory exporters, instrumented for one test (the
``telemetry`` fixture of tests/conftest.py gives a ``Telemetry``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from advisory_locks import opentelemetry


@dataclass
class Telemetry:
    reader: InMemoryMetricReader
    spans: InMemorySpanExporter

    def points(self, metric: str, name: str) -> list[Any]:
        """The data points of ``metric`` recorded for the lock ``name``."""
        data = self.reader.get_metrics_data()
        found = []
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for recorded in scope.metrics:
                    if recorded.name != metric:
                        continue
                    found += [
                        point
                        for point in recorded.data.data_points
                        if (point.attributes or {}).get("advisory_lock.name") == name
                    ]
        return found

    def waits(self, name: str) -> list[ReadableSpan]:
        return [
            span
            for span in self.spans.get_finished_spans()
            if span.name == opentelemetry.SPAN_NAME
            and span.attributes is not None
            and span.attributes.get("advisory_lock.name") == name
        ]


def instrumented(names_in_metrics: bool) -> Iterator[Telemetry]:
    reader = InMemoryMetricReader()
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    opentelemetry.instrument(
        meter_provider=MeterProvider(metric_readers=[reader]),
        tracer_provider=tracer_provider,
        lock_names_in_metrics=names_in_metrics,
    )
    try:
        yield Telemetry(reader, exporter)
    finally:
        opentelemetry.uninstrument()
