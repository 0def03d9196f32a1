"""Filters of marketplace lists built on django-filter: ``GET /pool-prices``, ``/usage-records``,
``/statements``, ``/appeals`` and ``/owned-leases``. Each is a StrictFilterSet: an unknown
parameter or a bad value is 400 ``invalid_filter`` (docs/api-contract.md, "Query parameters")."""

from __future__ import annotations

import django_filters

from leases.choices import LeaseState
from leases.models import Lease
from nodepool.api.filters import StrictFilterSet

from .choices import AppealState, StatementState, UsageState
from .models import Appeal, PoolPrice, Statement, UsageRecord


class PoolPriceFilterSet(StrictFilterSet):
    """``GET /pool-prices?pool=``."""

    pool = django_filters.CharFilter(field_name="pool__name")

    class Meta:
        model = PoolPrice
        fields = ["pool"]


class UsageRecordFilterSet(StrictFilterSet):
    """``GET /usage-records?state=&node=`` (``state`` repeated: any of them)."""

    state = django_filters.MultipleChoiceFilter(choices=UsageState.choices)
    node = django_filters.UUIDFilter(field_name="node_id")

    class Meta:
        model = UsageRecord
        fields = ["state", "node"]


class StatementFilterSet(StrictFilterSet):
    """``GET /statements?state=open|final``."""

    state = django_filters.MultipleChoiceFilter(choices=StatementState.choices)

    class Meta:
        model = Statement
        fields = ["state"]


class AppealFilterSet(StrictFilterSet):
    """``GET /appeals?state=`` (``state=open``: the operators' queue)."""

    state = django_filters.MultipleChoiceFilter(choices=AppealState.choices)

    class Meta:
        model = Appeal
        fields = ["state"]


class OwnedLeaseFilterSet(StrictFilterSet):
    """``GET /owned-leases?node=&state=``."""

    node = django_filters.UUIDFilter(field_name="node_id")
    state = django_filters.MultipleChoiceFilter(choices=LeaseState.choices)

    class Meta:
        model = Lease
        fields = ["node", "state"]
