"""Validation of heartbeat and metrics bodies.

Written as plain functions rather than nested DRF serializers because the heartbeat is the
hottest path of the control plane: a DRF serializer tree instantiates a field object per nested
condition and lease, which cost more than the heartbeat's own UPDATE. The heartbeat's schema comes
from ``fleet.api.schema.HeartbeatSerializer``; tests/fleet/test_validator_equivalence.py checks
that it and :func:`parse_heartbeat` accept the same bodies and name the same fields. Errors keep
DRF's shape: shape and type errors raise ``ValidationError`` (400 ``validation_error``), limits
raise ``Unprocessable`` (422 ``heartbeat_limit_exceeded``), both with ``errors: [{field, code,
message}]``.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime

from django.utils.dateparse import parse_datetime
from rest_framework.exceptions import ErrorDetail, ValidationError

from nodepool.api.fields import timezone_required
from nodepool.api.problems import Problem, Unprocessable
from nodepool.quantity import RESOURCE_NAME, QuantityError, to_canonical

from .. import heartbeats as hb
from ..devices import parse_devices
from ..errors import HEARTBEAT_LIMIT_EXCEEDED, INVALID_QUANTITY, METRICS_LIMIT_EXCEEDED
from ..health import CONDITION_STATUSES

CONDITION_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
LEASE_STATE = re.compile(r"^[a-z][a-z0-9_-]*$")
MAX_METRICS = 512
MAX_METRIC_NAME = 200


class _Errors:
    """Collects field errors; ``raise_if_any`` raises the 422 for limits before the 400 for shapes."""

    def __init__(self):
        self.shape: list[tuple[str, str, str]] = []
        self.limits: list[tuple[str, str, str]] = []

    def bad(self, name: str, message: str, code: str = "invalid"):
        self.shape.append((name, code, message))

    def limit(self, name: str, message: str):
        self.limits.append((name, "limit_exceeded", message))

    def raise_if_any(self):
        if self.limits:
            raise Unprocessable(
                "The heartbeat exceeds a documented limit; nothing was applied.",
                HEARTBEAT_LIMIT_EXCEEDED,
                errors=[{"field": f, "code": c, "message": m} for f, c, m in self.limits + self.shape],
            )
        quantities = [(f, c, m) for f, c, m in self.shape if c == "invalid_quantity"]
        if quantities:
            raise Problem(
                f"{quantities[0][0]}: {quantities[0][2]}",
                INVALID_QUANTITY,
                errors=[{"field": f, "code": c, "message": m} for f, c, m in self.shape],
            )
        if self.shape:
            raise ValidationError({f: [ErrorDetail(m, code=c)] for f, c, m in self.shape})


def _text(errors: _Errors, data: dict, name: str, limit: int, *, required=False, label=None) -> str:
    label = label or name
    value = data.get(name)
    if value is None:
        if required:
            errors.bad(label, "This field is required.", "required")
        return ""
    if not isinstance(value, str):
        errors.bad(label, "Must be a string.")
        return ""
    if len(value) > limit:
        errors.limit(label, f"At most {limit} characters.")
    return value


def _counter(errors: _Errors, data: dict, name: str, minimum: int) -> int:
    value = data.get(name)
    if value is None:
        errors.bad(name, "This field is required.", "required")
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        errors.bad(name, "Must be an integer.")
        return 0
    if not minimum <= value < hb.MAX_COUNTER:
        errors.bad(name, f"Must be between {minimum} and 2**53 - 1.")
    return value


def _timestamp(errors: _Errors, data: dict, name: str) -> datetime | None:
    value = data.get(name)
    if not isinstance(value, str) or len(value) > 64:
        errors.bad(name, "An RFC 3339 time is required.", "required" if value is None else "invalid")
        return None
    try:
        parsed = parse_datetime(value)
    except ValueError:
        parsed = None
    if parsed is not None and parsed.tzinfo is None:
        raise timezone_required(name)  # one rule for every time the API accepts (nodepool.api.fields)
    if parsed is None:
        errors.bad(name, "Must be an RFC 3339 time with a UTC offset.")
        return None
    return parsed


def _conditions(errors: _Errors, value) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        errors.bad("conditions", "Must be a list.")
        return []
    if len(value) > hb.MAX_CONDITIONS:
        errors.limit("conditions", f"At most {hb.MAX_CONDITIONS} conditions.")
        return []
    out, seen = [], set()
    for index, item in enumerate(value):
        at = f"conditions[{index}]"
        if not isinstance(item, dict):
            errors.bad(at, "Must be an object.")
            continue
        kind = _text(errors, item, "type", hb.MAX_CONDITION_TYPE, required=True, label=f"{at}.type")
        # Every string is checked, "" too (it is no type): only a missing type is left to "required".
        if isinstance(item.get("type"), str) and not CONDITION_TYPE.fullmatch(kind):
            errors.bad(f"{at}.type", "Not a valid condition type.")
        if kind in seen:
            errors.bad(f"{at}.type", f"Condition {kind} appears twice.", "duplicate")
        seen.add(kind)
        status = item.get("status")
        if status not in CONDITION_STATUSES:
            errors.bad(f"{at}.status", 'Must be "True", "False" or "Unknown".')
        reason = _text(errors, item, "reason", hb.MAX_REASON, label=f"{at}.reason")
        message = _text(errors, item, "message", hb.MAX_MESSAGE, label=f"{at}.message")
        out.append({"type": kind, "status": status, "reason": reason, "message": message})
    return out


def _usage(errors: _Errors, value) -> dict[str, int]:
    """Usage is canonical integers (cpu millicores, bytes); quantity strings ("4Gi") are converted."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        errors.bad("usage", "Must be an object of resource name to amount.")
        return {}
    if len(value) > hb.MAX_USAGE_ENTRIES:
        errors.limit("usage", f"At most {hb.MAX_USAGE_ENTRIES} resources.")
        return {}
    out = {}
    for name, amount in value.items():
        if not RESOURCE_NAME.fullmatch(name):
            errors.bad(f"usage.{name[:64]}", "Not a valid resource name.")
            continue
        if isinstance(amount, bool) or not isinstance(amount, int | str):
            errors.bad(f"usage.{name}", "Must be an integer in canonical units or a quantity string.")
            continue
        try:
            out[name] = amount if isinstance(amount, int) else to_canonical(name, amount)
        except QuantityError as exc:
            errors.bad(f"usage.{name}", str(exc), INVALID_QUANTITY)
            continue
        if not 0 <= out[name] < 2**62:
            errors.bad(f"usage.{name}", "Must be between 0 and 2**62.")
    return out


