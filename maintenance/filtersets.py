import django_filters

from nodepool.api.filters import StrictFilterSet

from .choices import DrainState, EvictionPolicy, QuarantineRule
from .models import Drain, Quarantine


class DrainFilterSet(StrictFilterSet):
    node = django_filters.UUIDFilter(field_name="node_id")
    pool = django_filters.CharFilter(field_name="node__pool__name")
    state = django_filters.MultipleChoiceFilter(choices=DrainState.choices)
    policy = django_filters.ChoiceFilter(choices=EvictionPolicy.choices)

    class Meta:
        model = Drain
        fields = ["node", "pool", "state", "policy"]


class QuarantineFilterSet(StrictFilterSet):
    node = django_filters.UUIDFilter(field_name="node_id")
    pool = django_filters.CharFilter(field_name="node__pool__name")
    rule = django_filters.ChoiceFilter(choices=QuarantineRule.choices)
    # A strict choice, not BooleanFilter: that one silently ignores "maybe" instead of answering 400.
    open = django_filters.ChoiceFilter(choices=[("true", "true"), ("false", "false")], method="filter_open")

    class Meta:
        model = Quarantine
        fields = ["node", "pool", "rule", "open"]

    def filter_open(self, queryset, name, value):
        return queryset.filter(released_at__isnull=(value == "true"))
