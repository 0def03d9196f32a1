"""Response shapes for leases, lease requests and shapes (requests are validated in leases.spec)."""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers

from nodepool.quantity import format_quantity

from ..choices import WorkloadState
from ..models import ConsistencyReport, Lease, LeaseRequest, Shape

# A lease's workload state is "" until its node first reports on it (issue 30, item 8: the schema
# says so; a ModelSerializer's read-only choice field would drop the blank from the enum).
WORKLOAD_STATE_HELP = 'What the node last reported for the job; "" until it reports (unknown: it ended while running).'


def workload_state_field() -> serializers.ChoiceField:
    return serializers.ChoiceField(
        choices=WorkloadState.choices, allow_blank=True, read_only=True, help_text=WORKLOAD_STATE_HELP
    )


class LeaseSerializer(serializers.ModelSerializer):
    node_id = serializers.UUIDField(read_only=True)
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    shape = serializers.SlugRelatedField(slug_field="name", read_only=True)
    client = serializers.SlugRelatedField(slug_field="username", read_only=True)
    workload_state = workload_state_field()
    placement = serializers.JSONField(
        read_only=True,
        help_text="The placement the request asked for: node_selector, affinity, tolerations, spread, features.",
    )

    class Meta:
        model = Lease
        fields = [
            "id",
            "workload_id",
            "node_id",
            "node_incarnation",
            "fencing_token",
            "state",
            "workload_state",
            "pool",
            "resources",
            "devices",
            "shape",
            "shape_version",
            "group",
            "priority",
            "command",
            "placement",
            "decision",
            "ttl_seconds",
            "expires_at",
            "granted_at",
            "activated_at",
            "ended_at",
            "end_reason",
            "outcome",
            "checkpoint_requested_at",
            "missed_reports",
            "last_reported_at",
            "client",
            "superseded_by",
            "version",
        ]
        read_only_fields = fields

    def to_representation(self, instance: Lease) -> dict:
        # Hand-built: the schema still comes from the declared fields, but a grant's response no
        # longer pays for building ModelSerializer fields on every request (a hot path).
        return lease_representation(instance)


_DATETIME = serializers.DateTimeField()


def _when(value):
    return _DATETIME.to_representation(value) if value is not None else None


# What a lease shows of the placement its request asked for (issue 33 item 10), beside where it landed.
PLACEMENT_KEYS = ("node_selector", "affinity", "tolerations", "spread", "features")


def lease_representation(lease: Lease) -> dict:
    """The wire shape of a lease (canonical resource integers, RFC 3339 times)."""
    return {
        "id": str(lease.pk),
        "workload_id": lease.workload_id,
        "node_id": str(lease.node_id),
        "node_incarnation": lease.node_incarnation,
        "fencing_token": lease.fencing_token,
        "state": lease.state,
        "workload_state": lease.workload_state,
        "pool": lease.pool.name,
        "resources": lease.resources,
        "devices": lease.devices or [],
        "shape": lease.shape.name if lease.shape_id else None,
        "shape_version": lease.shape_version,
        "group": lease.group,
        "priority": lease.priority,
        "command": lease.command,
        "placement": {key: spec[key] for key in PLACEMENT_KEYS if (spec := lease.spec or {}).get(key)},
        "decision": lease.decision,
        "ttl_seconds": lease.ttl_seconds,
        "expires_at": _when(lease.expires_at),
        "granted_at": _when(lease.granted_at),
        "activated_at": _when(lease.activated_at),
        "ended_at": _when(lease.ended_at),
        "end_reason": lease.end_reason,
        "outcome": lease.outcome,
        "checkpoint_requested_at": _when(lease.checkpoint_requested_at),
        "missed_reports": lease.missed_reports,
        "last_reported_at": _when(lease.last_reported_at),
        "client": lease.client.username if lease.client_id else None,
        "superseded_by": str(lease.superseded_by_id) if lease.superseded_by_id else None,
        "version": lease.version,
    }


@extend_schema_serializer(component_name="QueuedLeaseRequest")  # "LeaseRequest" is Lease's request body
class LeaseRequestSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    lease_id = serializers.UUIDField(read_only=True, allow_null=True, help_text="null until placed, and when cancelled")
    pending_seconds = serializers.SerializerMethodField()
    lease_request = serializers.UUIDField(source="id", read_only=True)

    class Meta:
        model = LeaseRequest
        fields = [
            "id",
            "lease_request",
            "workload_id",
            "pool",
            "state",
            "priority",
            "reasons",
            "message",
            "attempts",
            "lease_id",
            "requeued_from",
            "spec",
            "created_at",
            "last_attempt_at",
            "placed_at",
            "pending_seconds",
            "version",
        ]
        read_only_fields = fields

    def get_pending_seconds(self, obj: LeaseRequest) -> float:
        """Seconds the request waited (until placed, or until now while it waits)."""
        end = obj.placed_at or timezone.now()
        return round((end - obj.created_at).total_seconds(), 3)


class ShapeSerializer(serializers.ModelSerializer):
    quantities = serializers.SerializerMethodField()

    class Meta:
        model = Shape
        fields = [
            "id",
            "name",
            "version",
            "resources",
            "quantities",
            "features",
            "devices",
            "description",
            "created_at",
        ]
        read_only_fields = fields

    def get_quantities(self, obj: Shape) -> dict[str, str]:
        """The resources in Kubernetes quantity syntax (``{"cpu": "8", "memory": "32Gi"}``)."""
        return {name: format_quantity(name, amount) for name, amount in (obj.resources or {}).items()}


class ConsistencyReportSerializer(serializers.ModelSerializer):
    class Meta:
        model = ConsistencyReport
        fields = ["id", "checked_at", "nodes_checked", "drift", "repaired"]
        read_only_fields = fields
