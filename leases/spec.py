"""The placement request: validation of the wire shape into a :class:`PlacementSpec`.

Every rule here is a 400 with the offending field named, raised before anything is stored.
Selector, affinity and toleration semantics follow Kubernetes (k8s.io/api/core/v1 NodeSelector
Requirement and Toleration; pkg/scheduler/framework/plugins/{nodeaffinity,tainttoleration}).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from fleet.errors import INVALID_QUANTITY, UNKNOWN_POOL
from fleet.models import Device
from nodepool.api.problems import Problem
from nodepool.quantity import BYTE_RESOURCES, CPU, QuantityError, parse_resources

from .choices import SpreadMode
from .device_requests import DeviceRequest, DeviceRequestError, combined, parse_device_requests
from .errors import (
    EMPTY_REQUEST,
    INVALID_AFFINITY,
    INVALID_REQUEST,
    INVALID_SELECTOR,
    INVALID_SPREAD,
    INVALID_TOLERATION,
    UNKNOWN_RESOURCE,
)
from .reliability import NodeConstraint, NodeConstraintError, parse_node_constraints, parse_node_preferences

# Resources without a domain prefix that nodepool knows; anything else must be an extended
# resource written ``<domain>/<name>`` (Kubernetes' rule for extended resources).
STANDARD_RESOURCES = frozenset({CPU, *BYTE_RESOURCES, "pods"})
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
TOLERATION_OPERATORS = ("Equal", "Exists")
# Topology aliases → the label keys looked up on a node, first present wins.
TOPOLOGY_KEYS = {
    "host": ("kubernetes.io/hostname",),
    "rack": ("topology.kubernetes.io/rack", "rack"),
    "zone": ("topology.kubernetes.io/zone", "zone"),
    "region": ("topology.kubernetes.io/region", "region"),
    "provider": ("nodepool.dev/provider", "provider"),
}
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
WORKLOAD_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,199}$")
MAX_TTL = 7 * 24 * 3600
MAX_TERMS = 32
# A toleration's seconds are added to a datetime by the NoExecute sweeps: 10**15 overflowed there
# and stopped every eviction. About 68 years (int32's maximum); null tolerates for ever.
MAX_TOLERATION_SECONDS = 2**31 - 1
MAX_TERM_VALUES = 64
MAX_LABEL_VALUE = 63
# Gt/Lt compare a label as an int64 (Kubernetes), written with at most 18 digits.
INTEGER_VALUE = re.compile(r"-?\d{1,18}")
MAX_COMMAND_ARGS = 256
MAX_PRIORITY = 1000  # priority is -MAX_PRIORITY .. MAX_PRIORITY
MAX_SHAPE_VERSION = 2**31


def bad(field_name: str, message: str, code: str = INVALID_REQUEST) -> Problem:
    """A 400 naming ``field_name`` (also in ``errors`` like DRF validation errors)."""
    return Problem(f"{field_name}: {message}", code, errors=[{"field": field_name, "code": code, "message": message}])


@dataclass(frozen=True)
class Requirement:
    """One node selector requirement: ``key`` ``operator`` ``values`` (Kubernetes semantics)."""

    key: str
    operator: str
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.operator == "In":
            return present and value in self.values
        if self.operator == "NotIn":
            return not present or value not in self.values  # absent label satisfies NotIn
        if self.operator == "Exists":
            return present
        if self.operator == "DoesNotExist":
            return not present
        # Gt/Lt: the label must parse as an integer (Kubernetes compares int64s).
        try:
            number = int(str(value))
        except (TypeError, ValueError):
            return False
        bound = int(self.values[0])
        return number > bound if self.operator == "Gt" else number < bound


@dataclass(frozen=True)
class Toleration:
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""
    # Kubernetes' tolerationSeconds: how long a lease may stay once a matching NoExecute taint
    # appears (None: for ever). Ignored for other effects.
    toleration_seconds: int | None = None

    def tolerates(self, taint: dict) -> bool:
        """Kubernetes' ``Toleration.ToleratesTaint``: empty effect matches all effects, empty key
        with ``Exists`` matches every taint."""
        if self.effect and self.effect != taint.get("effect"):
            return False
        if self.key and self.key != taint.get("key"):
            return False
        if self.operator == "Exists":
            return True
        return self.value == str(taint.get("value", "") or "")


@dataclass(frozen=True)
class PlacementSpec:
    """A validated placement request. ``resources`` are canonical integers."""

    workload_id: str
    pool: str
    resources: dict[str, int]
    shape: str = ""
    shape_version: int | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    required: tuple[Requirement, ...] = ()
    preferred: tuple[tuple[int, Requirement], ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    features: dict[str, Any] = field(default_factory=dict)
    spread_group: str = ""
    topology_key: str = ""
    spread_mode: str = SpreadMode.SPREAD
    ttl_seconds: int = 600
    priority: int = 0
    queue: bool = False
    command: tuple[str, ...] = ()
    # Device requests (leases.device_requests): explicit ones plus an implicit one per device-like
    # count resource; their counts are part of ``resources`` too, so capacity is reserved as before.
    devices: tuple[DeviceRequest, ...] = ()
    # Node attribute comparisons (leases.reliability: ``reliability >= 0.99``): filters, and
    # weighted preferences that score.
    node_constraints: tuple[NodeConstraint, ...] = ()
    node_preferences: tuple[tuple[int, NodeConstraint], ...] = ()

    @property
    def device_constrained(self) -> bool:
        """Whether placement must look at device rows (anything beyond a plain count)."""
        return any(not r.implicit for r in self.devices)

    @property
    def anti_affinity(self) -> bool:
        """Whether the request keeps off every topology domain its spread group already holds."""
        return bool(self.spread_group) and self.spread_mode == SpreadMode.ANTI_AFFINITY

    @property
    def topology_labels(self) -> tuple[str, ...]:
        return TOPOLOGY_KEYS.get(self.topology_key, (self.topology_key,)) if self.topology_key else ()


def _text(value: Any, default: str) -> Any:
    """A string member: ``default`` when it is missing, null or empty. Any other value is checked
    as given: a falsy value of another type (``false``, ``0``, ``[]``) is refused, not read as absent."""
    return default if value is None or value == "" else value


def _given(value: Any, default: Any) -> Any:
    """A list or object member: ``default`` when it is missing or null (``false``, ``0``, ``""`` are
    refused by the type check that follows, not read as absent)."""
    return default if value is None else value


def _str_map(value: Any, field_name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(field_name, "must be an object of label key to string value", INVALID_SELECTOR)
    out = {}
    for key, val in value.items():
        if not LABEL_KEY.fullmatch(str(key)):
            raise bad(f"{field_name}.{key}", "not a valid label key", INVALID_SELECTOR)
        if not isinstance(val, str) or len(val) > MAX_LABEL_VALUE:
            raise bad(f"{field_name}.{key}", "must be a string of at most 63 characters", INVALID_SELECTOR)
        out[key] = val
    return out


def parse_requirement(term: Any, field_name: str) -> Requirement:
    """Validate one ``{"key", "operator", "values"}`` term (Kubernetes NodeSelectorRequirement)."""
    if not isinstance(term, dict):
        raise bad(field_name, "must be an object with key, operator and values", INVALID_AFFINITY)
    unknown = set(term) - {"key", "operator", "values"}
    if unknown:
        raise bad(field_name, f"unknown member(s) {sorted(unknown)}", INVALID_AFFINITY)
    key, operator, values = term.get("key"), term.get("operator"), term.get("values", [])
    if not isinstance(key, str) or not LABEL_KEY.fullmatch(key):
        raise bad(f"{field_name}.key", "not a valid label key", INVALID_AFFINITY)
    if operator not in OPERATORS:
        raise bad(f"{field_name}.operator", f"must be one of {', '.join(OPERATORS)}", INVALID_AFFINITY)
    if values is None:
        values = []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values) or len(values) > MAX_TERM_VALUES:
        raise bad(f"{field_name}.values", "must be a list of strings", INVALID_AFFINITY)
    if operator in ("In", "NotIn") and not values:
        raise bad(f"{field_name}.values", f"{operator} needs at least one value", INVALID_AFFINITY)
    if operator in ("Exists", "DoesNotExist") and values:
        raise bad(f"{field_name}.values", f"{operator} takes no values", INVALID_AFFINITY)
    if operator in ("Gt", "Lt") and (len(values) != 1 or not INTEGER_VALUE.fullmatch(values[0])):
        raise bad(f"{field_name}.values", f"{operator} needs exactly one integer value", INVALID_AFFINITY)
    return Requirement(key, operator, tuple(values))


def _affinity(value: Any) -> tuple[tuple[Requirement, ...], tuple[tuple[int, Requirement], ...]]:
    if value is None:
        return (), ()
    if not isinstance(value, dict) or set(value) - {"required", "preferred"}:
        raise bad("affinity", "must be an object with 'required' and/or 'preferred'", INVALID_AFFINITY)
    required_raw, preferred_raw = _given(value.get("required"), []), _given(value.get("preferred"), [])
    if not isinstance(required_raw, list) or len(required_raw) > MAX_TERMS:
        raise bad("affinity.required", f"must be a list of at most {MAX_TERMS} terms", INVALID_AFFINITY)
    if not isinstance(preferred_raw, list) or len(preferred_raw) > MAX_TERMS:
        raise bad("affinity.preferred", f"must be a list of at most {MAX_TERMS} terms", INVALID_AFFINITY)
    required = tuple(parse_requirement(t, f"affinity.required[{i}]") for i, t in enumerate(required_raw))
    preferred = []
    for i, item in enumerate(preferred_raw):
        name = f"affinity.preferred[{i}]"
        if not isinstance(item, dict) or "term" not in item or set(item) - {"weight", "term"}:
            raise bad(name, "must be {'weight': 1..100, 'term': {...}}", INVALID_AFFINITY)
        weight = item.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= 100:
            raise bad(f"{name}.weight", "must be an integer from 1 to 100 (Kubernetes' range)", INVALID_AFFINITY)
        preferred.append((weight, parse_requirement(item["term"], f"{name}.term")))
    return required, tuple(preferred)


def _tolerations(value: Any) -> tuple[Toleration, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TERMS:
        raise bad("tolerations", f"must be a list of at most {MAX_TERMS} tolerations", INVALID_TOLERATION)
    out = []
    for i, item in enumerate(value):
        name = f"tolerations[{i}]"
        if not isinstance(item, dict) or set(item) - {"key", "operator", "value", "effect", "toleration_seconds"}:
            raise bad(name, "must be {key, operator, value, effect}", INVALID_TOLERATION)
        key, operator = _text(item.get("key"), ""), _text(item.get("operator"), "Equal")
        val, effect = _text(item.get("value"), ""), _text(item.get("effect"), "")
        if not isinstance(key, str) or (key and not LABEL_KEY.fullmatch(key)):
            raise bad(f"{name}.key", "not a valid taint key", INVALID_TOLERATION)
        if operator not in TOLERATION_OPERATORS:
            raise bad(f"{name}.operator", "must be Equal or Exists", INVALID_TOLERATION)
        if not isinstance(val, str):
            raise bad(f"{name}.value", "must be a string", INVALID_TOLERATION)
        if operator == "Exists" and val:
            raise bad(f"{name}.value", "must be empty when operator is Exists", INVALID_TOLERATION)
        if not key and operator != "Exists":
            raise bad(f"{name}.operator", "an empty key needs operator Exists", INVALID_TOLERATION)
        if effect != "" and effect not in TAINT_EFFECTS:
            raise bad(f"{name}.effect", f"must be one of {', '.join(TAINT_EFFECTS)}", INVALID_TOLERATION)
        seconds = item.get("toleration_seconds")
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, int) or not 0 <= seconds <= MAX_TOLERATION_SECONDS
        ):
            raise bad(
                f"{name}.toleration_seconds",
                f"must be an integer from 0 to {MAX_TOLERATION_SECONDS} (seconds; null: for ever)",
                INVALID_TOLERATION,
            )
        out.append(Toleration(key, operator, val, effect, seconds))
    return tuple(out)


def _spread(value: Any) -> tuple[str, str, str]:
    if value is None:
        return "", "", SpreadMode.SPREAD
    if not isinstance(value, dict) or set(value) - {"group", "topology_key", "mode"}:
        raise bad("spread", "must be {group, topology_key, mode}", INVALID_SPREAD)
    group, key, mode = value.get("group"), _text(value.get("topology_key"), "host"), _text(value.get("mode"), "spread")
    if not isinstance(group, str) or not WORKLOAD_ID.fullmatch(group):
        raise bad("spread.group", "must be a non-empty name", INVALID_SPREAD)
    if not isinstance(key, str) or not (key in TOPOLOGY_KEYS or LABEL_KEY.fullmatch(key)):
        raise bad("spread.topology_key", f"must be one of {', '.join(TOPOLOGY_KEYS)} or a label key", INVALID_SPREAD)
    if mode not in SpreadMode.values:
        raise bad("spread.mode", f"must be one of {', '.join(SpreadMode.values)}", INVALID_SPREAD)
    return group, key, mode


def _int(data: dict, name: str, default: int, low: int, high: int) -> int:
    value = data.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(name, f"must be an integer from {low} to {high}")
    return value


def resources_from_wire(raw: Any, field_name: str = "resources") -> dict[str, int]:
    """Quantities → canonical ints; unknown resource names are refused (400 ``unknown_resource``)."""
    try:
        resources = parse_resources(raw, field=field_name)
    except QuantityError as exc:
        raise bad(exc.field, exc.reason, INVALID_QUANTITY) from exc
    for name in resources:
        if "/" not in name and name not in STANDARD_RESOURCES:
            raise bad(
                f"{field_name}.{name}",
                f"unknown resource; use one of {sorted(STANDARD_RESOURCES)} or a '<domain>/<name>' extended resource",
                UNKNOWN_RESOURCE,
            )
    return {name: amount for name, amount in resources.items() if amount > 0}


def parse_spec(data: Any) -> PlacementSpec:
    """Validate a ``POST /node-leases`` body (without resolving the pool or shape).

    Raises:
        Problem (400): the first invalid member, named in ``detail`` and ``errors[0].field``.
    """
    if not isinstance(data, dict):
        raise bad("", "the body must be a JSON object")
    allowed = {
        "workload_id",
        "pool",
        "resources",
        "shape",
        "shape_version",
        "node_selector",
        "affinity",
        "tolerations",
        "features",
        "spread",
        "ttl_seconds",
        "priority",
        "queue",
        "command",
        "devices",
        "node_constraints",
        "node_preferences",
    }
    unknown = set(data) - allowed
    if unknown:
        raise bad(sorted(unknown)[0], "unknown member")
    workload_id = data.get("workload_id")
    if not isinstance(workload_id, str) or not WORKLOAD_ID.fullmatch(workload_id):
        raise bad("workload_id", "required: 1-200 characters of letters, digits and ._:/@-")
    pool = data.get("pool")
    if not isinstance(pool, str) or not pool:
        raise bad("pool", "required: the pool's name", UNKNOWN_POOL)
    shape = _text(data.get("shape"), "")
    if not isinstance(shape, str):
        raise bad("shape", "must be a shape name")
    raw_resources = data.get("resources")
    if shape and raw_resources:
        raise bad("resources", "give either resources or a shape, not both")
    resources = resources_from_wire(raw_resources) if raw_resources is not None else {}
    features = _given(data.get("features"), {})
    if not isinstance(features, dict) or not all(isinstance(v, str | int | bool) for v in features.values()):
        raise bad("features", "must be an object of feature name to a string, number or boolean")
    command = _given(data.get("command"), [])
    if not isinstance(command, list) or not all(isinstance(a, str) for a in command) or len(command) > MAX_COMMAND_ARGS:
        raise bad("command", "must be a list of strings (argv)")
    queue = data.get("queue", False)
    if not isinstance(queue, bool):
        raise bad("queue", "must be true or false")
    required, preferred = _affinity(data.get("affinity"))
    group, topology_key, mode = _spread(data.get("spread"))
    explicit = device_requests_from_wire(data.get("devices"))
    # After the devices are read: "devices": {} is a bad member, not a request for nothing.
    if not shape and not resources and not explicit:
        raise bad("resources", "ask for at least one resource (or name a shape)", EMPTY_REQUEST)
    resources = with_device_counts(resources, explicit)
    try:
        node_constraints = parse_node_constraints(data.get("node_constraints"))
        node_preferences = parse_node_preferences(data.get("node_preferences"))
    except NodeConstraintError as exc:
        raise bad(exc.field, exc.message, exc.code) from exc
    return PlacementSpec(
        workload_id=workload_id,
        pool=pool,
        resources=resources,
        shape=shape,
        shape_version=_int(data, "shape_version", 0, 0, MAX_SHAPE_VERSION) or None,
        node_selector=_str_map(data.get("node_selector"), "node_selector"),
        required=required,
        preferred=preferred,
        tolerations=_tolerations(data.get("tolerations")),
        features=features,
        spread_group=group,
        topology_key=topology_key,
        spread_mode=mode,
        ttl_seconds=_int(data, "ttl_seconds", 600, 1, MAX_TTL),
        priority=_int(data, "priority", 0, -MAX_PRIORITY, MAX_PRIORITY),
        queue=queue,
        command=tuple(command),
        devices=combined(explicit, resources),
        node_constraints=node_constraints,
        node_preferences=node_preferences,
    )


def known_device_type(kind: str) -> bool:
    """Whether a live device of type ``kind`` exists (a type beyond KNOWN_DEVICE_TYPES)."""
    return Device.objects.filter(type=kind, retired_at__isnull=True).exists()


def device_requests_from_wire(raw: Any) -> tuple[DeviceRequest, ...]:
    """Validate a ``devices`` member (lease request or shape). Raises 400 naming the field."""
    try:
        return parse_device_requests(raw, known_type=known_device_type)
    except DeviceRequestError as exc:
        raise bad(exc.field, exc.message, exc.code) from exc


def with_device_counts(resources: dict[str, int], explicit: tuple[DeviceRequest, ...]) -> dict[str, int]:
    """``resources`` with each requested device type's total count; a count resource of the same
    type must not disagree (400 ``resources.<type>``)."""
    totals: dict[str, int] = {}
    for request in explicit:
        totals[request.type] = totals.get(request.type, 0) + request.count
    out = dict(resources)
    for kind, total in totals.items():
        if kind in out and out[kind] != total:
            raise bad(f"resources.{kind}", f"disagrees with the devices requested ({total}); give one or the other")
        out[kind] = total
    return out


def request_fingerprint(data: Any) -> str:
    """A stable hash of a request body, to tell a retry from a different request under one key."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
