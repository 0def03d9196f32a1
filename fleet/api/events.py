"""Events: ``GET /events`` (the fleet's event stream) and ``GET /nodes/{id}/events`` (a node's timeline).

Scoping: operators see every event; marketplace owners only the events of their own nodes;
lease clients node events that are not about a lease, and their own leases' events.
Filters: :class:`fleet.filtersets.EventFilterSet`.
"""

from __future__ import annotations

from django.db.models import Q
from drf_spectacular.utils import extend_schema
from rest_framework import generics, serializers
from rest_framework.permissions import BasePermission

from nodepool.api.pagination import EventCursorPagination, TimelineCursorPagination
from nodepool.api.permissions import is_client, is_operator, is_owner
from nodepool.api.problems import NotFound

from ..filtersets import EventFilterSet
from ..models import NodeEvent
from ..selectors import node_queryset_for


class EventSerializer(serializers.ModelSerializer):
    node_id = serializers.UUIDField(read_only=True, allow_null=True)
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    actor = serializers.CharField(source="actor_name", read_only=True)
    summary = serializers.SerializerMethodField()

    class Meta:
        model = NodeEvent
        fields = [
            "id", "created_at", "type", "summary", "node_id", "pool", "lease_id", "workload_id", "subject_type",
            "subject_id", "from_state", "to_state", "actor_type", "actor", "reason", "request_id", "data",
        ]  # fmt: skip

    def get_summary(self, event: NodeEvent) -> str:
        """One line a person reads in a timeline: ``liveness alive → stale: missed heartbeats``."""
        change = f" {event.from_state or '∅'} → {event.to_state}" if event.to_state else ""
        reason = f": {event.reason}" if event.reason else ""
        return f"{event.type}{change}{reason}"[:300]


class CanReadEvents(BasePermission):
    message = "Only operators, owners and lease clients may read events."

    def has_permission(self, request, view):
        user = request.user
        return is_operator(user) or is_owner(user) or is_client(user)


def _own_lease_ids(user):
    """A subquery of the pks of ``user``'s own leases. Leases live in a higher app: the model is
    resolved by name (fleet never imports leases)."""
    from django.apps import apps

    return apps.get_model("leases", "Lease").objects.filter(client=user).values("pk")


# An event about a lease: its column, or (events written before the column existed) its data.
ABOUT_A_LEASE = Q(lease_id__isnull=False) | Q(data__has_key="lease_id")


def events_for(user):
    """Events ``user`` may read (see the module docstring).

    A lease client reads node events, but of the events about leases only its own: another
    client's lease events carry that lease's id, workload and fencing token, which a client must
    not learn (the same rule as ``POST /fencing/validate``).
    """
    events = NodeEvent.objects.select_related("pool")
    if is_operator(user):
        return events
    scope = Q(pk__in=[])
    if is_owner(user):
        scope |= Q(node__owner=user)
    if is_client(user):
        scope |= (Q(node__isnull=False) & ~ABOUT_A_LEASE) | Q(lease_id__in=_own_lease_ids(user))
    return events.filter(scope)


def visible_events(user, node, events, cache: dict):
    """``events`` of ``node`` (already loaded) filtered as :func:`events_for` would: for the node
    API's ``recent_events``. Operators and the node's owner read them all. ``cache`` (one per
    response) keeps the client's own lease ids across the nodes of a list."""
    if is_operator(user) or (is_owner(user) and node.owner_id == user.pk):
        return list(events)
    if not is_client(user):
        return []
    if "own_lease_ids" not in cache:
        cache["own_lease_ids"] = {str(pk) for pk in _own_lease_ids(user).values_list("pk", flat=True)}
    own = cache["own_lease_ids"]

    def about_a_lease(event) -> bool:
        return event.lease_id is not None or "lease_id" in (event.data or {})

    return [e for e in events if not about_a_lease(e) or str(e.lease_id) in own]


class EventList(generics.ListAPIView):
    """``GET /events``: newest first, cursor-paginated; filters node, pool, lease, workload, type
    (repeatable), actor, since/until (ISO 8601 with offset; since inclusive, until exclusive)."""

    serializer_class = EventSerializer
    permission_classes = [CanReadEvents]
    pagination_class = EventCursorPagination
    filterset_class = EventFilterSet

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return NodeEvent.objects.none()
        return events_for(self.request.user)


class NodeEventTimeline(EventList):
    """``GET /nodes/{id}/events``: one node's story, oldest first (enrollment, admission checks,
    policy, placements, heartbeat gaps, recovery…), with the same filters. 404 for a node the user
    may not see."""

    pagination_class = TimelineCursorPagination

    @extend_schema(operation_id="v1_nodes_events_list")
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return NodeEvent.objects.none()
        node = node_queryset_for(self.request.user).filter(pk=self.kwargs["pk"]).values("pk").first()
        if node is None:
            raise NotFound("No such node.", "node_not_found")
        return events_for(self.request.user).filter(node_id=node["pk"])
