"""The lease request's body as a serializer: the OpenAPI schema of ``POST /node-leases`` (component
LeaseCreateRequest), of placement previews and of a shape's device requests.

The request is validated by hand (leases.spec.parse_spec: the grant is the hot path, and each bad
member gets its own problem code); LeaseCreateRequestSerializer states the same rules for the
schema, and tests/leases/test_validator_equivalence.py checks that the two accept exactly the same
bodies and name the same fields. What it shares rather than restates: the patterns and limits
(leases.spec, leases.device_requests, leases.reliability), the quantity grammar
(nodepool.quantity.to_canonical), the numeric comparison (nodepool.comparison) and which device
types the fleet knows (leases.spec.known_device_type).

As the hand validator does: a member the request does not know is refused (at the top level by its
name, inside an object at that object, ``tolerations[0]``); an optional member may be null, which
means absent (``queue`` excepted); a string whose empty value is listed below means its default.
"""

from __future__ import annotations

from decimal import Decimal

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.settings import api_settings

from nodepool.api.strict import JSONChoice, JSONInteger, JSONString, StrictBooleanField, WholeMatch
from nodepool.comparison import NUMERIC_OPERATORS, Comparison, ComparisonError, parse_number
from nodepool.quantity import RESOURCE_NAME, QuantityError, to_canonical

from ..choices import ATTRIBUTES, COLOCATE, NUMERIC_ATTRIBUTES, SpreadMode
from ..device_requests import KNOWN_DEVICE_TYPES, MAX_CONSTRAINTS, MAX_COUNT, MAX_DEVICE_REQUESTS
from ..device_requests import OPERATORS as DEVICE_OPERATORS
from ..preview import MAX_COUNT as MAX_PREVIEW_COUNT
from ..reliability import MAX_NODE_CONSTRAINTS, NODE_ATTRIBUTES
from ..spec import (
    INTEGER_VALUE,
    LABEL_KEY,
    MAX_COMMAND_ARGS,
    MAX_LABEL_VALUE,
    MAX_PRIORITY,
    MAX_SHAPE_VERSION,
    MAX_TERM_VALUES,
    MAX_TERMS,
    MAX_TOLERATION_SECONDS,
    MAX_TTL,
    OPERATORS,
    STANDARD_RESOURCES,
    TAINT_EFFECTS,
    TOLERATION_OPERATORS,
    TOPOLOGY_KEYS,
    WORKLOAD_ID,
    known_device_type,
)

# leases.device_requests writes these limits as literals (restated here; the equivalence test keeps them equal).
MAX_DEVICE_TYPE = 253
MAX_DEVICE_VALUE = 200
NON_FIELD = api_settings.NON_FIELD_ERRORS_KEY


class _Object(serializers.Serializer):
    """A JSON object of exactly these members: another member is refused at the object itself."""

    def to_internal_value(self, data):
        if isinstance(data, dict):
            unknown = sorted(map(str, set(data) - set(self.fields)))
            if unknown:
                raise serializers.ValidationError({NON_FIELD: [f"Unknown member(s): {', '.join(unknown)}."]})
        return super().to_internal_value(data)


class _Strings(serializers.ListField):
    """A list of JSON strings (``command``, a term's ``values``), refused as a whole, not item by item."""

    def __init__(self, **kwargs):
        super().__init__(child=JSONString(allow_blank=True), **kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, list) or not all(isinstance(item, str) for item in data):
            raise serializers.ValidationError("A list of strings.")
        return list(data)  # the length: ListField's max_length validator, at this field


class _JSONObject(serializers.DictField):
    """A JSON object whose entries ``entry(name, value)`` checks; errors name the entry."""

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            self.fail("not_a_dict", input_type=type(data).__name__)
        out, errors = {}, {}
        for name, value in data.items():
            try:
                out[name] = self.entry(name, value)
            except serializers.ValidationError as exc:
                errors[name] = exc.detail
        if errors:
            raise serializers.ValidationError(errors)
        return out

    def entry(self, name, value):
        raise NotImplementedError


