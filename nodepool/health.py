"""Probes for load balancers and compose: ``/healthz`` (process up), ``/readyz`` (dependencies)."""

from __future__ import annotations

import time

from celery import current_app
from django.conf import settings
from django.db import connection
from django.http import JsonResponse
from django.views.decorators.http import require_GET
from kombu import Connection


@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


def _check_database() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _check_broker() -> str | None:
    """Connect to the broker and declare the default queue (idempotent, and cheap on Redis).

    Connecting alone proves nothing for the embedded broker (kombu's virtual transports connect
    lazily); declaring the queue makes it open the SQLite file, or ask Redis for the queue length.
    """
    try:
        with Connection(
            settings.CELERY_BROKER_URL, connect_timeout=2, transport_options=settings.CELERY_BROKER_TRANSPORT_OPTIONS
        ) as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=2)
            conn.default_channel.queue_declare(queue=current_app.conf.task_default_queue, passive=False)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@require_GET
def readyz(request):
    """200 when the database and the broker answer; 503 with the failing check otherwise."""
    started = time.monotonic()
    checks = {"database": _check_database(), "broker": _check_broker()}
    ok = all(v is None for v in checks.values())
    body = {
        "status": "ok" if ok else "unavailable",
        "checks": {k: ("ok" if v is None else v) for k, v in checks.items()},
        "elapsed_ms": round((time.monotonic() - started) * 1000, 1),
    }
    return JsonResponse(body, status=200 if ok else 503)
