"""Filters of the pool-operations lists: ``GET /upgrades``, ``GET /scale-decisions``, ``GET /machines``."""

from __future__ import annotations

import django_filters

from nodepool.api.filters import StrictFilterSet

from .choices import UpgradeState
from .models import ProviderMachine, ScaleDecision, Upgrade


class UpgradeFilterSet(StrictFilterSet):
    """``GET /upgrades?pool=&state=`` (``state`` repeated: any of them)."""

    pool = django_filters.CharFilter(field_name="pool__name")
    state = django_filters.MultipleChoiceFilter(choices=UpgradeState.choices)

    class Meta:
        model = Upgrade
        fields = ["pool", "state"]


class ScaleDecisionFilterSet(StrictFilterSet):
    """``GET /scale-decisions?pool=``."""

    pool = django_filters.CharFilter(field_name="pool__name")

    class Meta:
        model = ScaleDecision
        fields = ["pool"]


class MachineFilterSet(StrictFilterSet):
    """``GET /machines?pool=``."""

    pool = django_filters.CharFilter(field_name="pool__name")

    class Meta:
        model = ProviderMachine
        fields = ["pool"]
