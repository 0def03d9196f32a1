"""Marketplace API shapes. Money and seconds are decimal strings, never floats."""

from __future__ import annotations

from django.core.exceptions import ObjectDoesNotExist
from rest_framework import serializers

from leases.api.serializers import workload_state_field
from leases.choices import EvidenceClose
from leases.models import EvidenceInterval, Lease, LeaseCheckpoint

from .. import statements
from ..models import PoolPrice, Statement, StatementLine, UsageRecord


class EvidenceIntervalSerializer(serializers.ModelSerializer):
    seconds = serializers.FloatField(read_only=True)
    # Explicit: a read-only model field loses allow_blank, and the schema then left out "" (still open).
    close_reason = serializers.ChoiceField(
        choices=EvidenceClose.choices,
        allow_blank=True,
        read_only=True,
        help_text='Why the interval closed; "" while it is open.',
    )

    class Meta:
        model = EvidenceInterval
        fields = [
            "started_at",
            "last_seen_at",
            "closed_at",
            "close_reason",
            "seconds",
            "node_incarnation",
            "fencing_token",
            "status_reports",
            "renewals",
            "usage_max",
            "devices",
        ]
        read_only_fields = fields


class CheckpointSerializer(serializers.ModelSerializer):
    class Meta:
        model = LeaseCheckpoint
        fields = ["state", "requested_at", "requested_by", "taken_at", "message", "fencing_token", "node_incarnation"]
        read_only_fields = fields


class OwnedLeaseSerializer(serializers.ModelSerializer):
    """A lease as its node's owner sees it: the execution evidence, without the client's private
    fields (``client``, ``command``, ``spec``, ``idempotency_key``, ``request_hash``, ``decision``)."""

    node = serializers.UUIDField(source="node_id", read_only=True)
    pool = serializers.CharField(source="pool.name", read_only=True)
    shape = serializers.CharField(source="shape.name", read_only=True, default=None, allow_null=True)
    workload_state = workload_state_field()
    usage_record = serializers.SerializerMethodField()

    class Meta:
        model = Lease
        fields = [
            "id",
            "workload_id",
            "fencing_token",
            "node",
            "node_incarnation",
            "pool",
            "state",
            "workload_state",
            "resources",
            "shape",
            "shape_version",
            "granted_at",
            "activated_at",
            "expires_at",
            "ended_at",
            "end_reason",
            "outcome",
            "usage_record",
        ]
        read_only_fields = fields

    def get_usage_record(self, lease) -> int | None:
        try:
            return lease.usage_record.pk
        except ObjectDoesNotExist:
            return None


class OwnedLeaseDetailSerializer(OwnedLeaseSerializer):
    evidence_intervals = EvidenceIntervalSerializer(many=True, read_only=True)
    checkpoints = CheckpointSerializer(many=True, read_only=True)

    class Meta(OwnedLeaseSerializer.Meta):
        fields = [*OwnedLeaseSerializer.Meta.fields, "evidence_intervals", "checkpoints"]
        read_only_fields = fields


class UsageRecordSerializer(serializers.ModelSerializer):
    node = serializers.UUIDField(source="node_id", read_only=True)
    pool = serializers.CharField(source="pool.name", read_only=True)
    owner = serializers.CharField(source="owner.username", read_only=True, default=None, allow_null=True)
    lease = serializers.UUIDField(source="lease_id", read_only=True)

    class Meta:
        model = UsageRecord
        fields = [
            "id",
            "lease",
            "node",
            "owner",
            "pool",
            "workload_id",
            "fencing_token",
            "resources",
            "started_at",
            "ended_at",
            "lease_state",
            "outcome",
            "state",
            "settle_after",
            "allocated_seconds",
            "evidenced_seconds",
            "billable_seconds",
            "billable_intervals",
            "gaps",
            "findings",
            "adjustment",
            "held_by",
            "reconciled_at",
            "version",
        ]
        read_only_fields = fields


class UsageRecordDetailSerializer(UsageRecordSerializer):
    execution = serializers.SerializerMethodField()

    class Meta(UsageRecordSerializer.Meta):
        fields = [*UsageRecordSerializer.Meta.fields, "execution"]
        read_only_fields = fields

    def get_execution(self, record) -> dict:
        return OwnedLeaseDetailSerializer(record.lease).data


class StatementLineSerializer(serializers.ModelSerializer):
    # Idle and correction lines have no usage record: null (the keys were left out, against the schema).
    lease = serializers.UUIDField(source="usage_record.lease_id", read_only=True, allow_null=True)
    workload_id = serializers.CharField(source="usage_record.workload_id", read_only=True, allow_null=True)
    node = serializers.CharField(source="node_id_text", read_only=True)
    pool = serializers.CharField(source="pool_name", read_only=True)

    class Meta:
        model = StatementLine
        fields = [
            "usage_record",
            "lease",
            "workload_id",
            "node",
            "pool",
            "state",
            "allocated_seconds",
            "billable_seconds",
            "coverage",
            "quantities",
            "amount",
            "currency",
            "reason",
            "carried_from",
        ]
        read_only_fields = fields


class StatementSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    totals = serializers.SerializerMethodField()

    class Meta:
        model = Statement
        fields = [
            "id",
            "owner",
            "period",
            "period_start",
            "period_end",
            "state",
            "totals",
            "carried_out",
            "finalized_at",
            "finalized_by",
            "version",
        ]
        read_only_fields = fields

    def get_totals(self, statement) -> dict:
        return statements.totals(statement)


class StatementDetailSerializer(StatementSerializer):
    lines = StatementLineSerializer(many=True, read_only=True)

    class Meta(StatementSerializer.Meta):
        fields = [*StatementSerializer.Meta.fields, "lines"]
        read_only_fields = fields


class PoolPriceSerializer(serializers.ModelSerializer):
    pool = serializers.CharField(source="pool.name", read_only=True)
    unit_price = serializers.DecimalField(max_digits=18, decimal_places=6, coerce_to_string=True, read_only=True)

    class Meta:
        model = PoolPrice
        fields = ["id", "pool", "resource", "unit_price", "currency", "effective_from", "note", "created_at"]
        read_only_fields = fields
