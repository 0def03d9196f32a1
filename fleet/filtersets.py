"""Filters of the node list: pool, lifecycle, liveness, owner, label, schedulable."""

from __future__ import annotations

import django_filters
from django.db.models.fields.json import KeyTransform
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field

from nodepool.api.problems import Problem

from .capability import label_key_ok
from .choices import Lifecycle, Liveness
from .models import Node
from .selectors import schedulable_q


def _label_filter(queryset, column: str, values: list[str]):
    """``key=value`` (exact) or ``key`` (present) on a JSON label column; repeatable (AND)."""
    for index, raw in enumerate(values):
        key, eq, value = raw.partition("=")
        if not label_key_ok(key):
            raise Problem(f"label filter {raw!r}: expected key=value or key", "invalid_filter")
        if eq:
            # KeyTransform compares JSON values on SQLite and PostgreSQL alike, and takes the
            # key whole, so keys with dots, slashes or '__' (topology.kubernetes.io/zone) stay one key.
            alias = f"_{column}_{index}"
            queryset = queryset.alias(**{alias: KeyTransform(key, column)}).filter(**{alias: value})
        else:
            queryset = queryset.filter(**{f"{column}__has_key": key})
    return queryset


class NodeFilterSet(django_filters.FilterSet):
    pool = django_filters.CharFilter(field_name="pool__name")
    lifecycle = django_filters.MultipleChoiceFilter(choices=Lifecycle.choices)
    liveness = django_filters.MultipleChoiceFilter(choices=Liveness.choices)
    owner = django_filters.CharFilter(field_name="owner__username")
    hostname = django_filters.CharFilter(field_name="hostname")
    label = django_filters.CharFilter(method="filter_label", help_text="key=value or key; repeat for AND")
    node_label = django_filters.CharFilter(method="filter_node_label", help_text="on node-declared labels")
    # A strict choice, not BooleanFilter: "perhaps" must be a 400, not silently ignored.
    schedulable = django_filters.TypedChoiceFilter(
        choices=[("true", "true"), ("false", "false")], coerce=lambda v: v == "true", method="filter_schedulable"
    )

    class Meta:
        model = Node
        fields = ["pool", "lifecycle", "liveness", "owner", "hostname"]

    def _values(self, name: str) -> list[str]:
        return [v for v in self.data.getlist(name) if v] if hasattr(self.data, "getlist") else [self.data[name]]

    def filter_label(self, queryset, name, value):
        return _label_filter(queryset, "labels", self._values("label"))

    def filter_node_label(self, queryset, name, value):
        return _label_filter(queryset, "node_labels", self._values("node_label"))

    @extend_schema_field(OpenApiTypes.BOOL)
    def filter_schedulable(self, queryset, name, value):
        query = schedulable_q()
        return queryset.filter(query) if value in (True, "true") else queryset.exclude(query)
