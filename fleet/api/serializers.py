"""Input serializers of the fleet API: pools, bootstrap tokens, enrollment, credentials, benchmarks.

Every input serializer is strict: an unknown member is a 400 (``unknown_field``), and a member
that names a protected node attribute is a 400 (``protected_field``), so a client can never set
what only the control plane may set. Output shapes of nodes live in :mod:`fleet.api.nodes`.
"""

from __future__ import annotations

import ipaddress
import json
import math
from typing import Any

from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework import serializers

from nodepool.api.fields import AwareDateTimeField
from nodepool.api.problems import Problem
from nodepool.api.strict import StrictInput, StrictSerializer

from ..capability import CapabilityError, parse_capability, parse_labels, parse_request_classes, parse_taints
from ..errors import INVALID_QUANTITY, RESERVED_LABEL
from ..labels import reserved_label_errors
from ..models import BootstrapToken, Pool
from ..policy import (
    parse_required_capabilities,
    parse_required_labels,
    parse_reservations,
    parse_specifier,
)

# Members of a node that only the control plane writes; naming one in enrollment is refused.
PROTECTED_NODE_FIELDS = frozenset(
    {
        "id", "node_id", "pool_id", "owner", "owner_id", "lifecycle", "lifecycle_reason", "liveness", "health",
        "health_reasons", "ready", "conditions", "declared", "measured", "verified", "incarnation", "sequence",
        "version", "capacity", "reserved", "allocatable", "allocated", "resources", "taints", "node_labels",
        "attestation_verified", "attestation_detail", "admission_attempt", "enrolled_at", "credential",
        "credentials", "artifacts_blocked", "restart_count", "bootstrap_token_id", "schedulable",
    }
)  # fmt: skip


def _raise_capability(exc: CapabilityError, prefix: str):
    """Re-raise a parser error as a DRF field error, its path relative to the field ``prefix``.

    A quantity the parser refuses is 400 ``invalid_quantity`` (one stable code for every
    endpoint that takes quantities), with the offending member in ``errors``.
    """
    if exc.code == "invalid_quantity":
        raise Problem(
            f"{exc.field}: {exc.message}",
            INVALID_QUANTITY,
            errors=[{"field": exc.field, "code": "invalid_quantity", "message": exc.message}],
        ) from exc
    if exc.field.startswith(prefix + "."):
        raise serializers.ValidationError({exc.field[len(prefix) + 1 :]: [exc.message]}) from exc
    raise serializers.ValidationError([exc.message]) from exc


# --- pools --------------------------------------------------------------------------------------------


