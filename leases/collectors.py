"""Lease state for ``/metrics``: live leases, pending requests and their age, "can serve N now"
per request class, and the latest capacity consistency check. Registered in ``ready()``."""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Count, Min
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, Metric

from fleet.collectors import counts_by_pool
from fleet.models import Pool
from nodepool.metrics import gauge

from .choices import LIVE_LEASE_STATES, LeaseRequestState
from .models import ConsistencyReport, Lease, LeaseRequest


def collect() -> Iterable[Metric]:
    now = timezone.now()
    pools = list(Pool.objects.order_by("name"))
    names = {pool.pk: pool.name for pool in pools}
    yield gauge(
        "nodepool_leases",
        "Live leases by pool and state.",
        ["pool", "state"],
        counts_by_pool(names, Lease.objects.filter(state__in=LIVE_LEASE_STATES), "pool", "state"),
    )
    pending = {
        pool: (n, oldest)
        for pool, n, oldest in LeaseRequest.objects.filter(state=LeaseRequestState.PENDING)
        .values_list("pool")
        .annotate(n=Count("id"), oldest=Min("created_at"))
        .order_by()
    }
    yield gauge(
        "nodepool_lease_requests_pending",
        "Queued lease requests waiting for capacity.",
        ["pool"],
        ((pool.name, pending.get(pool.pk, (0, None))[0]) for pool in pools),
    )
    yield gauge(
        "nodepool_lease_request_oldest_pending_age_seconds",
        "Age of the oldest queued lease request (0 when none waits).",
        ["pool"],
        ((pool.name, (now - pending[pool.pk][1]).total_seconds() if pool.pk in pending else 0.0) for pool in pools),
    )
    fits = GaugeMetricFamily(
        "nodepool_pool_request_class_fits",
        "How many leases of each of the pool's request classes fit ('can serve N now'; refreshed every 30 s).",
        labels=["pool", "request_class"],
    )
    fits_at = GaugeMetricFamily(
        "nodepool_pool_request_class_fits_timestamp_seconds",
        "When the pool's request classes were last evaluated (Unix time).",
        labels=["pool"],
    )
    for pool in pools:
        for name, n in sorted((pool.request_class_fits or {}).items()):
            if n is not None and any(c.get("name") == name for c in pool.request_classes or []):
                fits.add_metric([pool.name, name], float(n))
        if pool.request_class_fits_at is not None:
            fits_at.add_metric([pool.name], pool.request_class_fits_at.timestamp())
    yield fits
    yield fits_at
    report = ConsistencyReport.objects.order_by("-checked_at").values_list("checked_at", "drift").first()
    if report is not None:
        yield GaugeMetricFamily(
            "nodepool_capacity_drift_resources",
            "Node resources whose allocated amount disagreed with their live leases at the last consistency check.",
            value=len(report[1] or []),
        )
        yield GaugeMetricFamily(
            "nodepool_capacity_check_timestamp_seconds",
            "When the capacity consistency check last ran (Unix time).",
            value=report[0].timestamp(),
        )
