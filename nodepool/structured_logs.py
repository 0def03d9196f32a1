"""Structured logs (structlog + django-structlog) for web, worker and beat.

Every log line is one event name with its ids as fields, never formatted into the message:
``request_id`` (the ``X-Request-ID`` nodepool.api.middleware settled on), ``node_id``,
``incarnation``, ``pool``, ``lease_id``, ``workload_id``. High-cardinality ids live here, not in
metric labels. Bound per request or per task with :func:`bind`; django-structlog carries the
bound context of a request into the Celery tasks it dispatches (task headers), so a task's lines
carry the originating ``request_id``.

``LOG_FORMAT``: ``json`` (default: one JSON object per line, for production) or ``text``
(readable key=value lines; ``make run`` and ``make demo`` choose it).
"""

from __future__ import annotations

from typing import Any

import structlog

ID_FIELDS = ("request_id", "node_id", "incarnation", "pool", "lease_id", "workload_id")

SHARED_PROCESSORS = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_logger_name,
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    structlog.stdlib.ExtraAdder(),
]


# Celery's loggers of routine periodic-task lines (sent, received, succeeded).
PERIODIC_TASK_LOGGERS = ("celery.beat", "celery.worker.strategy", "celery.app.trace")


def logging_config(fmt: str, level: str = "INFO") -> dict[str, Any]:
    """The ``LOGGING`` dict: stdlib and structlog records through one renderer.

    Raises:
        ValueError: ``fmt`` is neither ``json`` nor ``text``.
    """
    if fmt not in ("json", "text"):
        raise ValueError(f"LOG_FORMAT must be json or text, not {fmt!r}")
    renderer = (
        structlog.processors.JSONRenderer(sort_keys=False)
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False, pad_event_to=30)
    )
    processors = [structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer]
    if fmt == "json":
        processors.insert(1, structlog.processors.format_exc_info)
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "structured": {
                "()": structlog.stdlib.ProcessorFormatter,
                "processors": processors,
                "foreign_pre_chain": SHARED_PROCESSORS,
            }
        },
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "structured"}},
        "root": {"handlers": ["console"], "level": level},
        # Periodic tasks' routine lines at DEBUG unless the task changed something; applied
        # renewals and 429s at DEBUG: their counts are a metric (nodepool.logs' filters).
        "filters": {
            "periodic": {"()": "nodepool.logs.PeriodicTaskChatter"},
            "machine_traffic": {"()": "nodepool.logs.RoutineMachineTraffic"},
        },
        "loggers": {
            "django.db.backends": {"level": "WARNING"},
            **{name: {"filters": ["periodic"]} for name in PERIODIC_TASK_LOGGERS},
            "django_structlog.middlewares.request": {"filters": ["machine_traffic"]},
        },
    }


def configure_structlog() -> None:
    """structlog's own loggers hand their event dicts to the stdlib handlers configured above."""
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *SHARED_PROCESSORS,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def bind(**ids: Any) -> None:
    """Bind ids to the current request's or task's log context (empty values are skipped)."""
    values = {k: str(v) for k, v in ids.items() if v not in (None, "")}
    if values:
        structlog.contextvars.bind_contextvars(**values)


def bind_request_id(request, logger, **kwargs) -> None:
    """django-structlog ``bind_extra_request_metadata`` receiver: one request id per request, the one
    nodepool.api.middleware.RequestIdMiddleware accepted (or generated) and echoes back."""
    request_id = getattr(request, "request_id", "")
    if request_id:
        structlog.contextvars.bind_contextvars(request_id=request_id)


def bind_node_of_request(request, logger, response=None, **kwargs) -> None:
    """``bind_extra_request_finished_metadata`` receiver: the node a node credential authenticated
    (DRF authenticates in the view, after the middleware bound the rest)."""
    node = getattr(request, "node", None)
    if node is not None:
        bind(node_id=node.pk, incarnation=node.incarnation, pool=getattr(node.pool, "name", ""))
