"""Response shapes of pool operations (requests are validated by the services' parsers)."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone
from rest_framework import serializers

from maintenance import conf as maintenance_conf
from maintenance.api.serializers import REASON_MAX
from maintenance.choices import EvictionPolicy
from nodepool.api.fields import AwareDateTimeField
from nodepool.api.strict import StrictBooleanField, StrictSerializer

from ..choices import PauseCause
from ..demand import fallback_pool_names
from ..models import PoolOperations, Preemption, ProviderMachine, ScaleDecision, Upgrade, UpgradeNode


class UpgradeNodeSerializer(serializers.ModelSerializer):
    node_id = serializers.UUIDField(read_only=True)

    class Meta:
        model = UpgradeNode
        fields = ["node_id", "phase", "position", "state", "from_version", "started_at", "finished_at", "detail"]
        read_only_fields = fields


class UpgradeSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    canary_pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    # Explicit: a read-only model field loses allow_blank, and the schema then left out "" (not paused).
    pause_cause = serializers.ChoiceField(
        choices=PauseCause.choices,
        allow_blank=True,
        read_only=True,
        help_text='Why the upgrade is paused; "" when it is not paused.',
    )
    progress = serializers.SerializerMethodField()

    class Meta:
        model = Upgrade
        fields = [
            "id",
            "pool",
            "state",
            "target",
            "previous_target",
            "max_unavailable_nodes",
            "max_surge_nodes",
            "canary_nodes",
            "canary_pool",
            "soak_seconds",
            "failure_threshold",
            "node_timeout",
            "auto_rollback",
            "reason",
            "status_reason",
            "pause_cause",
            "created_by_name",
            "created_at",
            "started_at",
            "soak_until",
            "finished_at",
            "failures",
            "progress",
            "version",
        ]
        read_only_fields = fields

    def get_progress(self, obj: Upgrade) -> dict:
        """``{phase: {state: count}}`` of the upgrade's nodes."""
        progress: dict[str, dict[str, int]] = {}
        for phase, state in obj.nodes.values_list("phase", "state"):
            progress.setdefault(phase, {})
            progress[phase][state] = progress[phase].get(state, 0) + 1
        return progress


class UpgradeDetailSerializer(UpgradeSerializer):
    nodes = UpgradeNodeSerializer(many=True, read_only=True)

    class Meta(UpgradeSerializer.Meta):
        fields = [*UpgradeSerializer.Meta.fields, "nodes"]
        read_only_fields = fields


class PoolOperationsSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    fallback_pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    provider_secret_set = serializers.SerializerMethodField()
    # A string, not format "uri": it is empty while the pool has no webhook provider.
    provider_url = serializers.CharField(read_only=True, help_text="webhook: the operator's URL; empty otherwise")
    fallback_pools = serializers.SerializerMethodField()

    class Meta:
        model = PoolOperations
        fields = [
            "pool",
            "target",
            "drain_policy",
            "drain_timeout",
            "spot",
            "fallback_pool",
            "provider",
            "provider_url",
            "provider_secret_set",
            "min_nodes",
            "max_nodes",
            "node_template",
            "scale_up_delay",
            "scale_up_cooldown",
            "max_nodes_per_scale_up",
            "scale_down_utilization",
            "scale_down_after",
            "scale_down_cooldown",
            "boot_timeout",
            "max_launches_in_flight",
            "scale_up_backoff_base",
            "scale_up_backoff_max",
            "fallback_pools",
            "consecutive_failures",
            "backoff_until",
            "disruption_budgets",
            "consolidate_after",
            "consolidation_min_saving",
            "expire_after",
            "termination_grace",
            "repair_rules",
            "repair_max_unhealthy",
            "repair_max_concurrent",
            "repair_breaker_open",
            "repair_breaker_since",
            "repair_breaker_detail",
            "last_scale_up_at",
            "last_scale_down_at",
            "version",
        ]
        read_only_fields = fields

    def get_provider_secret_set(self, obj: PoolOperations) -> bool:
        """The secret itself is never shown."""
        return bool(obj.provider_secret)

    def get_fallback_pools(self, obj: PoolOperations) -> list[str]:
        """The pools tried, in order, while this one backs off (names; a deleted pool drops out)."""
        return fallback_pool_names(obj)


class ScaleDecisionSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = ScaleDecision
        fields = [
            "id",
            "pool",
            "direction",
            "outcome",
            "count",
            "reason",
            "data",
            "attempts",
            "error",
            "created_at",
            "finished_at",
        ]
        read_only_fields = fields


class ProviderMachineSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    node_id = serializers.UUIDField(read_only=True, allow_null=True)
    scale_up_seconds = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = ProviderMachine
        fields = [
            "id",
            "pool",
            "provider",
            "name",
            "state",
            "node_id",
            "requested_at",
            "pending_since",
            "ready_at",
            "deleted_at",
            "scale_up_seconds",
            "error",
        ]
        read_only_fields = fields


class PreemptionSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    fallback_pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    node_id = serializers.UUIDField(read_only=True)

    class Meta:
        model = Preemption
        fields = [
            "id",
            "node_id",
            "pool",
            "source",
            "deadline",
            "received_at",
            "state",
            "drain_id",
            "fallback_pool",
            "leases_requeued",
            "finished_at",
        ]
        read_only_fields = fields


class BulkActionSerializer(StrictSerializer):
    """``POST /nodes/bulk/{cordon,uncordon,drain}`` (operations.bulk): strict, every member checked."""

    selector = serializers.CharField(
        allow_blank=True, trim_whitespace=False, max_length=1000, help_text="Kubernetes label selector; never empty"
    )
    pool = serializers.CharField(required=False, max_length=100, help_text="only nodes of this pool")
    expected_count = serializers.IntegerField(min_value=0, help_text="how many nodes you expect the selector to match")
    reason = serializers.CharField(max_length=REASON_MAX, trim_whitespace=True)
    dry_run = StrictBooleanField(default=False, help_text="change nothing; answer what would happen to each node")
    policy = serializers.ChoiceField(choices=EvictionPolicy.choices, required=False, help_text="drain only")
    deadline = AwareDateTimeField(required=False, help_text="drain only: RFC 3339 with offset; or deadline_in")
    deadline_in = serializers.IntegerField(required=False, min_value=1, help_text="drain only: seconds from now")

    def validate(self, attrs):
        attrs = super().validate(attrs)
        action = self.context.get("action")
        drain_only = [name for name in ("policy", "deadline", "deadline_in") if attrs.get(name) is not None]
        if action != "drain":
            if drain_only:
                raise serializers.ValidationError({drain_only[0]: f"Only a drain takes {drain_only[0]}."}, "invalid")
            return attrs
        given = [name for name in ("deadline", "deadline_in") if attrs.get(name) is not None]
        if len(given) != 1:
            raise serializers.ValidationError(
                {"deadline": "Give exactly one of deadline (RFC 3339) or deadline_in (seconds)."}, "deadline_required"
            )
        if "deadline_in" in given:
            seconds = min(attrs.pop("deadline_in"), maintenance_conf.get("DRAIN_MAX_DURATION") + 1)
            attrs["deadline"] = timezone.now() + timedelta(seconds=seconds)
        attrs.setdefault("policy", EvictionPolicy.WAIT)
        return attrs
