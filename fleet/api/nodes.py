"""The node's API representation: identity, metadata, every state dimension, capability, capacity.

Reads only what :func:`fleet.selectors.node_queryset_for` loads (select_related + prefetches +
the ``has_valid_credential`` annotation), so a page of nodes costs a constant number of queries.
"""

from __future__ import annotations

from django.utils import timezone
from rest_framework import serializers

from nodepool.api.permissions import is_operator

from ..devices import device_summary
from ..models import Node
from ..readiness import health_state, readiness_state
from ..reliability import records as reliability_records
from ..selectors import RECENT_CREDENTIALS, RECENT_EVENTS, unschedulable_reasons
from .events import visible_events


def _loaded(node: Node, attr: str, relation: str, limit: int):
    """The prefetched rows in ``attr``, or a query when the node was loaded without them."""
    rows = getattr(node, attr, None)
    return rows if rows is not None else list(getattr(node, relation).all()[:limit])


def _check(check) -> dict:
    return {
        "name": check.name,
        "attempt": check.attempt,
        "status": check.status,
        "detail": check.detail,
        "started_at": check.started_at,
        "finished_at": check.finished_at,
        "duration_seconds": (
            (check.finished_at - check.started_at).total_seconds() if check.started_at and check.finished_at else None
        ),
    }


def hold_dict(hold) -> dict:
    """One cordon hold as the API shows it (node and maintenance answers alike)."""
    return {
        "id": hold.pk,
        "owner": hold.owner,
        "reason": hold.reason,
        "created_at": hold.created_at,
        "created_by": hold.created_by_name,
        "expires_at": hold.expires_at,
    }


def active_holds(node: Node) -> list:
    """The node's active holds: the prefetched list when loaded, else one query."""
    holds = getattr(node, "prefetched_active_holds", None)
    if holds is None:
        holds = list(node.holds.filter(removed_at__isnull=True).order_by("created_at", "pk"))
    return holds


def _sees_private_node_details(user, node: Node) -> bool:
    return is_operator(user) or (node.owner_id is not None and node.owner_id == getattr(user, "pk", None))


class NodeSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    owner = serializers.SlugRelatedField(slug_field="username", read_only=True)
    schedulable = serializers.SerializerMethodField()
    unschedulable_reasons = serializers.SerializerMethodField()
    capability = serializers.SerializerMethodField()
    capacity = serializers.SerializerMethodField()
    enrollment = serializers.SerializerMethodField()
    admission = serializers.SerializerMethodField()
    credentials = serializers.SerializerMethodField()
    recent_events = serializers.SerializerMethodField()
    holds = serializers.SerializerMethodField()
    reported_readiness = serializers.SerializerMethodField()
    devices = serializers.SerializerMethodField()
    readiness = serializers.SerializerMethodField()
    health_state = serializers.SerializerMethodField()
    reported_health = serializers.SerializerMethodField()
    status_report_age_seconds = serializers.SerializerMethodField()
    reliability_record = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = [
            "id", "pool", "owner", "hostname", "display_name",
            "schedulable", "unschedulable_reasons",
            "addresses", "labels", "node_labels", "taints", "taints_added_at",
            "lifecycle", "lifecycle_reason", "lifecycle_changed_at", "cordoned", "holds",
            "liveness", "liveness_changed_at", "last_heartbeat_at",
            "last_status_report_at", "status_report_age_seconds",
            "readiness", "health_state", "reported_readiness", "reported_health",
            "ready", "ready_reason", "health", "health_reasons", "conditions",
            "incarnation", "sequence", "restart_count", "agent_version", "clock_skew_seconds", "usage",
            "capability", "capacity", "devices", "boot_id", "reliability", "reliability_record",
            "enrollment", "admission", "credentials", "artifacts_blocked",
            "recent_events", "version", "created_at", "updated_at",
        ]  # fmt: skip
        read_only_fields = fields

    def to_representation(self, node: Node) -> dict:
        """Lease clients see what placement needs, not who contributed a node or how it enrolled
        (issue 30, item 5): ``owner`` is null and ``enrollment`` empty for anyone but an operator
        and the node's owner. An internal rendering (no request: the admin, the demo) sees all."""
        data = super().to_representation(node)
        request = self.context.get("request")
        if request is not None and not _sees_private_node_details(request.user, node):
            data["owner"] = None
            data["enrollment"] = {}
        return data

    def _reasons(self, node: Node) -> list[dict]:
        cache = self.context.setdefault("_reasons", {})
        if node.pk not in cache:
            cache[node.pk] = unschedulable_reasons(node)
        return cache[node.pk]

    def get_schedulable(self, node: Node) -> bool:
        return not self._reasons(node)

    def get_unschedulable_reasons(self, node: Node) -> list[dict]:
        return self._reasons(node)

    def get_holds(self, node: Node) -> list[dict]:
        return [hold_dict(h) for h in active_holds(node)]

    def get_reported_readiness(self, node: Node) -> dict:
        """What the node last said about its own readiness, and when: the node's word, not a verdict
        (``schedulable`` is the control plane's)."""
        return {"ready": node.ready, "reason": node.ready_reason, "reported_at": node.last_status_report_at}

    def get_status_report_age_seconds(self, node: Node) -> float | None:
        """Seconds since the last status report arrived (server time; None: never reported). Its
        renewals keep ``last_heartbeat_at`` fresh; this says how old what we know of it is."""
        if node.last_status_report_at is None:
            return None
        return round(max(0.0, (timezone.now() - node.last_status_report_at).total_seconds()), 1)

    def get_devices(self, node: Node) -> dict:
        """``{type: {"total", "allocatable", "free", "models": {model: count}, "free_models": {model:
        count}}}`` of the node's live devices: ``free`` is the type's free count resource,
        ``free_models`` the allocatable devices no live lease holds by model (the known short name,
        e.g. ``H100``, else as reported). ``GET /nodes/{id}/devices`` lists them one by one. One
        query for a whole page."""
        cache = self.context.get("_devices")
        if cache is None or node.pk not in cache:
            parent = getattr(self, "parent", None)
            nodes = getattr(parent, "instance", None) if parent is not None else None
            ids = [n.pk for n in nodes] if isinstance(nodes, list | tuple) else [node.pk]
            if node.pk not in ids:
                ids = [node.pk]
            cache = self.context["_devices"] = {pk: {} for pk in ids} | device_summary(ids)
        summary = cache.get(node.pk, {})
        capacity = {r.name: r.free for r in node.resources.all()}
        return {kind: {**entry, "free": capacity.get(kind, 0)} for kind, entry in summary.items()}

    def get_reliability_record(self, node: Node) -> dict:
        """The node's reliability record (fleet.reliability.record: uptime and lease outcomes over 7
        and 30 days, faults per device, the score). It describes the machine, not its owner, so
        every reader of the node sees it. One query for a whole page."""
        cache = self.context.get("_reliability")
        if cache is None or node.pk not in cache:
            parent = getattr(self, "parent", None)
            nodes = getattr(parent, "instance", None) if parent is not None else None
            page = list(nodes) if isinstance(nodes, list | tuple) and node in nodes else [node]
            cache = self.context["_reliability"] = reliability_records(page)
        return cache[node.pk]

    def get_readiness(self, node: Node) -> str:
        """``ready`` / ``not_ready`` / ``unknown`` (unreachable, lost or never heard from): fleet.readiness."""
        return readiness_state(liveness=node.liveness, ready=node.ready)

    def get_health_state(self, node: Node) -> str:
        """``health`` while the node's signals are current, else ``unknown``: fleet.readiness."""
        return health_state(liveness=node.liveness, health=node.health)

    def get_reported_health(self, node: Node) -> dict:
        """The last judged health and when the status report it judged arrived (kept when shown unknown)."""
        return {"health": node.health, "reasons": node.health_reasons, "reported_at": node.last_status_report_at}

    def get_capability(self, node: Node) -> dict:
        return {"declared": node.declared, "measured": node.measured, "verified": node.verified}

    def get_capacity(self, node: Node) -> dict:
        return {
            r.name: {
                "capacity": r.capacity,
                "reserved": r.reserved,
                "allocatable": r.allocatable,
                "allocated": r.allocated,
                "free": r.free,
                "overcommitted": r.overcommitted,
            }
            for r in sorted(node.resources.all(), key=lambda r: r.name)
        }

    def get_enrollment(self, node: Node) -> dict:
        return {
            "bootstrap_token": node.bootstrap_token.prefix if node.bootstrap_token else None,
            "enrolled_at": node.enrolled_at,
            "agent_version": node.enrolled_agent_version,
            "attestation_sent": bool(node.attestation),
            "attestation_verified": node.attestation_verified,
            "attestation_detail": node.attestation_detail,
        }

    def get_admission(self, node: Node) -> dict:
        checks = [c for c in node.admission_checks.all() if c.attempt == node.admission_attempt]
        return {
            "attempt": node.admission_attempt,
            "checks": [_check(c) for c in checks],
            "failed": [{"name": c.name, "detail": c.detail} for c in checks if c.status == "failed"],
        }

    def get_credentials(self, node: Node) -> list[dict] | None:
        request = self.context.get("request")
        if request is None or not is_operator(request.user):
            return None
        return [
            {
                "prefix": c.prefix,
                "issuer": c.issuer,
                "agent_version": c.agent_version,
                "issued_at": c.issued_at,
                "expires_at": c.expires_at,
                "rotated_at": c.rotated_at,
                "revoked_at": c.revoked_at,
            }
            for c in _loaded(node, "recent_credentials", "credentials", RECENT_CREDENTIALS)
        ]

    def get_recent_events(self, node: Node) -> list[dict]:
        return [
            {
                "type": e.type,
                "from": e.from_state,
                "to": e.to_state,
                "actor": {"type": e.actor_type, "name": e.actor_name},
                "reason": e.reason,
                "request_id": e.request_id,
                "data": e.data,
                "at": e.created_at,
            }
            for e in self._visible_events(node)
        ]

    def _visible_events(self, node: Node):
        events = _loaded(node, "recent_events", "events", RECENT_EVENTS)
        request = self.context.get("request")
        if request is None:  # an internal rendering (the admin, the demo): every event
            return events
        return visible_events(request.user, node, events, self.context.setdefault("event_visibility", {}))
