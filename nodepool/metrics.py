"""Prometheus metrics: every metric name nodepool exports, and the ``/metrics`` endpoint.

Two kinds of metric, following the Prometheus client's guidance for multi-process servers:

* **Fleet state** (nodes, capacity, leases, drains, guards…) is read from the database at scrape
  time by collectors the apps register here (:func:`register_collector`; fleet, leases and
  maintenance do it in their ``AppConfig.ready()``). A few small queries whatever the fleet's
  size, cached for ``NODEPOOL["METRICS_CACHE_SECONDS"]`` (default 5 s) per process, so any web
  process answers the same and a burst of scrapes costs one round of queries. Figures that would
  scan every node (node counts, capacity, usage, drift) are computed by beat tasks and stored;
  collectors read what was stored (fleet.fleet_state, leases.preview.refresh_request_class_fits).
* **Events counted as they happen** (grants, placement failures, lease endings, durations) are
  per-process counters and histograms defined below. With ``PROMETHEUS_MULTIPROC_DIR`` set (the
  Procfile and docker-compose set it) every process — gunicorn workers, Celery workers — writes
  them to memory-mapped files in that directory and ``/metrics`` sums them
  (``prometheus_client.multiprocess``), so the answer is right whatever the number of processes.
  ``nodepool.procfile`` empties it when ``make run`` starts; settings name the files by hostname
  and pid so that containers sharing the directory never collide.

Labels are bounded: pool, lifecycle, liveness, health, state, reason or cause code, resource,
zone, request class. Never a node, lease or workload id (those live in the logs). Resources are
capped at :data:`MAX_RESOURCES` names (the rest add up under ``resource="other"``) because nodes
declare them. Names follow the Prometheus naming guide: base units (``_seconds``, ``_bytes``;
cpu in cores), ``_total`` for counters. docs/observability.md explains each one.

``/metrics`` needs ``Authorization: Bearer <NODEPOOL_METRICS_TOKEN>`` (settings.METRICS_TOKEN).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from django.conf import settings
from django.http import HttpResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from .api.problems import problem_response

logger = logging.getLogger(__name__)

MAX_RESOURCES = 32
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
LONG_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)

# --- per-process metrics (multiprocess-safe) ---------------------------------------------------------
LEASE_GRANTS = Counter("nodepool_lease_grants_total", "Leases granted.", ["pool"])
LEASE_GRANT_SECONDS = Histogram(
    "nodepool_lease_grant_duration_seconds",
    "Time to place and reserve one lease (filter, score, reservation transaction).",
    ["pool"],
    buckets=SECONDS_BUCKETS,
)
LEASE_PENDING_SECONDS = Histogram(
    "nodepool_lease_pending_duration_seconds",
    "From a lease request's arrival to its grant: the grant time when placed at once, the wait when queued.",
    ["pool"],
    buckets=SECONDS_BUCKETS,
)
PLACEMENT_FAILURES = Counter(
    "nodepool_placement_failures_total",
    "Unschedulable answers, counted once per reason code of the explanation (0/N nodes are available: ...).",
    ["pool", "reason"],
)
LEASE_ENDINGS = Counter(
    "nodepool_lease_endings_total",
    "Leases lost, revoked or expired, by cause (deadline, drain, quarantine, noexecute, node_lost...).",
    ["pool", "state", "cause"],
)
DRAIN_SECONDS = Histogram(
    "nodepool_drain_duration_seconds",
    "From drain start to its end (completed or forced).",
    ["pool"],
    buckets=LONG_BUCKETS,
)
ADMISSION_SECONDS = Histogram(
    "nodepool_admission_duration_seconds",
    "From enrollment to ready (admission passed).",
    ["pool"],
    buckets=LONG_BUCKETS,
)
LIVENESS_SWEEP_SECONDS = Histogram(
    "nodepool_liveness_sweep_duration_seconds", "Duration of one liveness sweep run.", buckets=SECONDS_BUCKETS
)
LIVENESS_SWEEP_POOL_FAILURES = Counter(
    "nodepool_liveness_sweep_pool_failures",
    "Pools the liveness sweep failed on (rolled back, logged and skipped; the other pools were swept).",
    ["pool"],
)
EVENTS_PRUNED = Counter("nodepool_events_pruned_total", "Events deleted by the retention task.")
LEASES_PRUNED = Counter("nodepool_leases_pruned_total", "Ended leases deleted by the retention task.")


# --- fleet state read at scrape time ------------------------------------------------------------------
Collect = Callable[[], Iterable[Metric]]
_collectors: dict[str, Collect] = {}


def register_collector(name: str, collect: Collect) -> None:
    """Register ``collect()`` → Prometheus metric families, run at scrape time (cached).

    Called from an app's ``AppConfig.ready()``; registering a name again replaces it (reloads).
    A collector that raises is logged and reported as ``nodepool_metrics_collector_up{collector}=0``;
    the rest of the scrape still answers.
    """
    _collectors[name] = collect


def gauge(name: str, documentation: str, labels: list[str], rows: Iterable[tuple]) -> GaugeMetricFamily:
    """A gauge family from ``rows`` of ``(*label values, value)``."""
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for row in rows:
        family.add_metric([str(v) for v in row[:-1]], float(row[-1] or 0))
    return family


def resource_unit(resource: str) -> tuple[str, float]:
    """(unit label, factor from canonical units): cpu millicores → cores; bytes stay bytes."""
    from .quantity import BYTE_RESOURCES, CPU

    if resource == CPU:
        return "core", 0.001
    if resource in BYTE_RESOURCES:
        return "byte", 1.0
    return "integer", 1.0


def bounded_resources(names: Iterable[str]) -> Callable[[str], str]:
    """A mapping from resource name to label value keeping at most :data:`MAX_RESOURCES` names."""
    keep = set(sorted(set(names))[:MAX_RESOURCES])
    return lambda name: name if name in keep else "other"


class FleetStateCollector:
    """Runs the registered collectors, caching their families for a few seconds (per process)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cached: list[Metric] = []
        self._at = float("-inf")

    def collect(self) -> Iterable[Metric]:
        ttl = float(getattr(settings, "NODEPOOL", {}).get("METRICS_CACHE_SECONDS", 5.0))
        with self._lock:
            if time.monotonic() - self._at >= ttl:
                self._cached = self._run()
                self._at = time.monotonic()
            return list(self._cached)

    def invalidate(self) -> None:
        with self._lock:
            self._at = float("-inf")

    def _run(self) -> list[Metric]:
        families: list[Metric] = []
        up = GaugeMetricFamily(
            "nodepool_metrics_collector_up", "1 when the collector answered in the last scrape.", labels=["collector"]
        )
        started = time.perf_counter()
        for name, collect in sorted(_collectors.items()):
            try:
                families.extend(collect())
                up.add_metric([name], 1)
            except Exception:  # one broken collector must not take /metrics down
                logger.exception("metrics collector %s failed", name)
                up.add_metric([name], 0)
        families.append(up)
        families.append(
            GaugeMetricFamily(
                "nodepool_metrics_collect_duration_seconds",
                "Time the fleet-state collectors took (database queries included).",
                value=time.perf_counter() - started,
            )
        )
        return families