@extend_schema_field(
    {
        "type": "object",
        "additionalProperties": {
            "oneOf": [
                {"type": "string", "description": 'a Kubernetes quantity: "500m" cpu, "4Gi" memory, "2"'},
                {"type": "number", "minimum": 0, "description": "cores, bytes or a count"},
            ]
        },
        # OpenAPI 3.0 has no propertyNames: the names' rule is said in words.
        "description": "resource name -> quantity: cpu, memory, ephemeral-storage, pods, or a '<domain>/<name>' "
        'extended resource such as nvidia.com/gpu ({"cpu": "500m", "memory": "4Gi"}); a zero asks for nothing. '
        "A malformed, negative or too fine quantity is 400 invalid_quantity, another name 400 unknown_resource",
    }
)
class _Quantities(_JSONObject):
    """Resource name → quantity, as canonical integers (zeros kept: the request's rules read them)."""

    def entry(self, name, value):
        if not RESOURCE_NAME.fullmatch(name):
            raise serializers.ValidationError("Not a valid resource name.")
        try:
            amount = to_canonical(name, value)
        except QuantityError as exc:
            raise serializers.ValidationError(str(exc)) from exc
        if "/" not in name and name not in STANDARD_RESOURCES:
            raise serializers.ValidationError(f"Unknown resource; use one of {sorted(STANDARD_RESOURCES)} or a "
                                              "'<domain>/<name>' extended resource.")  # fmt: skip
        return amount


@extend_schema_field(
    {
        "type": "object",
        "additionalProperties": {"type": "string", "maxLength": MAX_LABEL_VALUE},
        "description": "label key (a Kubernetes label key: zone, topology.kubernetes.io/zone) -> the value it "
        "must have",
    }
)
class _LabelMap(_JSONObject):
    def entry(self, name, value):
        if not LABEL_KEY.fullmatch(name):
            raise serializers.ValidationError("Not a valid label key.")
        if not isinstance(value, str) or len(value) > MAX_LABEL_VALUE:
            raise serializers.ValidationError(f"A string of at most {MAX_LABEL_VALUE} characters.")
        return value


@extend_schema_field(
    {
        "type": "object",
        "additionalProperties": {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}]},
        "description": 'feature name -> the value the node\'s verified feature must have: {"arch": "arm64"}',
    }
)
class _Features(serializers.Field):
    """Feature name → a string, integer or boolean; refused as a whole."""

    def to_internal_value(self, data):
        if not isinstance(data, dict) or not all(isinstance(v, str | int | bool) for v in data.values()):
            raise serializers.ValidationError("An object of feature name to a string, integer or boolean.")
        return data

    def to_representation(self, value):
        return value


@extend_schema_field(
    {
        "oneOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "string"}],
        "description": 'a number from 0 to 1, or a numeric string such as "0.99"',
    }
)
class _Reliability(serializers.Field):
    def to_internal_value(self, data):
        try:
            number = parse_number(data)
        except ComparisonError as exc:
            raise serializers.ValidationError(str(exc)) from exc
        if not Decimal(0) <= number <= Decimal(1):
            raise serializers.ValidationError("Reliability is a number from 0 to 1.")
        return number

    def to_representation(self, value):
        return value


# --- selectors, affinity, tolerations, spread (Kubernetes' NodeSelectorRequirement and Toleration) ---