def _leases(errors: _Errors, value) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        errors.bad("leases", "Must be a list.")
        return []
    if len(value) > hb.MAX_LEASES:
        errors.limit("leases", f"At most {hb.MAX_LEASES} leases.")
        return []
    out, seen = [], set()
    for index, item in enumerate(value):
        at = f"leases[{index}]"
        if not isinstance(item, dict):
            errors.bad(at, "Must be an object.")
            continue
        try:
            lease_id = str(uuid.UUID(str(item.get("lease_id"))))
        except ValueError:
            errors.bad(f"{at}.lease_id", "Must be a UUID.")
            continue
        if lease_id in seen:
            errors.bad(f"{at}.lease_id", "This lease appears twice.", "duplicate")
        seen.add(lease_id)
        token = item.get("fencing_token")
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**63:
            errors.bad(f"{at}.fencing_token", "Must be a non-negative integer.")
        state = _text(errors, item, "state", hb.MAX_LEASE_STATE, required=True, label=f"{at}.state")
        if isinstance(item.get("state"), str) and not LEASE_STATE.fullmatch(state):  # "" too, as for types
            errors.bad(f"{at}.state", "Must be a lower-case word such as running.")
        out.append({"lease_id": lease_id, "fencing_token": token, "state": state})
    return out


def parse_heartbeat(data) -> hb.HeartbeatReport:
    """Validate a heartbeat body (see docs/api-contract.md) into a :class:`HeartbeatReport`.

    Raises:
        Unprocessable: a limit was exceeded (422 ``heartbeat_limit_exceeded``).
        ValidationError: a field is missing or malformed (400 ``validation_error``).
    """
    if not isinstance(data, dict):
        raise ValidationError({"non_field_errors": ["The body must be a JSON object."]})
    errors = _Errors()
    incarnation = _counter(errors, data, "incarnation", 1)
    sequence = _counter(errors, data, "sequence", 0)
    observed_at = _timestamp(errors, data, "observed_at")
    agent_version = _text(errors, data, "agent_version", hb.MAX_AGENT_VERSION)
    ready = data.get("ready", False)
    if not isinstance(ready, bool):
        errors.bad("ready", "Must be true or false.")
    ready_reason = _text(errors, data, "ready_reason", hb.MAX_READY_REASON)
    conditions = _conditions(errors, data.get("conditions"))
    usage = _usage(errors, data.get("usage"))
    leases = _leases(errors, data.get("leases"))
    # The device part never fails the report: bad devices are refused one by one (fleet.devices).
    devices, device_refusals = parse_devices(data.get("devices"))
    boot_id = data.get("boot_id")
    if boot_id is not None and (not isinstance(boot_id, str) or len(boot_id) > 64):
        errors.bad("boot_id", "Must be a string of at most 64 characters.")
    errors.raise_if_any()
    return hb.HeartbeatReport(
        incarnation=incarnation,
        sequence=sequence,
        observed_at=observed_at,
        agent_version=agent_version,
        ready=ready,
        ready_reason=ready_reason,
        conditions=conditions,
        usage=usage,
        leases=leases,
        devices=devices,
        device_refusals=device_refusals,
        boot_id=boot_id,
    )


