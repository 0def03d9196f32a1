"""Probes for load balancers and compose: ``/healthz`` (process up), ``/readyz`` (dependencies).

``/readyz`` is 503 only when the **database** fails: it is the one dependency node traffic needs
(issue 30). The broker and a Redis cache are checked and named too, but their failure answers 200
with ``"status": "degraded"`` and ``"degraded": [...]``: requests still succeed without them
(nodepool.failsafe), and taking every web process out of its load balancer because Redis is down
would turn a Redis outage back into an outage of everything.

``/readyz`` answers within ``NODEPOOL_READYZ_BUDGET`` seconds (2.5 by default, at most 3) whatever
its dependencies do: each check runs in its own thread and is given up on at the deadline. A check
still hanging from an earlier probe is not started again (it counts as failing), so a dependency
that never answers costs at most one stuck thread per check and process, not one per probe. The
503 names the failing components only; the error itself goes to the log (it may carry hosts,
ports and driver messages that anonymous callers must not read).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from celery import current_app
from django.conf import settings
from django.core.cache import caches
from django.db import connections
from django.http import JsonResponse
from django.views.decorators.http import require_GET
from kombu import Connection

from nodepool.api.errors import NOT_READY

from .api.problems import problem_response

logger = logging.getLogger(__name__)
MAX_BUDGET = 3.0
_inflight: dict[str, threading.Thread] = {}
_inflight_lock = threading.Lock()


@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


def check_database() -> None:
    """``SELECT 1`` on a connection of the probe's own thread (closed afterwards). Raises on failure."""
    connection = connections["default"]
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    finally:
        connection.close()


def check_broker() -> None:
    """Connect to the broker and declare the default queue (idempotent, and cheap on Redis).

    Connecting alone proves nothing for the embedded broker (kombu's virtual transports connect
    lazily); declaring the queue makes it open the SQLite file, or ask Redis for the queue length.
    """
    options = dict(settings.CELERY_BROKER_TRANSPORT_OPTIONS)
    if not settings.CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
        # The Redis socket timeouts would reach sqlalchemy.create_engine() and break it.
        options = {k: v for k, v in options.items() if not k.startswith("socket_")}
    with Connection(settings.CELERY_BROKER_URL, connect_timeout=2, transport_options=options) as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=2)
        conn.default_channel.queue_declare(queue=current_app.conf.task_default_queue, passive=False)


def check_cache() -> None:
    """``PING`` the Redis cache directly (past the fail-open wrapper). Raises on failure."""
    backend = caches["default"]
    client = backend._cache.get_client(None, write=True)  # django's RedisCacheClient
    client.ping()


def cache_is_redis() -> bool:
    return settings.CACHES["default"]["BACKEND"].endswith("RedisCache")


CHECKS: dict[str, Callable[[], None]] = {"database": check_database, "broker": check_broker, "cache": check_cache}
# Failing these makes the process degraded, not unready (see the module docstring).
OPTIONAL = ("broker", "cache")


def run_checks(checks: dict[str, Callable[[], None]], budget: float) -> dict[str, bool]:
    """Run ``checks`` concurrently; ``{name: passed}`` within ``budget`` seconds, whatever they do.

    A check that raises, or has not finished by the deadline, has failed; its error is logged.
    """
    results: dict[str, bool] = {}
    threads: dict[str, threading.Thread] = {}
    deadline = time.monotonic() + min(budget, MAX_BUDGET)

    def run(name: str, check: Callable[[], None]) -> None:
        try:
            check()
            results[name] = True
        except Exception:
            logger.warning("readiness check %s failed", name, exc_info=True)
            results[name] = False
        finally:
            with _inflight_lock:
                _inflight.pop(name, None)

    for name, check in checks.items():
        with _inflight_lock:
            if name in _inflight:
                logger.warning("readiness check %s is still hanging from an earlier probe", name)
                continue
            thread = threading.Thread(target=run, args=(name, check), name=f"readyz-{name}", daemon=True)
            _inflight[name] = thread
        thread.start()
        threads[name] = thread
    for name, thread in threads.items():
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            logger.warning("readiness check %s did not answer within %.1f s", name, budget)
    return {name: results.get(name, False) for name in checks}


@require_GET
def readyz(request):
    """200 when the database answers (``"status": "degraded"`` naming the broker or cache if they
    do not); 503 problem+json naming the failing ones when the database does not."""
    started = time.monotonic()
    checks_to_run = {name: check for name, check in CHECKS.items() if name != "cache" or cache_is_redis()}
    passed = run_checks(checks_to_run, settings.NODEPOOL_READYZ_BUDGET)
    checks = {name: "ok" if ok else "failed" for name, ok in passed.items()}
    elapsed_ms = round((time.monotonic() - started) * 1000, 1)
    failing = [name for name, ok in passed.items() if not ok]
    if not failing:
        return JsonResponse({"status": "ok", "checks": checks, "elapsed_ms": elapsed_ms})
    if all(name in OPTIONAL for name in failing):
        return JsonResponse({"status": "degraded", "checks": checks, "degraded": failing, "elapsed_ms": elapsed_ms})
    response = problem_response(
        503,
        NOT_READY,
        f"Not ready: {', '.join(failing)} did not answer.",
        checks=checks,
        failing=failing,
        elapsed_ms=elapsed_ms,
        retry_after=5,
    )
    response["Retry-After"] = "5"
    return response