class NodeSelectorRequirementSerializer(_Object):
    key = JSONString(validators=[WholeMatch(LABEL_KEY)], help_text="a label key")
    operator = JSONChoice(choices=list(OPERATORS))
    values = _Strings(
        max_length=MAX_TERM_VALUES,
        required=False,
        allow_null=True,
        help_text="In/NotIn: at least one; Exists/DoesNotExist: none; Gt/Lt: exactly one integer",
    )

    def validate(self, attrs):
        operator, values = attrs["operator"], attrs.get("values") or []
        if operator in ("In", "NotIn") and not values:
            raise serializers.ValidationError({"values": [f"{operator} needs at least one value."]})
        if operator in ("Exists", "DoesNotExist") and values:
            raise serializers.ValidationError({"values": [f"{operator} takes no values."]})
        if operator in ("Gt", "Lt") and (len(values) != 1 or not INTEGER_VALUE.fullmatch(values[0])):
            raise serializers.ValidationError({"values": [f"{operator} needs exactly one integer value."]})
        return attrs


class PreferredTermSerializer(_Object):
    weight = JSONInteger(min_value=1, max_value=100, help_text="Kubernetes' range")
    term = NodeSelectorRequirementSerializer()

    def to_internal_value(self, data):
        # leases.spec names the item, not its member, when the term is missing.
        if isinstance(data, dict) and "term" not in data:
            raise serializers.ValidationError({NON_FIELD: ["Must be {'weight': 1..100, 'term': {...}}."]})
        return super().to_internal_value(data)


class AffinitySerializer(_Object):
    required = serializers.ListField(
        child=NodeSelectorRequirementSerializer(),
        max_length=MAX_TERMS,
        required=False,
        allow_null=True,
        help_text="every term must match",
    )
    preferred = serializers.ListField(
        child=PreferredTermSerializer(),
        max_length=MAX_TERMS,
        required=False,
        allow_null=True,
        help_text="each matching term adds its weight to the node's score",
    )


class TolerationSerializer(_Object):
    """Kubernetes' Toleration; ``toleration_seconds`` for NoExecute taints."""

    key = JSONString(
        validators=[WholeMatch(LABEL_KEY)],
        required=False,
        allow_null=True,
        allow_blank=True,
        help_text="a taint key; empty (with operator Exists): every taint",
    )
    operator = JSONChoice(
        choices=list(TOLERATION_OPERATORS), required=False, allow_null=True, allow_blank=True, help_text="empty: Equal"
    )
    value = JSONString(required=False, allow_null=True, allow_blank=True, help_text="empty with operator Exists")
    effect = JSONChoice(
        choices=list(TAINT_EFFECTS), required=False, allow_null=True, allow_blank=True, help_text="empty: every effect"
    )
    toleration_seconds = JSONInteger(
        min_value=0,
        max_value=MAX_TOLERATION_SECONDS,
        required=False,
        allow_null=True,
        help_text="NoExecute: how long the lease may stay once a matching taint appears (null: for ever)",
    )

    def validate(self, attrs):
        key, operator = attrs.get("key") or "", attrs.get("operator") or "Equal"
        if operator == "Exists" and attrs.get("value"):
            raise serializers.ValidationError({"value": ["Must be empty when operator is Exists."]})
        if not key and operator != "Exists":
            raise serializers.ValidationError({"operator": ["An empty key needs operator Exists."]})
        return attrs


class SpreadSerializer(_Object):
    group = JSONString(validators=[WholeMatch(WORKLOAD_ID)], help_text="the leases spread (or kept apart) together")
    topology_key = JSONString(
        validators=[WholeMatch(LABEL_KEY)],
        required=False,
        allow_null=True,
        allow_blank=True,
        help_text=f"{', '.join(TOPOLOGY_KEYS)} or any label key; empty: host",
    )
    mode = JSONChoice(
        choices=list(SpreadMode.values),
        required=False,
        allow_null=True,
        allow_blank=True,
        help_text="spread (soft) or anti-affinity (hard: one lease of the group per domain); empty: spread",
    )


# --- devices (leases.device_requests) -------------------------------------------------------------


