"""Filters of marketplace lists built on django-filter: ``GET /pool-prices``."""

from __future__ import annotations

import django_filters

from nodepool.api.filters import StrictFilterSet

from .models import PoolPrice


class PoolPriceFilterSet(StrictFilterSet):
    """``GET /pool-prices?pool=``."""

    pool = django_filters.CharFilter(field_name="pool__name")

    class Meta:
        model = PoolPrice
        fields = ["pool"]
