"""Optional tracing: OpenTelemetry's Django and Celery instrumentation, on only when an exporter
endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT``, OTLP over HTTP, e.g.
``http://collector:4318/v1/traces``). Off, nothing is imported and nothing is traced.

Spans carry the request's route and status (Django) and the task's name and id (Celery, linked to
the span that sent the task through the message headers). Ids stay out of metric labels; in traces
they are attributes, where they belong.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

_provider: Any = None


def configure_tracing(*, endpoint: str | None = None, exporter: Any = None) -> Any:
    """Instrument Django and Celery and return the ``TracerProvider``; None when tracing is off.

    Args:
        endpoint: OTLP/HTTP traces URL; default ``settings.OTEL_EXPORTER_OTLP_ENDPOINT``.
        exporter: a span exporter to use instead (tests pass an ``InMemorySpanExporter``; spans are
            then exported synchronously).

    The provider is passed to the instrumentors rather than installed globally, so a process
    can be re-configured (tests) without OpenTelemetry's "override not allowed" refusal.
    """
    global _provider
    endpoint = settings.OTEL_EXPORTER_OTLP_ENDPOINT if endpoint is None else endpoint
    if not endpoint and exporter is None:
        return None
    # OpenTelemetry loads only when tracing is configured (heavy, and off unless an endpoint is set).
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor  # (same reason)
    from opentelemetry.sdk.resources import Resource  # (same reason)
    from opentelemetry.sdk.trace import TracerProvider  # (same reason)
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor  # (same reason)

    unconfigure_tracing()
    provider = TracerProvider(resource=Resource.create({"service.name": settings.OTEL_SERVICE_NAME}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # (same reason)

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    DjangoInstrumentor().instrument(tracer_provider=provider)
    CeleryInstrumentor().instrument(tracer_provider=provider)
    _provider = provider
    return provider


def unconfigure_tracing() -> None:
    """Remove the instrumentation (tests; a process normally keeps it for its lifetime)."""
    global _provider
    if _provider is None:
        return
    # Loaded only if tracing was configured (see configure_tracing).
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor  # (same reason)

    DjangoInstrumentor().uninstrument()
    CeleryInstrumentor().uninstrument()
    _provider.shutdown()
    _provider = None
