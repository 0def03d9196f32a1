import django_filters
from django import forms

from nodepool.api.filters import StrictFilterSet

from .choices import LeaseRequestState, LeaseState
from .models import ConsistencyReport, Lease, LeaseRequest, Shape


class LeaseFilterSet(StrictFilterSet):
    state = django_filters.MultipleChoiceFilter(choices=LeaseState.choices)
    pool = django_filters.CharFilter(field_name="pool__name")
    node = django_filters.UUIDFilter(field_name="node_id")

    class Meta:
        model = Lease
        fields = ["state", "workload_id", "pool", "node", "group"]


class LeaseRequestFilterSet(StrictFilterSet):
    state = django_filters.MultipleChoiceFilter(choices=LeaseRequestState.choices)
    pool = django_filters.CharFilter(field_name="pool__name")

    class Meta:
        model = LeaseRequest
        fields = ["state", "workload_id", "pool"]


class IntegerFilter(django_filters.NumberFilter):
    """A whole number: django-filter's NumberFilter takes decimals (``?version=0.5`` matched nothing
    instead of being refused)."""

    field_class = forms.IntegerField


class ShapeFilterSet(StrictFilterSet):
    """``GET /shapes?name=&version=``."""

    version = IntegerFilter()

    class Meta:
        model = Shape
        fields = ["name", "version"]


class ConsistencyReportFilterSet(StrictFilterSet):
    """``GET /lease-consistency-reports`` has no filters: any parameter but a page's is refused."""

    class Meta:
        model = ConsistencyReport
        fields: list[str] = []
