"""Pricing for ``/metrics``: the price in force per pool and resource, in the base unit of
``nodepool_pool_allocated`` so that PromQL can multiply the two (docs/observability.md, the cost
SLI). Registered in ``MarketplaceConfig.ready()``."""

from __future__ import annotations

from collections.abc import Iterable

from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, Metric

from nodepool.metrics import resource_unit

from .models import PoolPrice
from .pricing import unit_of


def collect() -> Iterable[Metric]:
    """``nodepool_pool_price_per_resource_hour{pool,resource,unit,currency}``: the latest price
    version with ``effective_from`` not after now, divided down to one base unit (a core, a byte,
    one device) per hour. Pools or resources without a price get no sample."""
    family = GaugeMetricFamily(
        "nodepool_pool_price_per_resource_hour",
        "Price in force of one base unit (core, byte, device) for one hour, per pool and resource.",
        labels=["pool", "resource", "unit", "currency"],
    )
    rows = (
        PoolPrice.objects.filter(effective_from__lte=timezone.now())
        .order_by("pool__name", "resource", "-effective_from")
        .values_list("pool__name", "resource", "unit_price", "currency")
    )
    seen = set()
    for pool, resource, price, currency in rows:
        if (pool, resource) in seen:
            continue  # an older version
        seen.add((pool, resource))
        unit, factor = resource_unit(resource)
        family.add_metric([pool, resource, unit, currency], float(price) / (float(unit_of(resource)) * factor))
    yield family
