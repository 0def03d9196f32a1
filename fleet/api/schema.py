"""OpenAPI (drf-spectacular) shapes of the fleet endpoints: responses, and the status report's body
(the node credential scheme is registered once, in nodepool/api/schema.py)."""

from drf_spectacular.utils import extend_schema_field, inline_serializer
from rest_framework import serializers

from nodepool.api.fields import AwareDateTimeField
from nodepool.api.strict import JSONUUID, JSONChoice, JSONInteger, JSONString, StrictBooleanField, WholeMatch
from nodepool.quantity import MAX_CANONICAL, RESOURCE_NAME, QuantityError, to_canonical

from .. import heartbeats as hb
from ..errors import INVALID_QUANTITY
from ..health import CONDITION_STATUSES
from .heartbeat_serializers import CONDITION_TYPE, LEASE_STATE

EnrollmentResponse = inline_serializer(
    "EnrollmentResponse",
    {
        "node_id": serializers.UUIDField(),
        "incarnation": serializers.IntegerField(),
        "credential": serializers.CharField(),
        "credential_expires_at": serializers.DateTimeField(),
        "lifecycle": serializers.CharField(),
        "heartbeat_interval": serializers.IntegerField(),
        "renewal_interval": serializers.FloatField(),
        "next_renewal_in": serializers.FloatField(),
        "pool": serializers.CharField(),
    },
)
CredentialResponse = inline_serializer(
    "CredentialResponse",
    {
        "node_id": serializers.UUIDField(),
        "credential": serializers.CharField(),
        "expires_at": serializers.DateTimeField(),
        "issuer": serializers.CharField(),
        "version": serializers.IntegerField(),
    },
)
RotationResponse = inline_serializer(
    "RotationResponse",
    {
        "credential": serializers.CharField(),
        "expires_at": serializers.DateTimeField(),
        "previous_valid_until": serializers.DateTimeField(),
    },
)
RevocationResponse = inline_serializer(
    "RevocationResponse",
    {"node_id": serializers.UUIDField(), "revoked": serializers.IntegerField(), "version": serializers.IntegerField()},
)
BenchmarkResponse = inline_serializer(
    "BenchmarkResponse",
    {"nonce": serializers.CharField(), "status": serializers.CharField(), "completed_at": serializers.DateTimeField()},
)


# --- the status report's body ---------------------------------------------------------------------
# The heartbeat is validated by hand (fleet.api.heartbeat_serializers.parse_heartbeat: a serializer
# tree cost more than the heartbeat's UPDATE); HeartbeatSerializer describes the same body for the
# schema (component HeartbeatRequest), and tests/fleet/test_validator_equivalence.py checks that the
# two accept exactly the same bodies and name the same fields. Its fields are strict like the hand
# validator: a JSON integer, string or boolean, never one converted from another type.


class _ReportTime(AwareDateTimeField):
    """An RFC 3339 time with an offset, as a string of at most 64 characters."""

    def to_internal_value(self, value):
        if not isinstance(value, str) or len(value) > 64:
            self.fail("invalid", format="RFC 3339")
        return super().to_internal_value(value)


class _UniqueItems(serializers.ListField):
    """A list whose items' ``key`` is unique: each later copy is an error at its ``key``."""

    def __init__(self, *, key: str, **kwargs):
        self.key = key
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        items = super().to_internal_value(data)
        seen, errors = set(), {}
        for index, item in enumerate(items):
            value = str(item[self.key])
            if value in seen:
                errors[index] = {self.key: [f"{value[:64]} appears twice."]}
            seen.add(value)
        if errors:
            raise serializers.ValidationError(errors)
        return items