class DeviceConstraintSerializer(_Object):
    attribute = JSONChoice(choices=sorted(ATTRIBUTES), help_text=f"numeric: {', '.join(NUMERIC_ATTRIBUTES)}")
    operator = JSONChoice(choices=list(DEVICE_OPERATORS), help_text="numeric attributes: =, !=, >, >=, <, <=; "
                          "text ones: =, !=, glob")  # fmt: skip
    value = serializers.JSONField(
        help_text='numeric attributes: a number or a quantity ("40Gi"); text ones: a string of at most '
        f"{MAX_DEVICE_VALUE} characters, a glob pattern of 1-{MAX_DEVICE_VALUE} (shell-style, case-sensitive)"
    )

    def validate(self, attrs):
        attribute, operator, value = attrs["attribute"], attrs["operator"], attrs["value"]
        numeric = attribute in NUMERIC_ATTRIBUTES
        if operator == "glob":
            if numeric:
                raise serializers.ValidationError({"operator": [f"glob applies to text attributes, not {attribute}."]})
            if not isinstance(value, str) or not 0 < len(value) <= MAX_DEVICE_VALUE:
                raise serializers.ValidationError({"value": [f"A glob pattern of 1-{MAX_DEVICE_VALUE} characters."]})
        elif numeric:
            try:
                Comparison.parse(operator, value)
            except ComparisonError as exc:
                raise serializers.ValidationError({"value": [str(exc)]}) from exc
        elif operator not in ("=", "!="):
            raise serializers.ValidationError({"operator": [f"{attribute} is text: use =, != or glob."]})
        elif not isinstance(value, str) or len(value) > MAX_DEVICE_VALUE:
            raise serializers.ValidationError({"value": [f"A string of at most {MAX_DEVICE_VALUE} characters."]})
        return attrs


def _device_type(kind: str) -> None:
    if "/" not in kind:
        raise serializers.ValidationError("A device type '<domain>/<name>'.")
    if len(kind) <= MAX_DEVICE_TYPE and kind not in KNOWN_DEVICE_TYPES and not known_device_type(kind):
        raise serializers.ValidationError(f"No device of type {kind!r} is known to the fleet.")


class DeviceRequestSerializer(_Object):
    type = JSONString(
        max_length=MAX_DEVICE_TYPE,
        validators=[_device_type],
        help_text=f"'<domain>/<name>': {', '.join(sorted(KNOWN_DEVICE_TYPES))}, or a type some live device has "
        "(else 400 unknown_device_type)",
    )
    count = JSONInteger(min_value=1, max_value=MAX_COUNT, required=False, default=1)
    constraints = serializers.ListField(
        child=DeviceConstraintSerializer(), max_length=MAX_CONSTRAINTS, required=False, allow_null=True
    )
    colocate = JSONChoice(
        choices=list(COLOCATE),
        required=False,
        allow_null=True,
        allow_blank=True,
        help_text="every device of the request shares it; empty: no co-location",
    )


# --- node attributes (leases.reliability) ---------------------------------------------------------


class NodeConstraintSerializer(_Object):
    attribute = JSONChoice(choices=list(NODE_ATTRIBUTES), help_text="reliability (the only node attribute so far)")
    operator = JSONChoice(choices=list(NUMERIC_OPERATORS))
    value = _Reliability()


class NodePreferenceSerializer(NodeConstraintSerializer):
    weight = JSONInteger(min_value=1, max_value=100, help_text="Kubernetes' range")


# --- the request ----------------------------------------------------------------------------------


