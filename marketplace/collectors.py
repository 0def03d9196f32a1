"""Pricing for ``/metrics``: the price in force per pool and resource, in the base unit of
``nodepool_pool_allocated`` so that PromQL can multiply the two (docs/observability.md, the cost
SLI). Registered in ``MarketplaceConfig.ready()``."""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Count
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, Metric

from fleet.models import Pool
from nodepool.metrics import resource_unit

from .choices import PoolPeriodState
from .line_appeals import appeals_open_longer_than_allowed
from .models import MismatchItem, PayoutDelivery, PayoutHold, PoolPeriod, PoolPrice
from .pricing import unit_of
from .webhooks import MAX_ATTEMPTS


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


def collect_money() -> Iterable[Metric]:
    """The money's signals (docs/observability.md; alerts in deploy/prometheus/alerts.yml):

    ``nodepool_marketplace_pool_periods{pool,state}`` periods per state (every state of every pool,
    zeros included); ``nodepool_marketplace_mismatch_items_open{pool}``;
    ``nodepool_marketplace_payout_holds_open`` statements' unreleased payout holds;
    ``nodepool_marketplace_line_appeals_overdue`` line appeals open longer than their pool's
    ``appeal_alert_after``; ``nodepool_marketplace_payout_webhooks_undelivered{state}`` payout
    webhook notices not delivered: ``pending`` (will be retried) and ``gave_up`` (attempts spent)."""
    periods = GaugeMetricFamily(
        "nodepool_marketplace_pool_periods", "Pool settlement periods per state.", labels=["pool", "state"]
    )
    counts: dict[str, dict[str, int]] = {name: {} for name in Pool.objects.values_list("name", flat=True)}
    for pool, state, count in PoolPeriod.objects.values_list("pool__name", "state").annotate(n=Count("id")):
        counts.setdefault(pool, {})[state] = count
    for pool in sorted(counts):
        for state in PoolPeriodState.values:
            periods.add_metric([pool, state], counts[pool].get(state, 0))
    yield periods
    items = GaugeMetricFamily(
        "nodepool_marketplace_mismatch_items_open", "Mismatch items waiting for an operator.", labels=["pool"]
    )
    for pool, count in (
        MismatchItem.objects.filter(resolved_at__isnull=True)
        .values_list("period__pool__name")
        .annotate(n=Count("id"))
        .order_by()
    ):
        items.add_metric([pool], count)
    yield items
    yield GaugeMetricFamily(
        "nodepool_marketplace_payout_holds_open",
        "Payout holds not released (final statements that cannot be paid).",
        value=PayoutHold.objects.filter(released_at__isnull=True).count(),
    )
    yield GaugeMetricFamily(
        "nodepool_marketplace_line_appeals_overdue",
        "Line appeals open longer than their pool's appeal_alert_after.",
        value=appeals_open_longer_than_allowed(timezone.now()),
    )
    undelivered = GaugeMetricFamily(
        "nodepool_marketplace_payout_webhooks_undelivered",
        "Payout webhook notices not delivered: pending (retried) or gave_up (attempts spent).",
        labels=["state"],
    )
    waiting = PayoutDelivery.objects.filter(delivered_at__isnull=True)
    undelivered.add_metric(["pending"], waiting.filter(attempts__lt=MAX_ATTEMPTS).count())
    undelivered.add_metric(["gave_up"], waiting.filter(attempts__gte=MAX_ATTEMPTS).count())
    yield undelivered
