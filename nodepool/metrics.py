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

import copy
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from celery import current_app
from django.conf import settings
from django.http import HttpResponse
from django.utils import timezone
from kombu import Connection
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

from nodepool.api.errors import METHOD_NOT_ALLOWED, METRICS_TOKEN_REQUIRED

from . import conf
from .api.problems import problem_response
from .models import MetricBaseline
from .quantity import BYTE_RESOURCES, CPU

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
        ttl = conf.get("METRICS_CACHE_SECONDS")
        with self._lock:
            if time.monotonic() - self._at >= ttl:
                self._cached = self._run()
                self._at = time.monotonic()
            return list(self._cached)

    def invalidate(self) -> None:
        with self._lock:
            self._at = float("-inf")
        _OBJECTS.clear()

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


# --- series follow the objects ---------------------------------------------------------------------
# A per-process counter keeps its value for a pool that no longer exists: ``remove()`` reaches only
# the current process, and a dead process's multiprocess file persists. So /metrics keeps a series
# whose label names an object only while that object exists, whichever process counted it, and a
# re-created object of the same name starts from zero (the values at its predecessor's deletion,
# stored by :func:`forget_object`, are subtracted).
Owners = Callable[[], dict]
_owners: dict[str, tuple[str | None, Owners]] = {}


def register_object_label(label: str, existing: Owners, *, parent: str | None = None) -> None:
    """Export series labelled ``label`` only for objects that exist (called in ``AppConfig.ready()``).

    ``existing()`` returns ``{value: created_at}`` of the objects that exist now (one small query,
    run at each scrape); with ``parent`` (another object label, e.g. ``request_class`` within
    ``pool``) its keys are ``(parent value, value)`` pairs. A sample whose label value is not among
    them is left out of /metrics; one whose object was created after a :class:`MetricBaseline` of
    the same value starts from that baseline (per-process metrics only).
    """
    _owners[label] = (parent, existing)


def _sample_key(name: str, labels: dict) -> str:
    return name + "|" + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _per_process_families() -> list[Metric]:
    if multiprocess_dir():
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return list(registry.collect())
    return list(REGISTRY.collect())


def forget_object(label: str, value: str, *, now=None) -> None:
    """Record the per-process series of object ``label=value`` as it is deleted (call inside the
    deleting transaction): its series vanish from /metrics at once (the object no longer exists),
    and an object created later under the same name starts from zero."""
    samples = {
        _sample_key(sample.name, sample.labels): sample.value
        for family in _per_process_families()
        for sample in family.samples
        if sample.labels.get(label) == value and not sample.name.endswith("_created")
    }
    MetricBaseline.objects.update_or_create(
        label=label, value=value, defaults={"taken_at": now or timezone.now(), "samples": samples}
    )
    _OBJECTS.clear()


class _ObjectFilter:
    """Filters families (and offsets per-process ones) against the objects that exist, per scrape."""

    def __init__(self):
        self.objects = {label: (parent, existing()) for label, (parent, existing) in _owners.items()}
        self.offsets: dict[str, float] = {}
        for baseline in MetricBaseline.objects.filter(label__in=list(self.objects)):
            parent, objects = self.objects[baseline.label]
            created = objects.get(baseline.value) if parent is None else None
            if created is not None and created > baseline.taken_at:
                self.offsets.update(baseline.samples)

    def keep(self, labels: dict) -> bool:
        for label, (parent, objects) in self.objects.items():
            if label in labels:
                key = labels[label] if parent is None else (labels.get(parent, ""), labels[label])
                if key not in objects:
                    return False
        return True

    def apply(self, families: list[Metric]) -> list[Metric]:
        out = []
        for family in families:
            family = copy.copy(family)
            kept = []
            for sample in family.samples:
                if not self.keep(sample.labels):
                    continue
                offset = self.offsets.get(_sample_key(sample.name, sample.labels))
                if offset:
                    # Below its baseline the series was reset since (the multiprocess directory is
                    # emptied when the service starts): counting from zero is already right.
                    value = sample.value - offset if sample.value >= offset else sample.value
                    sample = sample._replace(value=value)
                kept.append(sample)
            family.samples = kept
            out.append(family)
        return out


_OBJECTS: list = []  # [(monotonic time, _ObjectFilter)]: the objects as read at most a cache window ago


def _object_filter() -> _ObjectFilter:
    """The objects that exist, read at most ``METRICS_CACHE_SECONDS`` ago in this process (as the
    fleet state: a burst of scrapes costs one round of queries; Prometheus scrapes every 15 s, so
    the next scrape after a deletion no longer shows its series). A deletion in this process
    empties it at once (:func:`forget_object`)."""
    ttl = conf.get("METRICS_CACHE_SECONDS")
    if _OBJECTS and time.monotonic() - _OBJECTS[0][0] < ttl:
        return _OBJECTS[0][1]
    objects = _ObjectFilter()
    _OBJECTS[:] = [(time.monotonic(), objects)]
    return objects


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _latest(families: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


def exposition() -> bytes:
    """The whole ``/metrics`` body: per-process metrics (summed over processes), each series whose
    label names an object kept only while that object exists (:func:`register_object_label`), +
    fleet state (read from the database: only objects that exist, already)."""
    families = _per_process_families()
    if _owners:
        try:
            families = _object_filter().apply(families)
        except Exception:  # the filter reads the database: it must never take /metrics down
            logger.exception("metrics: the object filter failed; series of deleted objects may show")
    return _latest(families) + generate_latest(_fleet_registry)


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
        return problem_response(405, METHOD_NOT_ALLOWED, "Use GET.")
    if not _authorized(request):
        response = problem_response(
            401, METRICS_TOKEN_REQUIRED, "Send Authorization: Bearer <NODEPOOL_METRICS_TOKEN> to read /metrics."
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