class LeaseCreateRequestSerializer(serializers.Serializer):
    """``POST /node-leases`` (docs/leases.md, "Asking for a lease"). Any bad member is a 400 naming it
    (``errors[0].field``); nothing is stored."""

    workload_id = JSONString(
        max_length=200,
        validators=[WholeMatch(WORKLOAD_ID)],
        help_text="the job's key: 1-200 letters, digits and ._:/@-, starting with a letter or digit",
    )
    pool = JSONString(help_text="the pool's name (unknown: 400 unknown_pool)")
    resources = _Quantities(required=False, allow_null=True)
    shape = JSONString(
        required=False,
        allow_null=True,
        allow_blank=True,
        help_text="a shape's name instead of resources (not both); empty: none",
    )
    shape_version = JSONInteger(
        min_value=0,
        max_value=MAX_SHAPE_VERSION,
        required=False,
        allow_null=True,
        help_text="the shape's version to use; 0 or absent: its latest",
    )
    node_selector = _LabelMap(required=False, allow_null=True)
    affinity = AffinitySerializer(required=False, allow_null=True)
    tolerations = serializers.ListField(
        child=TolerationSerializer(), max_length=MAX_TERMS, required=False, allow_null=True
    )
    features = _Features(required=False, allow_null=True)
    spread = SpreadSerializer(required=False, allow_null=True)
    ttl_seconds = JSONInteger(
        min_value=1, max_value=MAX_TTL, required=False, allow_null=True, help_text="absent: 600; renew before it passes"
    )
    priority = JSONInteger(
        min_value=-MAX_PRIORITY,
        max_value=MAX_PRIORITY,
        required=False,
        allow_null=True,
        help_text="queued requests are placed highest first; absent: 0",
    )
    queue = StrictBooleanField(required=False, help_text="wait (202) instead of 409 when nothing fits; absent: false")
    command = _Strings(
        max_length=MAX_COMMAND_ARGS, required=False, allow_null=True, help_text="what the node's agent runs (argv)"
    )
    devices = serializers.ListField(
        child=DeviceRequestSerializer(),
        max_length=MAX_DEVICE_REQUESTS,
        required=False,
        allow_null=True,
        help_text="device requests (docs/leases.md, Devices); their counts join resources",
    )
    node_constraints = serializers.ListField(
        child=NodeConstraintSerializer(),
        max_length=MAX_NODE_CONSTRAINTS,
        required=False,
        allow_null=True,
        help_text="node attribute filters, e.g. reliability >= 0.99 (docs/leases.md, Reliability)",
    )
    node_preferences = serializers.ListField(
        child=NodePreferenceSerializer(),
        max_length=MAX_NODE_CONSTRAINTS,
        required=False,
        allow_null=True,
        help_text="weighted node attribute preferences that score (docs/leases.md, Reliability)",
    )

    def to_internal_value(self, data):
        if isinstance(data, dict):
            unknown = sorted(map(str, set(data) - set(self.fields)))
            if unknown:
                raise serializers.ValidationError({name: ["Unknown member."] for name in unknown})
            shape = data.get("shape")
            if isinstance(shape, str) and shape and data.get("resources"):  # before the resources are read
                raise serializers.ValidationError({"resources": ["Give either resources or a shape, not both."]})
        return super().to_internal_value(data)

    def validate(self, attrs):
        shape = attrs.get("shape") or ""
        resources = {name: amount for name, amount in (attrs.get("resources") or {}).items() if amount > 0}
        devices = attrs.get("devices") or []
        if not shape and not resources and not devices:
            raise serializers.ValidationError({"resources": ["Ask for at least one resource (or name a shape)."]})
        totals: dict[str, int] = {}
        for request in devices:
            totals[request["type"]] = totals.get(request["type"], 0) + request["count"]
        for kind, total in totals.items():
            if kind in resources and resources[kind] != total:
                raise serializers.ValidationError(
                    {"resources": {kind: [f"Disagrees with the devices requested ({total}); give one or the other."]}}
                )
        return attrs


class PlacementPreviewRequestSerializer(LeaseCreateRequestSerializer):
    """``POST /placement-previews``: a lease request whose ``workload_id`` and ``pool`` may be left out
    (no pool: every pool), and how many such leases to fit."""

    workload_id = JSONString(max_length=200, validators=[WholeMatch(WORKLOAD_ID)], required=False)
    pool = JSONString(required=False, allow_null=True, help_text="one pool; absent or null: every pool")
    count = JSONInteger(min_value=1, max_value=MAX_PREVIEW_COUNT, required=False, default=1)
