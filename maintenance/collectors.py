"""Maintenance state for ``/metrics``: active drains and open quarantines (registered in ``ready()``)."""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Count
from prometheus_client.core import Metric

from fleet.collectors import counts_by_pool, samples_per_pool
from fleet.models import Pool
from nodepool.metrics import gauge

from .choices import DrainState
from .models import Drain, Quarantine


def collect() -> Iterable[Metric]:
    pools = dict(Pool.objects.values_list("pk", "name"))
    active = Drain.objects.filter(state=DrainState.ACTIVE).values_list("node__pool").annotate(n=Count("id")).order_by()
    yield gauge("nodepool_drains_active", "Drains in progress.", ["pool"], samples_per_pool(pools, active))
    yield gauge(
        "nodepool_quarantines_active",
        "Open quarantines (not released) by the rule that opened them.",
        ["pool", "rule"],
        counts_by_pool(pools, Quarantine.objects.filter(released_at__isnull=True), "node__pool", "rule"),
    )