def parse_metrics(data) -> tuple[datetime | None, dict]:
    """Validate a metrics body ``{"observed_at"?: t, "metrics": {name: number | {label: number}}}``.

    At most 512 series, names up to 200 characters, values numbers (or one level of labelled
    numbers). Raises like :func:`parse_heartbeat`, with code ``metrics_limit_exceeded`` for limits.
    """
    if not isinstance(data, dict):
        raise ValidationError({"non_field_errors": ["The body must be a JSON object."]})
    errors = _Errors()
    observed_at = _timestamp(errors, data, "observed_at") if data.get("observed_at") is not None else None
    metrics = data.get("metrics")
    if not isinstance(metrics, dict):
        code = "required" if metrics is None else "invalid"
        errors.bad("metrics", "Must be an object of metric name to value.", code)
        metrics = {}
    count = 0
    for name, value in metrics.items():
        count += len(value) if isinstance(value, dict) else 1
        if len(name) > MAX_METRIC_NAME:
            errors.limit(f"metrics.{name[:64]}", f"Metric names are at most {MAX_METRIC_NAME} characters.")
        values = value.values() if isinstance(value, dict) else [value]
        for item in values:
            if isinstance(item, bool) or not isinstance(item, int | float):
                errors.bad(f"metrics.{name[:64]}", "Values must be numbers (or an object of numbers).")
                break
        if isinstance(value, dict) and any(len(str(k)) > MAX_METRIC_NAME for k in value):
            errors.limit(f"metrics.{name[:64]}", f"Label values are at most {MAX_METRIC_NAME} characters.")
    if count > MAX_METRICS:
        errors.limit("metrics", f"At most {MAX_METRICS} series.")
    try:
        errors.raise_if_any()
    except Unprocessable as exc:
        raise Unprocessable(
            "The metrics exceed a documented limit; nothing was stored.", METRICS_LIMIT_EXCEEDED, **exc.extra
        ) from exc
    return observed_at, metrics
