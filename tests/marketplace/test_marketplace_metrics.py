"""The price in force per pool and resource on /metrics, in the unit of nodepool_pool_allocated,
for the cost SLI (docs/observability.md; the recording rule is tested by promtool)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from marketplace.pricing import set_price
from tests.factories import PoolFactory
from tests.metrics_support import scrape, value

pytestmark = pytest.mark.django_db


def test_the_price_in_force_is_exported_per_base_unit_hour(client):
    pool = PoolFactory(name="gpu")
    now = timezone.now()
    price = {"pool": pool, "currency": "EUR"}
    set_price(resource="cpu", unit_price=Decimal("0.04"), effective_from=now - timedelta(days=2), **price)
    set_price(resource="cpu", unit_price=Decimal("0.05"), effective_from=now - timedelta(days=1), **price)
    set_price(resource="cpu", unit_price=Decimal("0.09"), effective_from=now + timedelta(days=1), **price)  # later
    set_price(resource="memory", unit_price=Decimal("0.01"), effective_from=now - timedelta(days=1), **price)
    set_price(resource="nvidia.com/gpu", unit_price=Decimal("2"), effective_from=now - timedelta(hours=1), **price)

    text = scrape(client)
    name = "nodepool_pool_price_per_resource_hour"
    assert value(text, name, pool="gpu", resource="cpu", unit="core", currency="EUR") == pytest.approx(0.05)
    assert value(text, name, pool="gpu", resource="memory", unit="byte", currency="EUR") == pytest.approx(0.01 / 2**30)
    assert value(text, name, pool="gpu", resource="nvidia.com/gpu", unit="integer", currency="EUR") == 2


def test_the_money_signals_count_mismatched_periods_open_holds_overdue_appeals_and_undelivered_webhooks(owner):
    from datetime import UTC, datetime, timedelta

    from marketplace.collectors import collect_money
    from marketplace.models import Payout, PayoutDelivery, PayoutHold, PoolPeriod, Statement
    from tests.factories import PoolFactory

    pool = PoolFactory(name="money")
    start = datetime(2026, 11, 2, tzinfo=UTC)
    PoolPeriod.objects.create(
        pool=pool, period="day", period_start=start, period_end=start + timedelta(days=1), state="mismatched"
    )
    statement = Statement.objects.create(
        owner=owner, period="day", period_start=start, period_end=start + timedelta(days=1)
    )
    PayoutHold.objects.create(statement=statement, reason="outlier", message="x", created_at=start)
    payout = Payout.objects.create(
        statement=statement, owner=owner, currency="EUR", amount=1, requested_by=owner, requested_at=start
    )
    for attempts in (1, 12):
        PayoutDelivery.objects.create(
            payout=payout, body={}, created_at=start, next_attempt_at=start, attempts=attempts
        )
    families = {f.name: f for f in collect_money()}
    periods = {tuple(s.labels.values()): s.value for s in families["nodepool_marketplace_pool_periods"].samples}
    assert periods[("money", "mismatched")] == 1 and periods[("money", "reconciled")] == 0
    assert families["nodepool_marketplace_payout_holds_open"].samples[0].value == 1
    assert families["nodepool_marketplace_line_appeals_overdue"].samples[0].value == 0
    undelivered = {
        s.labels["state"]: s.value for s in families["nodepool_marketplace_payout_webhooks_undelivered"].samples
    }
    assert undelivered == {"pending": 1, "gave_up": 1}
