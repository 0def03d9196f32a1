from __future__ import annotations

from datetime import timedelta

from django.utils import timezone
from rest_framework import serializers

from fleet.api.nodes import active_holds, hold_dict
from fleet.models import Node
from nodepool.api.fields import AwareDateTimeField
from nodepool.api.permissions import is_operator
from nodepool.api.strict import StrictBooleanField, StrictInput, StrictSerializer

from .. import conf
from ..budgets import budget_status
from ..choices import EvictionPolicy
from ..models import DisruptionBudget, Drain, Quarantine
from ..selectors import active_drain, allowed_actions, public_evidence

REASON_MAX = 2000


class ActionReasonSerializer(StrictSerializer):
    """Every operator action says why (recorded with who and when in the node's events).

    Strict (nodepool.api.strict): an unknown member is 400 ``unknown_field``, never ignored.
    """

    reason = serializers.CharField(max_length=REASON_MAX, trim_whitespace=True)
    expected_version = serializers.IntegerField(required=False, min_value=0, help_text="or send If-Match")


class CordonRequestSerializer(ActionReasonSerializer):
    expires_at = AwareDateTimeField(
        required=False, default=None, help_text="RFC 3339 with offset; the hold ends by itself then"
    )


class UncordonRequestSerializer(ActionReasonSerializer):
    owner = serializers.CharField(
        required=False, default=None, max_length=200, help_text="whose hold (default: your own); needs force"
    )
    force = StrictBooleanField(
        default=False, help_text="operators only: remove another actor's hold (or every hold); recorded"
    )


class DeadlineMixin(serializers.Serializer):
    deadline = AwareDateTimeField(required=False, help_text="RFC 3339 with offset or Z; or deadline_in")
    deadline_in = serializers.IntegerField(required=False, min_value=1, help_text="seconds from now; or deadline")

    def validate(self, attrs):
        attrs = super().validate(attrs)
        given = [name for name in ("deadline", "deadline_in") if attrs.get(name) is not None]
        if len(given) != 1:
            raise serializers.ValidationError(
                {"deadline": "Give exactly one of deadline (RFC 3339) or deadline_in (seconds)."}, "deadline_required"
            )
        if "deadline_in" in given:
            # Capped only so that a huge count cannot overflow a datetime: the drain's own check
            # (maintenance.progress.validate_deadline) answers a far one 422 deadline_too_far, as
            # it does a far ``deadline``.
            seconds = min(attrs.pop("deadline_in"), conf.get("DRAIN_MAX_DURATION") + 1)
            attrs["deadline"] = timezone.now() + timedelta(seconds=seconds)
        return attrs


class DrainRequestSerializer(DeadlineMixin, ActionReasonSerializer):
    policy = serializers.ChoiceField(choices=EvictionPolicy.choices, default=EvictionPolicy.WAIT)


class DeadlineChangeSerializer(DeadlineMixin, ActionReasonSerializer):
    pass


class QuarantineRequestSerializer(ActionReasonSerializer):
    evidence = serializers.DictField(required=False, default=dict, help_text="what was observed (JSON object)")


class ReleaseRequestSerializer(ActionReasonSerializer):
    issue_credential = StrictBooleanField(
        default=False, help_text="issue a new node credential now (returned once) instead of re-enrollment"
    )


class RetireRequestSerializer(ActionReasonSerializer):
    force = StrictBooleanField(default=False, help_text="revoke live leases instead of refusing")


class NodeStateSerializer(serializers.ModelSerializer):
    """A node's maintenance-relevant state, returned by every node action."""

    pool = serializers.CharField(source="pool.name", read_only=True)
    allowed_actions = serializers.SerializerMethodField()
    active_drain = serializers.SerializerMethodField()
    holds = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = [
            "id",
            "pool",
            "hostname",
            "display_name",
            "lifecycle",
            "lifecycle_reason",
            "lifecycle_changed_at",
            "cordoned",
            "holds",
            "artifacts_blocked",
            "allowed_actions",
            "active_drain",
            "version",
        ]
        read_only_fields = fields

    def get_allowed_actions(self, node) -> list[str]:
        return allowed_actions(node)

    def get_holds(self, node) -> list[dict]:
        return [hold_dict(h) for h in active_holds(node)]

    def get_active_drain(self, node) -> str | None:
        drain = active_drain(node)
        return str(drain.pk) if drain else None


class DrainNodeSerializer(serializers.ModelSerializer):
    pool = serializers.CharField(source="pool.name", read_only=True)

    class Meta:
        model = Node
        fields = ["id", "pool", "hostname", "lifecycle", "version"]
        read_only_fields = fields


class DrainSerializer(serializers.ModelSerializer):
    node = DrainNodeSerializer(read_only=True)

    class Meta:
        model = Drain
        fields = [
            "id",
            "node",
            "state",
            "policy",
            "reason",
            "deadline",
            "requested_by_name",
            "created_at",
            "finished_at",
            "finish_reason",
            "leases_at_start",
            "leases_remaining",
            "progress",
            "progress_at",
            "version",
        ]
        read_only_fields = fields


class QuarantineSerializer(serializers.ModelSerializer):
    node = serializers.UUIDField(source="node_id", read_only=True)
    node_lifecycle = serializers.CharField(source="node.lifecycle", read_only=True)
    evidence = serializers.SerializerMethodField()

    def get_evidence(self, quarantine) -> dict:
        # Owners read it without what operators marked private (maintenance.selectors.public_evidence).
        request = self.context.get("request")
        if request is not None and is_operator(request.user):
            return quarantine.evidence
        return public_evidence(quarantine.evidence)

    class Meta:
        model = Quarantine
        fields = [
            "id",
            "node",
            "node_lifecycle",
            "rule",
            "reason",
            "evidence",
            "from_state",
            "actor_type",
            "actor_name",
            "created_at",
            "credentials_revoked",
            "leases_revoked",
            "released_at",
            "released_by_name",
            "release_reason",
        ]
        read_only_fields = fields


class DisruptionBudgetSerializer(StrictInput, serializers.ModelSerializer):
    """Exactly one of ``max_unavailable`` / ``min_available`` (Kubernetes' PodDisruptionBudget)."""

    status = serializers.SerializerMethodField()

    class Meta:
        model = DisruptionBudget
        fields = [
            "id",
            "group",
            "description",
            "max_unavailable",
            "min_available",
            "replacement_grace",
            "status",
            "version",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "status", "version", "created_at", "updated_at"]
        extra_kwargs = {"replacement_grace": {"min_value": 0, "max_value": 7 * 24 * 3600}}

    def validate(self, attrs):
        merged = {
            "max_unavailable": getattr(self.instance, "max_unavailable", None),
            "min_available": getattr(self.instance, "min_available", None),
            **{k: v for k, v in attrs.items() if k in ("max_unavailable", "min_available")},
        }
        if (merged["max_unavailable"] is None) == (merged["min_available"] is None):
            raise serializers.ValidationError(
                "Set exactly one of max_unavailable or min_available (send the other as null).", "one_limit"
            )
        return attrs

    def get_status(self, budget) -> dict:
        status = budget_status(budget, now=timezone.now()).as_dict()
        return {k: status[k] for k in ("healthy", "disrupted", "allowed_disruptions")}
