"""Optional tracing: off without an endpoint; with one, Django requests and Celery tasks become
spans (checked with OpenTelemetry's in-memory exporter)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from nodepool.tracing import configure_tracing, unconfigure_tracing

pytestmark = pytest.mark.django_db


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    configure_tracing(exporter=exporter)
    yield exporter
    unconfigure_tracing()


def test_tracing_is_off_without_an_exporter_endpoint(settings):
    settings.OTEL_EXPORTER_OTLP_ENDPOINT = ""
    assert configure_tracing() is None


def test_a_request_becomes_a_server_span_with_its_route_and_status(client, spans):
    assert client.get("/healthz").status_code == 200
    (span,) = [s for s in spans.get_finished_spans() if s.kind.name == "SERVER"]
    assert span.attributes["http.route"] == "healthz"
    assert span.attributes.get("http.response.status_code", span.attributes.get("http.status_code")) == 200
    assert span.resource.attributes["service.name"] == "nodepool"


def test_a_celery_task_becomes_a_span_with_its_name(spans):
    from nodepool.celery import ping

    assert ping.apply(args=["hello"]).get() == "hello"
    names = [s.name for s in spans.get_finished_spans()]
    assert any("nodepool.ping" in name for name in names), names


def test_after_unconfiguring_nothing_is_traced(client):
    exporter = InMemorySpanExporter()
    configure_tracing(exporter=exporter)
    unconfigure_tracing()
    client.get("/healthz")
    assert exporter.get_finished_spans() == ()
