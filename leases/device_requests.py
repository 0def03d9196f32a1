"""Device requests: which devices a lease asks for, and which of a node's devices satisfy them.

The grammar (docs/leases.md, "Devices"), in the spirit of Kubernetes DRA's device requests and
Nomad's ``device`` stanza, kept small::

    "devices": [
      {"type": "nvidia.com/gpu", "count": 2,
       "constraints": [
         {"attribute": "memory", "operator": ">=", "value": "40Gi"},
         {"attribute": "model", "operator": "glob", "value": "*H100*"}],
       "colocate": "interconnect_group"}
    ]

- ``type``: ``<domain>/<name>``, one of the fleet's device types (:data:`KNOWN_DEVICE_TYPES` or a
  type some live device has); ``count`` 1-64.
- ``constraints``: ``attribute`` one of :data:`ATTRIBUTES`; ``operator`` ``=``/``!=`` on any
  attribute, ``>``/``>=``/``<``/``<=`` on the numeric ones (``memory`` takes quantities such as
  ``"40Gi"``; the comparison is :mod:`nodepool.comparison`, the grammar the trust issue reuses),
  ``glob`` (shell-style, case-sensitive, :func:`fnmatch.fnmatchcase`) on the text ones.
- ``colocate``: ``interconnect_group`` or ``numa_node``: every device of the request shares it (a
  device whose host does not tell is never co-located).

A count-only request (``resources: {"nvidia.com/gpu": 4}``) is an implicit device request without
constraints: nodes that report devices get specific ones assigned; nodes that report none keep
the plain count. Errors are 400 problem+json naming the field (``devices[0].constraints[1].value``),
raised before anything is stored.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from nodepool.comparison import NUMERIC_OPERATORS, Comparison, ComparisonError

from .choices import ATTRIBUTES, COLOCATE, NUMERIC_ATTRIBUTES
from .errors import INVALID_COLOCATION, INVALID_DEVICE_CONSTRAINT, INVALID_DEVICE_REQUEST, UNKNOWN_DEVICE_TYPE

MAX_DEVICE_REQUESTS = 8
MAX_CONSTRAINTS = 16
MAX_COUNT = 64
KNOWN_DEVICE_TYPES = frozenset({"nvidia.com/gpu", "nvidia.com/mig", "amd.com/gpu", "intel.com/gpu", "habana.ai/gaudi"})
OPERATORS = (*NUMERIC_OPERATORS, "glob")


@dataclass(frozen=True)
class Constraint:
    attribute: str
    operator: str
    value: Any
    comparison: Comparison | None = None

    def matches(self, device: dict) -> bool:
        actual = device.get(ATTRIBUTES[self.attribute])
        if self.comparison is not None:
            return self.comparison.holds(actual)
        text = "" if actual is None else str(actual)
        if self.operator == "glob":
            return fnmatch.fnmatchcase(text, self.value)
        equal = text == str(self.value)
        return equal if self.operator == "=" else not equal

    def describe(self) -> str:
        return f"{self.attribute}{self.operator if self.operator != 'glob' else '='}{self.value}"


@dataclass(frozen=True)
class DeviceRequest:
    type: str
    count: int
    constraints: tuple[Constraint, ...] = ()
    colocate: str = ""
    implicit: bool = False  # from a count resource, not a ``devices`` entry

    def matches(self, device: dict) -> bool:
        return device["type"] == self.type and all(c.matches(device) for c in self.constraints)

    def describe(self) -> str:
        parts = [c.describe() for c in self.constraints]
        return f"{self.type} matching {', '.join(parts)}" if parts else self.type

    def wire(self) -> dict:
        out: dict[str, Any] = {"type": self.type, "count": self.count}
        if self.constraints:
            out["constraints"] = [
                {"attribute": c.attribute, "operator": c.operator, "value": c.value} for c in self.constraints
            ]
        if self.colocate:
            out["colocate"] = self.colocate
        return out


class DeviceRequestError(ValueError):
    def __init__(self, field_name: str, message: str, code: str = INVALID_DEVICE_REQUEST):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message
        self.code = code


def _constraint(raw: Any, where: str) -> Constraint:
    if not isinstance(raw, dict) or set(raw) - {"attribute", "operator", "value"}:
        raise DeviceRequestError(where, "a constraint is {attribute, operator, value}", INVALID_DEVICE_CONSTRAINT)
    attribute, operator, value = raw.get("attribute"), raw.get("operator"), raw.get("value")
    if not isinstance(attribute, str) or attribute not in ATTRIBUTES:
        raise DeviceRequestError(
            f"{where}.attribute", f"must be one of {', '.join(sorted(ATTRIBUTES))}", INVALID_DEVICE_CONSTRAINT
        )
    if not isinstance(operator, str) or operator not in OPERATORS:
        raise DeviceRequestError(
            f"{where}.operator", f"must be one of {', '.join(OPERATORS)}", INVALID_DEVICE_CONSTRAINT
        )
    numeric = attribute in NUMERIC_ATTRIBUTES
    if operator == "glob":
        if numeric:
            raise DeviceRequestError(f"{where}.operator", f"glob applies to text attributes, not {attribute}",
                                     INVALID_DEVICE_CONSTRAINT)  # fmt: skip
        if not isinstance(value, str) or not 0 < len(value) <= 200:
            raise DeviceRequestError(f"{where}.value", "a glob pattern of 1-200 characters", INVALID_DEVICE_CONSTRAINT)
        return Constraint(attribute, operator, value)
    if numeric:
        try:
            return Constraint(attribute, operator, value, Comparison.parse(operator, value))
        except ComparisonError as exc:
            raise DeviceRequestError(f"{where}.value", str(exc), INVALID_DEVICE_CONSTRAINT) from exc
    if operator not in ("=", "!="):
        raise DeviceRequestError(f"{where}.operator", f"{attribute} is text: use =, != or glob",
                                 INVALID_DEVICE_CONSTRAINT)  # fmt: skip
    if not isinstance(value, str) or len(value) > 200:
        raise DeviceRequestError(f"{where}.value", "a string of at most 200 characters", INVALID_DEVICE_CONSTRAINT)
    return Constraint(attribute, operator, value)


def parse_device_requests(raw: Any, *, known_type=None) -> tuple[DeviceRequest, ...]:
    """The ``devices`` member of a lease request or shape → DeviceRequests.

    ``known_type(type) -> bool`` decides types beyond :data:`KNOWN_DEVICE_TYPES` (the caller asks
    the database). Raises :class:`DeviceRequestError` naming the field.
    """
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_DEVICE_REQUESTS:
        raise DeviceRequestError("devices", f"must be a list of at most {MAX_DEVICE_REQUESTS} device requests")
    out = []
    for i, item in enumerate(raw):
        where = f"devices[{i}]"
        if not isinstance(item, dict) or set(item) - {"type", "count", "constraints", "colocate"}:
            raise DeviceRequestError(where, "a device request is {type, count, constraints, colocate}")
        kind = item.get("type")
        if not isinstance(kind, str) or "/" not in kind or len(kind) > 253:
            raise DeviceRequestError(f"{where}.type", "required: a device type '<domain>/<name>'", UNKNOWN_DEVICE_TYPE)
        if kind not in KNOWN_DEVICE_TYPES and not (known_type and known_type(kind)):
            raise DeviceRequestError(f"{where}.type", f"no device of type {kind!r} is known to the fleet",
                                     UNKNOWN_DEVICE_TYPE)  # fmt: skip
        count = item.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
            raise DeviceRequestError(f"{where}.count", f"an integer from 1 to {MAX_COUNT}")
        constraints_raw = item.get("constraints")
        constraints_raw = [] if constraints_raw is None else constraints_raw  # null is absent; false is not
        if not isinstance(constraints_raw, list) or len(constraints_raw) > MAX_CONSTRAINTS:
            raise DeviceRequestError(f"{where}.constraints", f"a list of at most {MAX_CONSTRAINTS} constraints",
                                     INVALID_DEVICE_CONSTRAINT)  # fmt: skip
        constraints = tuple(_constraint(c, f"{where}.constraints[{j}]") for j, c in enumerate(constraints_raw))
        colocate = item.get("colocate")
        colocate = "" if colocate is None else colocate
        if not isinstance(colocate, str) or colocate not in ("", *COLOCATE):
            raise DeviceRequestError(f"{where}.colocate", f"must be one of {', '.join(COLOCATE)}",
                                     INVALID_COLOCATION)  # fmt: skip
        out.append(DeviceRequest(kind, count, constraints, colocate))
    return tuple(out)


def combined(explicit: tuple[DeviceRequest, ...], resources: dict[str, int]) -> tuple[DeviceRequest, ...]:
    """The explicit requests plus an implicit unconstrained one per device-like count resource
    (``<domain>/<name>``) beyond what the explicit ones ask for."""
    asked: dict[str, int] = {}
    for request in explicit:
        asked[request.type] = asked.get(request.type, 0) + request.count
    implicit = [
        DeviceRequest(name, amount - asked.get(name, 0), implicit=True)
        for name, amount in sorted(resources.items())
        if "/" in name and amount - asked.get(name, 0) > 0
    ]
    return (*explicit, *implicit)


@dataclass
class Choice:
    """What :func:`choose` found on one node: the device rows picked per request, or why not."""

    picked: list[dict] = field(default_factory=list)
    reason: str = ""  # "node(s) had …" phrase for the "0/N nodes are available" message
    code: str = ""  # its stable reason code (device_unmatched, device_not_free…)


# The device reasons that freeing capacity does not cure: the node has no device of the type, none
# matching the constraints, or only unhealthy / unverified / held ones. A 409 does not call a pool
# "fragmented" on the strength of such nodes (leases.placement_explain.diagnose).
LASTING_DEVICE_CODES = frozenset({"device_type_missing", "device_unmatched", "device_unhealthy"})


def reason_phrase(request: DeviceRequest, code: str) -> str:
    """The "node(s) had …" phrase of a device reason ``code`` for ``request``, in the wording of
    the "0/N nodes are available" message (the same whether Python or SQL decided it)."""
    if code == "device_type_missing":
        return f"node(s) had no {request.type} device"
    if code == "device_unmatched":
        return f"node(s) had no {request.describe()}"
    if code == "device_unhealthy":
        return f"node(s) had only unhealthy or unverified {request.type}"
    if code == "device_not_free":
        return f"node(s) had no free {request.describe()}"
    return f"node(s) had free {request.type} only in different {request.colocate.replace('_', ' ')}s"


def _refused(request: DeviceRequest, code: str) -> Choice:
    return Choice(reason=reason_phrase(request, code), code=code)


def _usable(device: dict, tolerates) -> bool:
    if device["verified_at"] is None or device["held"] or device["health"] in ("unhealthy", "missing"):
        return False
    if device["hard_tainted"]:
        hard = [t for t in device["taints"] or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
        return tolerates is not None and all(tolerates(t) for t in hard)
    return True


def choose(requests: tuple[DeviceRequest, ...], devices: list[dict], taken: set, *, tolerates=None) -> Choice:
    """Pick devices for every request from one node's live ``devices`` (dicts of Device columns),
    none of them in ``taken`` (pks held by live leases, or implied by a held parent).

    A type the node reports no device of at all is left to its count (an agent that sends no
    ``devices``). Lowest index first; with ``colocate``, the smallest group that fits (binpack
    within the node). ``reason`` names the first request that cannot be met, in the wording of the
    "0/N nodes are available" message.
    """
    by_type: dict[str, list[dict]] = {}
    for device in devices:
        by_type.setdefault(device["type"], []).append(device)
    used = set(taken)
    picked: list[dict] = []
    for request in requests:
        pool = by_type.get(request.type)
        if pool is None:
            if request.implicit:
                continue  # a node without device rows of this type: count only
            return _refused(request, "device_type_missing")
        present = [d for d in pool if request.matches(d)]
        if not present:
            return _refused(request, "device_unmatched")
        healthy = [d for d in present if _usable(d, tolerates)]
        if not healthy:
            return _refused(request, "device_unhealthy")
        free = sorted((d for d in healthy if d["id"] not in used), key=lambda d: (d["index"], d["device_id"]))
        if len(free) < request.count:
            return _refused(request, "device_not_free")
        if request.colocate:
            column = request.colocate
            groups: dict[Any, list[dict]] = {}
            for device in free:
                if device.get(column) not in (None, ""):
                    groups.setdefault(device[column], []).append(device)
            fitting = sorted((g for g in groups.values() if len(g) >= request.count), key=len)
            if not fitting:
                return _refused(request, "device_not_colocated")
            chosen = fitting[0][: request.count]
        else:
            chosen = free[: request.count]
        used.update(d["id"] for d in chosen)
        picked += chosen
    return Choice(picked=picked)
