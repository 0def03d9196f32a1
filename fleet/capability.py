"""Capability, labels and taints: parsing what nodes and operators send into canonical shapes.

Capability (declared, measured or verified) is stored as::

    {"resources": {name: canonical int},            # cpu millicores, bytes, counts
     "accelerators": [{"type", "model", "memory": bytes, "count": int}],
     "features": {"arch", "os", "kernel", "runtimes": [...], "network_class", "services": [...]}}

Input accepts Kubernetes quantity strings (see :mod:`nodepool.quantity`). Every parser raises
:class:`CapabilityError` with a dotted field path, which the API turns into a 400.
"""

from __future__ import annotations

import re
from typing import Any

from nodepool.quantity import CPU, MEMORY, QuantityError, parse_resources, to_canonical

from .errors import INVALID_QUANTITY

# Kubernetes label syntax: an optional DNS-subdomain prefix, a name of at most 63 characters,
# and a value of at most 63 characters (k8s.io/apimachinery/pkg/util/validation).
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
MAX_LABELS = 64
MAX_TAINTS = 32
MAX_ACCELERATORS = 16
MAX_LIST_ITEMS = 32
MAX_STRING = 200

FEATURE_STRINGS = ("arch", "os", "kernel", "network_class")
FEATURE_LISTS = ("runtimes", "services")

# Plausibility bounds: values no real node has (the largest servers sold have a few hundred
# cores and tens of TiB of memory). Anything beyond is a bug or a lie, never capacity.
MAX_PLAUSIBLE = {
    CPU: 1024 * 1000,  # 1024 cores, in millicores
    MEMORY: 64 * 2**40,  # 64 TiB
    "ephemeral-storage": 2**50,  # 1 PiB
}
MAX_PLAUSIBLE_ACCELERATORS = 64
GPU_RESOURCE_SUFFIX = "/gpu"


class CapabilityError(ValueError):
    """Invalid input; ``field`` is the dotted path of the offending member."""

    def __init__(self, field: str, message: str, code: str = "invalid"):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.code = code


def label_key_ok(key: Any) -> bool:
    if not isinstance(key, str) or not key or len(key) > 317:
        return False
    prefix, slash, name = key.rpartition("/")
    if slash and not _DNS_SUBDOMAIN.fullmatch(prefix):
        return False
    return bool(_LABEL_NAME.fullmatch(name))


def parse_labels(raw: Any, *, field: str = "labels") -> dict[str, str]:
    """Validate ``{key: value}`` in Kubernetes label syntax (at most 64 labels)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise CapabilityError(field, "must be an object of label key to string value")
    if len(raw) > MAX_LABELS:
        raise CapabilityError(field, f"at most {MAX_LABELS} labels")
    for key, value in raw.items():
        if not label_key_ok(key):
            raise CapabilityError(f"{field}.{key}", "not a valid label key")
        if not isinstance(value, str) or not _LABEL_VALUE.fullmatch(value):
            raise CapabilityError(f"{field}.{key}", "label values are strings of at most 63 characters [A-Za-z0-9-_.]")
    return dict(raw)


def parse_taints(raw: Any, *, field: str = "taints") -> list[dict[str, str]]:
    """Validate Kubernetes taints: ``[{"key", "value", "effect"}]`` with effect in :data:`TAINT_EFFECTS`."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise CapabilityError(field, "must be a list of taints")
    if len(raw) > MAX_TAINTS:
        raise CapabilityError(field, f"at most {MAX_TAINTS} taints")
    out = []
    for index, taint in enumerate(raw):
        where = f"{field}[{index}]"
        if not isinstance(taint, dict) or set(taint) - {"key", "value", "effect"}:
            raise CapabilityError(where, "a taint is an object with key, value and effect")
        if not label_key_ok(taint.get("key")):
            raise CapabilityError(f"{where}.key", "not a valid taint key")
        value = taint.get("value", "")
        if not isinstance(value, str) or not _LABEL_VALUE.fullmatch(value):
            raise CapabilityError(f"{where}.value", "not a valid taint value")
        if taint.get("effect") not in TAINT_EFFECTS:
            raise CapabilityError(f"{where}.effect", f"must be one of {', '.join(TAINT_EFFECTS)}")
        out.append({"key": taint["key"], "value": value, "effect": taint["effect"]})
    return out