FLEET_STATE = FleetStateCollector()
_fleet_registry = CollectorRegistry(auto_describe=False)
_fleet_registry.register(FLEET_STATE)


def multiprocess_dir() -> str:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")


def exposition() -> bytes:
    """The whole ``/metrics`` body: per-process metrics (summed over processes) + fleet state."""
    if multiprocess_dir():
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        per_process = generate_latest(registry)
    else:
        per_process = generate_latest(REGISTRY)
    return per_process + generate_latest(_fleet_registry)


def _authorized(request) -> bool:
    token = getattr(settings, "METRICS_TOKEN", "")
    scheme, _, supplied = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(supplied.strip(), token)


def metrics_view(request):
    """``GET /metrics``: Prometheus text exposition format 0.0.4, for a scraper holding the token.

    Responses: 200; 401 ``metrics_token_required`` (problem+json) without the right bearer token;
    405 for anything but GET/HEAD.
    """
    if request.method not in ("GET", "HEAD"):
        return problem_response(405, "method_not_allowed", "Use GET.")
    if not _authorized(request):
        response = problem_response(
            401, "metrics_token_required", "Send Authorization: Bearer <NODEPOOL_METRICS_TOKEN> to read /metrics."
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(exposition(), content_type=CONTENT_TYPE_LATEST)


def collect_queue_depth() -> Iterable[Metric]:
    """``nodepool_celery_queue_depth{queue}``: messages waiting in the default Celery queue.

    Asked through kombu (a passive declare returns the message count on Redis and on the embedded
    SQL broker alike); a broker that does not answer within 2 s leaves the metric out, and
    ``nodepool_celery_broker_up`` says so.
    """
    from celery import current_app
    from kombu import Connection

    queue = current_app.conf.task_default_queue
    depth = GaugeMetricFamily("nodepool_celery_queue_depth", "Messages waiting in the Celery queue.", labels=["queue"])
    up = 1.0
    try:
        with Connection(
            settings.CELERY_BROKER_URL, connect_timeout=2, transport_options=settings.CELERY_BROKER_TRANSPORT_OPTIONS
        ) as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=2)
            ok = conn.default_channel.queue_declare(queue=queue, passive=False)
            depth.add_metric([queue], float(ok.message_count))
    except Exception:
        logger.warning("metrics: the broker did not answer for the queue depth", exc_info=True)
        up = 0.0
    yield depth
    yield GaugeMetricFamily("nodepool_celery_broker_up", "1 when the broker answered the queue-depth probe.", value=up)
