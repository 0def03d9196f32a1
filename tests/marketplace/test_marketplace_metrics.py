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
