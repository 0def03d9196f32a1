"""Node traffic needs only the database (issue 30, item 1): Redis is an optimisation, never a
dependency of a request.

Two pieces:

* :class:`FailOpenRedisCache`, the cache backend settings use whenever ``CACHE_URL`` is Redis.
  Every cache call that fails (refused, reset, timed out) answers as a cache *miss* would —
  ``get`` → the default, ``get_many`` → ``{}``, ``add``/``set``/``touch`` → True ("go ahead"),
  ``incr`` → the delta, ``delete`` → False — and is counted in
  ``nodepool_fail_open_total{component="cache",operation}``. A failure opens a circuit for
  ``NODEPOOL_CACHE_RETRY_SECONDS`` (2 s): calls meanwhile do not touch Redis at all and are
  counted as ``operation="skipped"``, so a Redis that hangs costs one socket timeout
  (``NODEPOOL_CACHE_SOCKET_TIMEOUT``, 0.25 s) per process every 2 s, not one per call. What the
  cache holds in nodepool is a hint (the fleet population for the renewal interval, throttle
  counters, the queue kick's de-duplication): every caller works without it.
* :func:`publish`, for tasks sent from request paths: one attempt (``retry=False``), the broker's
  socket bounded by the web processes' short broker timeouts (settings), the failure logged,
  counted (``component="broker"``) and swallowed, with the same kind of circuit. Whatever such a
  task would have done, a periodic sweep does too (placement, admission's stalled-attempt sweep).

Which user-facing limits fail open, and why that is safe: the DRF throttles (anonymous, per user,
enrollment, per-node metrics) bound load, not secrets, and the database behind them has its own
limits (statement timeouts, the renewal flood gate). The limits that guard secrets never use the
cache: the login lockout (django-axes, database handler) and credential rotations per node (rows).
So no limit answers 503 because Redis is down.
"""

from __future__ import annotations

import logging
import threading
import time

from django.conf import settings
from django.core.cache.backends.redis import RedisCache
from prometheus_client import Counter

logger = logging.getLogger(__name__)

FAIL_OPEN = Counter(
    "nodepool_fail_open_total",
    "Calls to Redis (cache or broker) that failed or were skipped while its circuit was open, and "
    "were answered as if the optimisation were absent.",
    ["component", "operation"],
)


class Circuit:
    """Open for ``seconds`` after a failure: callers skip the dependency meanwhile. Per process."""

    def __init__(self, component: str, seconds_setting: str, default: float):
        self.component, self.seconds_setting, self.default = component, seconds_setting, default
        self.open_until = 0.0
        self._lock = threading.Lock()

    @property
    def seconds(self) -> float:
        return float(getattr(settings, self.seconds_setting, self.default))

    def is_open(self) -> bool:
        return time.monotonic() < self.open_until

    def failed(self, operation: str, exc: BaseException) -> None:
        FAIL_OPEN.labels(self.component, operation).inc()
        with self._lock:
            first = not self.is_open()
            self.open_until = time.monotonic() + self.seconds
        if first:  # one line per outage and process, not one per call
            logger.warning(
                "%s unavailable (%s: %s); failing open for %.1f s",
                self.component,
                type(exc).__name__,
                exc,
                self.seconds,
            )

    def skipped(self) -> None:
        FAIL_OPEN.labels(self.component, "skipped").inc()

    def reset(self) -> None:
        self.open_until = 0.0


CACHE_CIRCUIT = Circuit("cache", "NODEPOOL_CACHE_RETRY_SECONDS", 2.0)
BROKER_CIRCUIT = Circuit("broker", "NODEPOOL_BROKER_RETRY_SECONDS", 5.0)


def _fail_open(operation: str, fallback):
    def method(self, *args, **kwargs):
        if CACHE_CIRCUIT.is_open():
            CACHE_CIRCUIT.skipped()
            return fallback(*args, **kwargs) if callable(fallback) else fallback
        try:
            return getattr(super(FailOpenRedisCache, self), operation)(*args, **kwargs)
        except Exception as exc:  # redis-py's ConnectionError/TimeoutError, and anything like them
            CACHE_CIRCUIT.failed(operation, exc)
            return fallback(*args, **kwargs) if callable(fallback) else fallback

    method.__name__ = operation
    method.__doc__ = f"``{operation}``, failing open (see the module docstring)."
    return method


def _get_default(key, default=None, version=None):
    return default


def _incr_delta(key, delta=1, version=None):
    return delta


class FailOpenRedisCache(RedisCache):
    """Django's Redis cache whose calls never raise because Redis is unavailable."""

    get = _fail_open("get", _get_default)
    get_many = _fail_open("get_many", {})
    add = _fail_open("add", True)
    set = _fail_open("set", True)
    touch = _fail_open("touch", True)
    delete = _fail_open("delete", False)
    has_key = _fail_open("has_key", False)
    incr = _fail_open("incr", _incr_delta)
    set_many = _fail_open("set_many", [])
    delete_many = _fail_open("delete_many", None)
    clear = _fail_open("clear", None)


def publish(task, args: tuple | list = (), kwargs: dict | None = None, **options) -> bool:
    """Send ``task`` once, from a request path; True if the broker took it.

    ``retry=False`` (kombu's publish retries would hold the request), and a failure is counted
    (``nodepool_fail_open_total{component="broker",operation=<task name>}``), logged once per
    outage and swallowed: the caller's work is committed and a periodic sweep catches up. While
    the circuit is open (``NODEPOOL_BROKER_RETRY_SECONDS`` after a failure) nothing is sent.
    """
    if BROKER_CIRCUIT.is_open():
        BROKER_CIRCUIT.skipped()
        return False
    if args:
        options["args"] = args
    if kwargs:
        options["kwargs"] = kwargs
    try:
        task.apply_async(retry=False, **options)
    except Exception as exc:
        BROKER_CIRCUIT.failed(getattr(task, "name", "task"), exc)
        return False
    return True


def status() -> dict[str, str]:
    """``{"cache": "ok"|"failing open", "broker": ...}`` as this process last saw them."""
    return {
        circuit.component: "failing open" if circuit.is_open() else "ok" for circuit in (CACHE_CIRCUIT, BROKER_CIRCUIT)
    }