class PoolSerializer(StrictInput, serializers.ModelSerializer):
    """A pool. Requests accept quantities in reservations and required capabilities; responses give integers."""

    node_count = serializers.IntegerField(read_only=True, required=False)

    class Meta:
        model = Pool
        fields = [
            "id", "name", "description", "kind", "labels", "taints", "reservations", "admission_mode",
            "allowed_agent_versions", "required_capabilities", "required_labels", "benchmark_required",
            "benchmark_tolerance", "benchmark_timeout", "attestation_required", "attestation_public_key",
            "trust_node_labels", "heartbeat_interval", "status_report_interval", "heartbeat_grace", "loss_threshold",
            "unhealthy_conditions", "degraded_conditions", "allowed_undeclared_resources", "scheduling_policy",
            "ready_ratio_objective", "request_classes", "reverification_period", "reverification_window",
            "reverification_tolerance_percent", "reverification_busy_policy", "node_count", "version", "created_at",
            "updated_at",
        ]  # fmt: skip
        read_only_fields = ["id", "version", "created_at", "updated_at"]

    def _parse(self, function, value, name):
        try:
            return function(value, field=name)
        except CapabilityError as exc:
            _raise_capability(exc, name)

    def validate_labels(self, value):
        return self._parse(parse_labels, value, "labels")

    def validate_taints(self, value):
        return self._parse(parse_taints, value, "taints")

    def validate_reservations(self, value):
        return self._parse(parse_reservations, value, "reservations")

    def validate_required_capabilities(self, value):
        return self._parse(parse_required_capabilities, value, "required_capabilities")

    def validate_required_labels(self, value):
        return self._parse(parse_required_labels, value, "required_labels")

    def validate_allowed_agent_versions(self, value):
        return self._parse(parse_specifier, value, "allowed_agent_versions")

    def validate_request_classes(self, value):
        return self._parse(parse_request_classes, value, "request_classes")

    def validate_ready_ratio_objective(self, value):
        if not (math.isfinite(value) and 0.5 <= value < 1.0):
            raise serializers.ValidationError("must be a fraction from 0.5 to below 1 (e.g. 0.99)")
        return value

    def _condition_list(self, value):
        if not isinstance(value, list) or len(value) > 32 or not all(isinstance(v, str) and v for v in value):
            raise serializers.ValidationError("must be a list of at most 32 condition types")
        return value

    def validate_unhealthy_conditions(self, value):
        return self._condition_list(value)

    def validate_degraded_conditions(self, value):
        return self._condition_list(value)

    def validate_allowed_undeclared_resources(self, value):
        if (
            not isinstance(value, list)
            or len(value) > 32
            or not all(isinstance(v, str) and 0 < len(v) <= 253 for v in value)
        ):
            raise serializers.ValidationError("must be a list of at most 32 resource names (1-253 characters)")
        return value


# --- bootstrap tokens ------------------------------------------------------------------------------------


class BootstrapTokenSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", read_only=True)
    owner = serializers.SlugRelatedField(slug_field="username", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    state = serializers.SerializerMethodField()

    class Meta:
        model = BootstrapToken
        fields = [
            "id", "pool", "node", "description", "prefix", "expires_at", "max_uses", "uses", "owner", "created_by",
            "created_at", "revoked_at", "state",
        ]  # fmt: skip

    def get_state(self, token: BootstrapToken) -> str:
        if token.revoked_at is not None:
            return "revoked"
        if token.expires_at <= timezone.now():
            return "expired"
        return "exhausted" if token.uses >= token.max_uses else "active"


class BootstrapTokenCreateSerializer(StrictSerializer):
    """``pool`` (a token enrolling new nodes into it), or ``node`` (a token letting an agent take
    that node over, fleet.takeover; its pool is the node's), or both when they agree."""

    pool = serializers.SlugRelatedField(slug_field="name", queryset=Pool.objects.all(), required=False)
    # Checked by the service (400 unknown_node, not a field error): the operator reads the same
    # code as every other "no such node" answer to a body member.
    node = serializers.CharField(max_length=64, required=False)
    description = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    expires_at = AwareDateTimeField(required=False)
    ttl_seconds = serializers.IntegerField(min_value=60, max_value=365 * 86400, required=False)
    max_uses = serializers.IntegerField(min_value=1, max_value=100_000, default=1)
    owner = serializers.SlugRelatedField(
        slug_field="username", queryset=get_user_model().objects.all(), required=False, allow_null=True
    )

    def validate(self, attrs):
        if "pool" not in attrs and "node" not in attrs:
            raise serializers.ValidationError({"pool": ["send pool, or node for a token naming a node"]})
        if "node" in attrs and attrs.get("owner") is not None:
            raise serializers.ValidationError({"owner": ["a token naming a node carries the node's owner"]})
        if "expires_at" in attrs and "ttl_seconds" in attrs:
            raise serializers.ValidationError("send expires_at or ttl_seconds, not both")
        if "expires_at" not in attrs:
            attrs["expires_at"] = timezone.now() + timezone.timedelta(seconds=attrs.pop("ttl_seconds", 86400))
        return attrs


# --- enrollment ------------------------------------------------------------------------------------------


class AttestationSerializer(StrictSerializer):
    document = serializers.CharField(max_length=64 * 1024)
    signature = serializers.CharField(max_length=1024)


class EnrollmentSerializer(StrictSerializer):
    """``POST /node-enrollments`` (docs/api-contract.md). ``pool``, when sent, must be the token's pool;
    ``node`` (the id of the node the agent already is), when sent, must be the node the token names."""

    protected_fields = PROTECTED_NODE_FIELDS
    bootstrap_token = serializers.CharField(max_length=200)
    pool = serializers.SlugField(max_length=63, required=False)
    node = serializers.UUIDField(required=False)
    hostname = serializers.CharField(max_length=253, required=False, allow_blank=True, default="")
    display_name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    addresses = serializers.ListField(child=serializers.CharField(max_length=64), max_length=32, required=False)
    agent_version = serializers.CharField(max_length=64)
    labels = serializers.JSONField(required=False, default=dict)
    capability = serializers.JSONField()
    attestation = AttestationSerializer(required=False, allow_null=True)
    # The device inventory (fleet.devices, DEVICES-WIRE.md): bad devices are refused one by one
    # with an event, never the enrollment.
    devices = serializers.JSONField(required=False, allow_null=True, default=None)
    boot_id = serializers.CharField(max_length=64, required=False, allow_blank=True, default="")

    def validate_addresses(self, value: list[str]) -> list[str]:
        for address in value:
            try:
                ipaddress.ip_address(address)
            except ValueError as exc:
                raise serializers.ValidationError(f"{address!r} is not an IP address") from exc
        return value

    def validate_labels(self, value: Any) -> dict[str, str]:
        try:
            return parse_labels(value, field="labels")
        except CapabilityError as exc:
            _raise_capability(exc, "labels")

    def validate_capability(self, value: Any) -> dict[str, Any]:
        try:
            return parse_capability(value, field="capability")
        except CapabilityError as exc:
            _raise_capability(exc, "capability")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Refuse label keys reserved to operators (Kubernetes' NodeRestriction; fleet.labels)."""
        errors = reserved_label_errors(attrs.get("labels") or {}, hostname=attrs.get("hostname", ""))
        if errors:
            keys = ", ".join(e["field"].removeprefix("labels.") for e in errors)
            raise Problem(f"A node may not set these labels: {keys}.", RESERVED_LABEL, errors=errors)
        return attrs


# --- node credentials, operator actions and benchmarks -------------------------------------------------------


class ReasonSerializer(StrictSerializer):
    reason = serializers.CharField(max_length=1000, required=False, allow_blank=True, default="")


class CredentialIssueSerializer(ReasonSerializer):
    ttl_seconds = serializers.IntegerField(min_value=60, max_value=7 * 86400, required=False)


class CredentialRotateSerializer(StrictSerializer):
    protected_fields = PROTECTED_NODE_FIELDS
    agent_version = serializers.CharField(max_length=64, required=False, allow_blank=True, default="")


class BenchmarkResultSerializer(StrictSerializer):
    """Benchmark figures from the node: cpu in millicores, memory in bytes, duration in seconds."""

    cpu_millicores = serializers.IntegerField(min_value=0, max_value=10**9)
    memory_bytes = serializers.IntegerField(min_value=0, max_value=2**62)
    duration_seconds = serializers.FloatField(min_value=0, max_value=86400, required=False, default=0.0)
    details = serializers.DictField(required=False, default=dict)

    def validate_duration_seconds(self, value: float) -> float:
        if not math.isfinite(value):
            raise serializers.ValidationError("must be a finite number")
        return value

    def validate_details(self, value: dict) -> dict:
        # allow_nan=False: the parser accepts NaN/Infinity, which PostgreSQL's jsonb refuses.
        try:
            encoded = json.dumps(value, allow_nan=False)
        except ValueError as exc:
            raise serializers.ValidationError("details must be plain JSON (no NaN or Infinity)") from exc
        if len(encoded) > 8192:
            raise serializers.ValidationError("details are limited to 8 KiB")
        return value
