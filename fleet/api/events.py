"""Events: ``GET /events`` (the fleet's event stream) and ``GET /nodes/{id}/events`` (a node's timeline).

Scoping: operators see every event; marketplace owners only the events of their own nodes;
lease clients node events that are not about a lease, and their own leases' events, never the
owner-private types (declared ``private`` in :mod:`fleet.event_types`: appeals, statements).
What a caller reads of an event's ``data`` is redacted too (:func:`data_for`): lease ids listed in
it (a drain's ``checkpoint_leases``, ``waiting_on[].lease_ids``…) are shown to a lease client only
when they are its own; operators and the node's owner read them all.
Filters: :class:`fleet.filtersets.EventFilterSet`.
"""

from __future__ import annotations

import copy

from django.apps import apps
from django.core.exceptions import ValidationError
from django.db.models import Case, F, IntegerField, Q, Value, When
from drf_spectacular.utils import extend_schema
from rest_framework import generics, serializers
from rest_framework.permissions import BasePermission

from nodepool.api.pagination import EventCursorPagination, TimelineCursorPagination
from nodepool.api.permissions import is_client, is_operator, is_owner
from nodepool.api.problems import NotFound

from .. import event_types
from ..errors import NODE_NOT_FOUND
from ..filtersets import EventFilterSet
from ..models import NodeEvent
from ..selectors import node_queryset_for


class _EventListSerializer(serializers.ListSerializer):
    """Looks up, in one query per page, which of the lease ids the page's events name are the
    caller's own (:func:`prime_own_leases`), rather than one query per event."""

    def to_representation(self, data):
        events = list(data.all() if hasattr(data, "all") else data)
        request = self.context.get("request")
        if request is not None:
            prime_own_leases(
                request.user, events, self.context.setdefault("event_visibility", {}),
                owner_of=lambda event: getattr(event, "node_owner_pk", None),
            )  # fmt: skip
        return super().to_representation(events)


class EventSerializer(serializers.ModelSerializer):
    node_id = serializers.UUIDField(read_only=True, allow_null=True)
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    actor = serializers.CharField(source="actor_name", read_only=True)
    summary = serializers.SerializerMethodField()

    class Meta:
        model = NodeEvent
        list_serializer_class = _EventListSerializer
        fields = [
            "id", "created_at", "type", "summary", "node_id", "pool", "lease_id", "workload_id", "subject_type",
            "subject_id", "from_state", "to_state", "actor_type", "actor", "reason", "request_id", "data",
        ]  # fmt: skip

    def to_representation(self, event: NodeEvent) -> dict:
        body = super().to_representation(event)
        request = self.context.get("request")
        if request is not None:  # an API answer: the data as this caller may read it
            owner_id = getattr(event, "node_owner_pk", None)
            cache = self.context.setdefault("event_visibility", {})
            body["data"] = data_for(request.user, event, node_owner_id=owner_id, cache=cache)
        return body

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
    return apps.get_model("leases", "Lease").objects.filter(client=user).values("pk")


# An event about a lease: its column, or (events written before the column existed) its data.
ABOUT_A_LEASE = Q(lease_id__isnull=False) | Q(data__has_key="lease_id")


def events_for(user):
    """Events ``user`` may read (see the module docstring).

    A lease client reads node events, but of the events about leases only its own: another
    client's lease events carry that lease's id, workload and fencing token, which a client must
    not learn (the same rule as ``POST /fencing/validate``). Owner-private event types (appeals,
    statements) are read only by the node's owner and operators.
    """
    events = NodeEvent.objects.select_related("pool")
    if is_operator(user):
        return events
    scope = Q(pk__in=[])
    owned = F("node__owner_id")
    if is_owner(user):
        scope |= Q(node__owner=user)
        # Events of no node that name their owner (a payout's, a line appeal's: event_types'
        # owner_key): theirs to read, data whole, as the node owner reads a node's.
        mine = Q(pk__in=[])
        for type_, key in event_types.owner_keyed_types().items():
            mine |= Q(node__isnull=True, type=type_, **{f"data__{key}": user.pk})
        scope |= mine
        owned = Case(When(mine, then=Value(user.pk)), default=F("node__owner_id"), output_field=IntegerField())
    if is_client(user):
        client_scope = (Q(node__isnull=False) & ~ABOUT_A_LEASE) | Q(lease_id__in=_own_lease_ids(user))
        scope |= client_scope & ~Q(type__in=event_types.private_types())
    # The node's owner, for data_for (one join, no query per event).
    return events.filter(scope).annotate(node_owner_pk=owned)


# Keys of an event's data (at any depth) holding a list of lease ids.
LEASE_ID_LIST_KEYS = frozenset({"checkpoint_leases", "lease_ids", "revoked_lease_ids", "at_risk", "unconfirmed"})


def _reads_everything(user, node_owner_id) -> bool:
    return is_operator(user) or (is_owner(user) and node_owner_id is not None and node_owner_id == user.pk)