def _short_string(value: Any, field: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_STRING:
        raise CapabilityError(field, f"must be a string of at most {MAX_STRING} characters")
    return value


def parse_features(raw: Any, *, field: str = "features") -> dict[str, Any]:
    """Validate features: known string keys, known list keys, nothing else."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise CapabilityError(field, "must be an object")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in FEATURE_STRINGS:
            out[key] = _short_string(value, f"{field}.{key}")
        elif key in FEATURE_LISTS:
            if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
                raise CapabilityError(f"{field}.{key}", f"must be a list of at most {MAX_LIST_ITEMS} strings")
            out[key] = [_short_string(item, f"{field}.{key}") for item in value]
        else:
            allowed = ", ".join(FEATURE_STRINGS + FEATURE_LISTS)
            raise CapabilityError(f"{field}.{key}", f"unknown feature (known: {allowed})")
    return out


def parse_accelerators(raw: Any, *, field: str = "accelerators") -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_ACCELERATORS:
        raise CapabilityError(field, f"must be a list of at most {MAX_ACCELERATORS} accelerators")
    out = []
    for index, item in enumerate(raw):
        where = f"{field}[{index}]"
        if not isinstance(item, dict) or set(item) - {"type", "model", "memory", "count"}:
            raise CapabilityError(where, "an accelerator is an object with type, model, memory and count")
        count = item.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise CapabilityError(f"{where}.count", "must be a non-negative integer")
        try:
            memory = to_canonical(MEMORY, item.get("memory", 0))
        except QuantityError as exc:
            raise CapabilityError(f"{where}.memory", str(exc), INVALID_QUANTITY) from exc
        out.append(
            {
                "type": _short_string(item.get("type", ""), f"{where}.type"),
                "model": _short_string(item.get("model", ""), f"{where}.model"),
                "memory": memory,
                "count": count,
            }
        )
    return out


def parse_capability(raw: Any, *, field: str = "capability") -> dict[str, Any]:
    """Parse a capability document (quantities allowed) into the canonical stored shape.

    Raises:
        CapabilityError: unknown members, malformed quantities, bad feature values.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise CapabilityError(field, "must be an object with resources, accelerators and features")
    unknown = set(raw) - {"resources", "accelerators", "features"}
    if unknown:
        raise CapabilityError(f"{field}.{sorted(unknown)[0]}", "unknown member")
    try:
        resources = parse_resources(raw.get("resources") or {}, field=f"{field}.resources")
    except QuantityError as exc:
        path, _, message = str(exc).partition(": ")
        raise CapabilityError(path, message or str(exc), INVALID_QUANTITY) from exc
    return {
        "resources": resources,
        "accelerators": parse_accelerators(raw.get("accelerators"), field=f"{field}.accelerators"),
        "features": parse_features(raw.get("features"), field=f"{field}.features"),
    }


def implausible_values(capability: dict[str, Any]) -> list[str]:
    """Why ``capability`` cannot describe a real machine; empty when plausible.

    Checks: negative amounts, cpu or memory missing, amounts above :data:`MAX_PLAUSIBLE`
    (1024 cores, 64 TiB of memory, 1 PiB of disk), a GPU count without any accelerator
    described, more than 64 accelerators, an accelerator count that disagrees with the GPU resource.
    """
    problems: list[str] = []
    resources = (capability or {}).get("resources") or {}
    accelerators = (capability or {}).get("accelerators") or []
    for name, amount in resources.items():
        if not isinstance(amount, int) or isinstance(amount, bool):
            problems.append(f"{name} is not an integer amount")
        elif amount < 0:
            problems.append(f"{name} is negative ({amount})")
        elif name in MAX_PLAUSIBLE and amount > MAX_PLAUSIBLE[name]:
            problems.append(f"{name} {amount} exceeds the plausible maximum {MAX_PLAUSIBLE[name]}")
    for name in (CPU, MEMORY):
        if not resources.get(name):
            problems.append(f"{name} is missing or zero")
    gpu_count = sum(v for k, v in resources.items() if k.endswith(GPU_RESOURCE_SUFFIX) and isinstance(v, int))
    described = sum(a.get("count", 0) for a in accelerators if isinstance(a.get("count"), int))
    if gpu_count > 0 and not accelerators:
        problems.append(f"{gpu_count} GPU(s) declared without any accelerator described")
    elif accelerators and gpu_count and described != gpu_count:
        problems.append(f"accelerators describe {described} device(s) but the GPU resources count {gpu_count}")
    if described > MAX_PLAUSIBLE_ACCELERATORS:
        problems.append(f"{described} accelerators exceed the plausible maximum {MAX_PLAUSIBLE_ACCELERATORS}")
    if any(isinstance(a.get("count"), int) and a["count"] < 0 for a in accelerators):
        problems.append("an accelerator count is negative")
    return problems


MAX_REQUEST_CLASSES = 32
_CLASS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def parse_request_classes(raw: Any, *, field: str = "request_classes") -> list[dict[str, Any]]:
    """Validate a pool's request classes: the named shapes its health answers "can serve N now" for.

    Each entry is ``{"name": slug, "shape": shape name}`` (resolved to the shape's latest version
    when evaluated) or ``{"name": slug, "resources": {name: quantity}, "features": {...}}``; names
    are unique, at most :data:`MAX_REQUEST_CLASSES` entries. Resources come back canonical.

    Raises:
        CapabilityError: the first invalid member, with its dotted path.
    """
    if raw in (None, ""):
        return []
    if not isinstance(raw, list):
        raise CapabilityError(field, "must be a list of request classes")
    if len(raw) > MAX_REQUEST_CLASSES:
        raise CapabilityError(field, f"at most {MAX_REQUEST_CLASSES} request classes")
    out, seen = [], set()
    for index, entry in enumerate(raw):
        path = f"{field}[{index}]"
        if not isinstance(entry, dict) or set(entry) - {"name", "shape", "resources", "features"}:
            raise CapabilityError(path, "must be an object with name and either shape or resources (and features)")
        name = entry.get("name")
        if not isinstance(name, str) or not _CLASS_NAME.fullmatch(name):
            raise CapabilityError(f"{path}.name", "required: a lowercase slug of at most 63 characters")
        if name in seen:
            raise CapabilityError(f"{path}.name", f"{name!r} is listed twice")
        seen.add(name)
        shape, resources = entry.get("shape"), entry.get("resources")
        if bool(shape) == bool(resources):
            raise CapabilityError(path, "give either shape or resources")
        parsed: dict[str, Any] = {"name": name}
        if shape:
            if not isinstance(shape, str) or not _CLASS_NAME.fullmatch(shape):
                raise CapabilityError(f"{path}.shape", "must be a shape name")
            parsed["shape"] = shape
        else:
            try:
                parsed["resources"] = parse_resources(resources, field=f"{path}.resources")
            except QuantityError as exc:
                where, _, message = str(exc).partition(": ")
                raise CapabilityError(where, message or str(exc)) from exc
        features = entry.get("features") or {}
        if not isinstance(features, dict) or not all(isinstance(v, str | int | bool) for v in features.values()):
            raise CapabilityError(f"{path}.features", "must map feature names to strings, numbers or booleans")
        if features:
            parsed["features"] = features
        out.append(parsed)
    return out
