import django_filters

from .choices import LeaseRequestState, LeaseState
from .models import Lease, LeaseRequest


class LeaseFilterSet(django_filters.FilterSet):
    state = django_filters.MultipleChoiceFilter(choices=LeaseState.choices)
    pool = django_filters.CharFilter(field_name="pool__name")
    node = django_filters.UUIDFilter(field_name="node_id")

    class Meta:
        model = Lease
        fields = ["state", "workload_id", "pool", "node", "group"]


class LeaseRequestFilterSet(django_filters.FilterSet):
    state = django_filters.MultipleChoiceFilter(choices=LeaseRequestState.choices)
    pool = django_filters.CharFilter(field_name="pool__name")

    class Meta:
        model = LeaseRequest
        fields = ["state", "workload_id", "pool"]