def _lease_ids_in(value, found: set[str]) -> set[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key in LEASE_ID_LIST_KEYS and isinstance(item, list):
                found.update(str(x) for x in item)
            elif key == "lease_id" and item is not None:
                found.add(str(item))
            else:
                _lease_ids_in(item, found)
    elif isinstance(value, list):
        for item in value:
            _lease_ids_in(item, found)
    return found


def _own_among(user, lease_ids: set[str], cache: dict) -> dict[str, str]:
    """``{lease id: spread group}`` of those of ``lease_ids`` that are ``user``'s own (remembered in
    ``cache`` across the events of one response)."""
    known = cache.setdefault("own_lease_groups", {})  # id -> group ("" for none), None: not the user's
    unknown = [pk for pk in lease_ids if pk not in known]
    if unknown:
        Lease = apps.get_model("leases", "Lease")
        canonical = {}
        for pk in unknown:
            known[pk] = None
            try:
                canonical[pk] = str(Lease._meta.pk.to_python(pk))
            except ValidationError:  # not a lease id: never one of the user's
                continue
        rows = Lease.objects.filter(client=user, pk__in=set(canonical.values())).values_list("pk", "group")
        groups = {str(pk): group or "" for pk, group in rows}
        for pk, key in canonical.items():
            known[pk] = groups.get(key)
    return {pk: known[pk] for pk in lease_ids if known[pk] is not None}


def _redact(value, own: dict[str, str]):
    if isinstance(value, list):
        kept = []
        for item in value:
            if isinstance(item, dict) and item.get("lease_id") is not None and str(item["lease_id"]) not in own:
                continue  # a summary of another client's lease
            kept.append(_redact(item, own))
        return kept
    if not isinstance(value, dict):
        return value
    body = {}
    for key, item in value.items():
        if key in LEASE_ID_LIST_KEYS and isinstance(item, list):
            body[key] = [x for x in item if str(x) in own]
        else:
            body[key] = _redact(item, own)
    if isinstance(value.get("lease_ids"), list) and isinstance(value.get("groups"), list):
        # Spread groups named beside lease ids (a disruption budget holding them) are the leases'
        # clients' names: only the caller's own are shown, and the message naming them is not.
        own_groups = {own[str(x)] for x in value["lease_ids"] if str(x) in own}
        body["groups"] = [g for g in value["groups"] if g in own_groups]
        if body["groups"] != value["groups"] and "message" in body:
            body["message"] = f"Waiting on {value.get('code') or 'a disruption budget'}."
    return body


def prime_own_leases(user, events, cache: dict, *, owner_of) -> None:
    """Learn, in one query, which lease ids named by ``events`` (whose data ``user`` does not read
    whole; ``owner_of(event)`` is the event's node owner) are ``user``'s own, into ``cache``; the
    :func:`data_for` calls that follow then need no query of their own."""
    mentioned: set[str] = set()
    for event in events:
        if event.data and not _reads_everything(user, owner_of(event)):
            _lease_ids_in(event.data, mentioned)
    if mentioned:
        _own_among(user, mentioned, cache)


def data_for(user, event, *, node_owner_id, cache: dict):
    """``event.data`` as ``user`` may read it: whole for operators and the node's owner; for anyone
    else, lease ids listed in it (and what names them) only when they are the user's own leases."""
    data = event.data
    if not data or _reads_everything(user, node_owner_id):
        return data
    mentioned = _lease_ids_in(data, set())
    if not mentioned:
        return data
    return _redact(data, _own_among(user, mentioned, cache))


def visible_events(user, node, events, cache: dict):
    """``events`` of ``node`` (already loaded) filtered as :func:`events_for` would, and their
    ``data`` redacted as :func:`data_for`: for the node API's ``recent_events``. Operators and the
    node's owner read them all. ``cache`` (one per response) keeps the client's own lease ids
    across the nodes of a list."""
    if _reads_everything(user, node.owner_id):
        return list(events)
    if not is_client(user):
        return []
    if "own_lease_ids" not in cache:
        cache["own_lease_ids"] = {str(pk) for pk in _own_lease_ids(user).values_list("pk", flat=True)}
    own = cache["own_lease_ids"]

    def about_a_lease(event) -> bool:
        return event.lease_id is not None or "lease_id" in (event.data or {})

    events = list(events)
    private = event_types.private_types()
    prime_own_leases(user, events, cache, owner_of=lambda event: node.owner_id)
    visible = []
    for event in events:
        if event.type in private or (about_a_lease(event) and str(event.lease_id) not in own):
            continue
        redacted = data_for(user, event, node_owner_id=node.owner_id, cache=cache)
        if redacted is not event.data:
            event = copy.copy(event)  # the loaded (prefetched) event is not changed
            event.data = redacted
        visible.append(event)
    return visible


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
            raise NotFound("No such node.", NODE_NOT_FOUND)
        return events_for(self.request.user).filter(node_id=node["pk"])
