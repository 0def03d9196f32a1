"""Filters of the node list (pool, lifecycle, liveness, owner, label, schedulable), of events and of
bootstrap tokens. Every filter set of the API is a :class:`nodepool.api.filters.StrictFilterSet`:
it refuses what it does not understand (docs/api-contract.md, "Query parameters")."""

from __future__ import annotations

import re

import django_filters
from django.db.models import F, Q
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field

from nodepool.api.errors import INVALID_FILTER, TIMEZONE_REQUIRED
from nodepool.api.filters import StrictFilterSet
from nodepool.api.problems import Problem

from . import event_types
from .choices import Lifecycle, Liveness
from .labelselector import NODE_DECLARED, PLACEMENT, SelectorError, filter_nodes, parse_selector
from .models import BootstrapToken, Node, NodeEvent
from .selectors import schedulable_q


def _label_filter(queryset, values: list[str], view: str):
    """Each value a Kubernetes label selector (``zone=a,gpu``, ``zone in (a,b)``, ``!spot``, ``gen>3``…;
    see :mod:`fleet.labelselector`) on the node label set ``view``; repeated values must all hold (AND).

    Raises:
        Problem: 400 ``invalid_filter`` for a malformed selector (nothing is filtered then).
    """
    for raw in values:
        try:
            parse_selector(raw)
        except SelectorError as exc:
            raise Problem(f"label selector {raw[:200]!r}: {exc}", INVALID_FILTER) from exc
    return filter_nodes(queryset, values, view=view)


class NodeFilterSet(StrictFilterSet):
    pool = django_filters.CharFilter(field_name="pool__name")
    lifecycle = django_filters.MultipleChoiceFilter(choices=Lifecycle.choices)
    liveness = django_filters.MultipleChoiceFilter(choices=Liveness.choices)
    owner = django_filters.CharFilter(field_name="owner__username")
    hostname = django_filters.CharFilter(field_name="hostname")
    label = django_filters.CharFilter(
        method="filter_label",
        help_text=(
            "Kubernetes label selector (all of its grammar: k=v,k!=v,k in (a,b),k notin (a),k,!k,k>1,k<7) on the "
            "labels placement matches: platform, pool, identity and verified-feature labels, and node-declared "
            "labels where the pool trusts them; repeat for AND"
        ),
    )
    node_label = django_filters.CharFilter(
        method="filter_node_label", help_text="the same grammar, on the labels the node declares (trusted or not)"
    )
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
        return _label_filter(queryset, self._values("label"), PLACEMENT)

    def filter_node_label(self, queryset, name, value):
        return _label_filter(queryset, self._values("node_label"), NODE_DECLARED)

    @extend_schema_field(OpenApiTypes.BOOL)
    def filter_schedulable(self, queryset, name, value):
        query = schedulable_q()
        return queryset.filter(query) if value in (True, "true") else queryset.exclude(query)


class EventFilterSet(StrictFilterSet):
    """Filters of ``GET /events`` and ``GET /nodes/{id}/events``; every filter combines with AND."""

    node = django_filters.UUIDFilter(field_name="node_id")
    pool = django_filters.CharFilter(field_name="pool__name")
    lease = django_filters.UUIDFilter(method="filter_lease")
    workload = django_filters.CharFilter(field_name="workload_id")
    type = django_filters.MultipleChoiceFilter(choices=event_types.choices)  # every app's types
    actor = django_filters.CharFilter(field_name="actor_name")
    since = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    until = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="lt")

    class Meta:
        model = NodeEvent
        fields = ["node", "pool", "lease", "workload", "type", "actor", "since", "until"]

    def filter_lease(self, queryset, name, value):
        # Lease events written before lease_id existed carry it in data only.
        return queryset.filter(Q(lease_id=value) | Q(data__lease_id=str(value)))

    def filter_queryset(self, queryset):
        for name in ("since", "until"):
            raw = self.data.get(name) or ""
            # The form would read a time without an offset in the server's zone: refuse it instead.
            if raw and not re.search(r"(Z|[+-]\d\d:?\d\d)$", raw.strip()):
                raise Problem(f"{name}: give a time zone offset (e.g. 2026-01-01T00:00:00Z)", TIMEZONE_REQUIRED)
        since, until = self.form.cleaned_data.get("since"), self.form.cleaned_data.get("until")
        if since and until and since >= until:
            raise Problem("since must be before until", INVALID_FILTER)
        return super().filter_queryset(queryset)


BOOTSTRAP_TOKEN_STATES = [(s, s) for s in ("active", "exhausted", "expired", "revoked")]


class BootstrapTokenFilterSet(StrictFilterSet):
    """``GET /bootstrap-tokens?pool=&state=``; ``state`` is the listed token's state (repeat for OR)."""

    pool = django_filters.CharFilter(field_name="pool__name")
    state = django_filters.MultipleChoiceFilter(choices=BOOTSTRAP_TOKEN_STATES, method="filter_state")

    class Meta:
        model = BootstrapToken
        fields = ["pool", "state"]

    def filter_state(self, queryset, name, value):
        now = timezone.now()
        unrevoked, live = Q(revoked_at__isnull=True), Q(revoked_at__isnull=True, expires_at__gt=now)
        states = {
            "revoked": Q(revoked_at__isnull=False),
            "expired": unrevoked & Q(expires_at__lte=now),
            "exhausted": live & Q(uses__gte=F("max_uses")),
            "active": live & Q(uses__lt=F("max_uses")),
        }
        query = Q()
        for state in value:
            query |= states[state]
        return queryset.filter(query)