@extend_schema_field(
    {
        "type": "object",
        "maxProperties": hb.MAX_USAGE_ENTRIES,
        "additionalProperties": {
            "oneOf": [
                {"type": "integer", "minimum": 0, "maximum": MAX_CANONICAL - 1},
                {"type": "string", "description": 'a quantity: "500m" cpu, "4Gi" memory'},
            ]
        },
        # OpenAPI 3.0 has no propertyNames: the names' rule is said in words.
        "description": "resource name (a Kubernetes resource name: cpu, memory, nvidia.com/gpu) -> amount in "
        "canonical units (cpu millicores, bytes) or a quantity string",
    }
)
class _Usage(serializers.DictField):
    """Resource name → canonical integer or quantity string, at most MAX_USAGE_ENTRIES entries."""

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            self.fail("not_a_dict", input_type=type(data).__name__)
        if len(data) > hb.MAX_USAGE_ENTRIES:
            raise serializers.ValidationError(f"At most {hb.MAX_USAGE_ENTRIES} resources.")
        out, errors = {}, {}
        for name, amount in data.items():
            if not RESOURCE_NAME.fullmatch(name):
                errors[name] = ["Not a valid resource name."]
            elif isinstance(amount, bool) or not isinstance(amount, int | str):
                errors[name] = ["An integer in canonical units or a quantity string."]
            else:
                try:
                    out[name] = amount if isinstance(amount, int) else to_canonical(name, amount)
                except QuantityError as exc:
                    errors[name] = [serializers.ErrorDetail(str(exc), code=INVALID_QUANTITY)]
                    continue
                if not 0 <= out[name] < MAX_CANONICAL:
                    errors[name] = [f"Between 0 and {MAX_CANONICAL - 1}."]
        if errors:
            raise serializers.ValidationError(errors)
        return out


class ConditionReportSerializer(serializers.Serializer):
    type = JSONString(max_length=hb.MAX_CONDITION_TYPE, validators=[WholeMatch(CONDITION_TYPE)])
    status = JSONChoice(choices=list(CONDITION_STATUSES))
    reason = JSONString(max_length=hb.MAX_REASON, required=False, allow_null=True, allow_blank=True)
    message = JSONString(max_length=hb.MAX_MESSAGE, required=False, allow_null=True, allow_blank=True)


class LeaseReportSerializer(serializers.Serializer):
    lease_id = JSONUUID()
    fencing_token = JSONInteger(min_value=0, max_value=2**63 - 1)
    state = JSONString(
        max_length=hb.MAX_LEASE_STATE,
        validators=[WholeMatch(LEASE_STATE)],
        help_text="what the agent sees the workload doing: a lower-case word such as running",
    )


class HeartbeatSerializer(serializers.Serializer):
    """The status report's body (docs/api-contract.md, "Heartbeat"). Over a limit (lengths, counts)
    the answer is 422 ``heartbeat_limit_exceeded``; any other refusal is 400. Members not listed
    are ignored (not yet refused as elsewhere; docs/api-contract.md, "Bodies")."""

    incarnation = JSONInteger(min_value=1, max_value=hb.MAX_COUNTER - 1)
    sequence = JSONInteger(min_value=0, max_value=hb.MAX_COUNTER - 1)
    observed_at = _ReportTime()
    agent_version = JSONString(max_length=hb.MAX_AGENT_VERSION, required=False, allow_null=True, allow_blank=True)
    ready = StrictBooleanField(required=False, help_text="false when absent")
    ready_reason = JSONString(max_length=hb.MAX_READY_REASON, required=False, allow_null=True, allow_blank=True)
    conditions = _UniqueItems(
        key="type", child=ConditionReportSerializer(), max_length=hb.MAX_CONDITIONS, required=False, allow_null=True
    )
    usage = _Usage(required=False, allow_null=True)
    leases = _UniqueItems(
        key="lease_id", child=LeaseReportSerializer(), max_length=hb.MAX_LEASES, required=False, allow_null=True
    )
    devices = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text="the node's devices (docs/api-contract.md, Devices): a bad device is refused alone, never the report",
    )
    boot_id = JSONString(max_length=64, required=False, allow_null=True, allow_blank=True)
    benchmark = serializers.JSONField(required=False, allow_null=True, help_text="ignored (agents send null)")
