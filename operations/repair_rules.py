"""Repair rules and what they read (operations.repair's lower half): the rules' grammar, validated
when written (:func:`parse_rules`, :func:`check_actions`); since when a rule's condition holds on
a node (:func:`condition_since`, device health included); and the outage guard with the
control-plane timers it shifts (:func:`guard`, the one in :mod:`operations.expiry`; :func:`due_at`).
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

from django.utils.dateparse import parse_datetime

from fleet import clock
from fleet.choices import DeviceHealth, Lifecycle
from fleet.health import CLOCK_SKEW, CONDITION_STATUSES, FALSE, READY, STATUS_REPORT_OVERDUE
from fleet.models import (
    DEFAULT_DEGRADED_CONDITIONS,
    DEFAULT_UNHEALTHY_CONDITIONS,
    Device,
    Node,
    Pool,
)
from nodepool.api.problems import Problem

from . import conf, expiry
from .choices import ProviderKind, RepairAction
from .errors import INVALID_REPAIR_RULE

DEVICES_HEALTHY = "DevicesHealthy"
WELL_KNOWN_CONDITIONS = (
    READY, "MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable", CLOCK_SKEW,
    STATUS_REPORT_OVERDUE, DEVICES_HEALTHY,
)  # fmt: skip
RULE_MEMBERS = ("condition", "status", "for", "action")
MAX_RULES = 20
MIN_FOR, MAX_FOR = 10, 30 * 86400
# Kubernetes condition types are CamelCase identifiers (NodeCondition.type).
CONDITION_TYPE = re.compile(r"^[A-Z][A-Za-z0-9]{0,62}$")
DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
BAD_DEVICE_HEALTH = (DeviceHealth.UNHEALTHY, DeviceHealth.MISSING)


# --- rules (validated when written) ---------------------------------------------------------------
def _bad(path: str, message: str) -> Problem:
    return Problem(f"{path}: {message}", INVALID_REPAIR_RULE, field=path, errors=[{"field": path, "message": message}])


def known_conditions(pool: Pool) -> set[str]:
    """Condition types a rule of ``pool`` may name: the well-known ones, the pool's health policy
    lists (or their defaults) and every type a node of the pool reported."""
    known = set(WELL_KNOWN_CONDITIONS) | set(DEFAULT_UNHEALTHY_CONDITIONS) | set(DEFAULT_DEGRADED_CONDITIONS)
    known |= set(pool.unhealthy_conditions or []) | set(pool.degraded_conditions or [])
    for conditions in (
        Node.objects.filter(pool=pool).exclude(lifecycle=Lifecycle.RETIRED).values_list("conditions", flat=True)
    ):
        known |= {c.get("type") for c in conditions or [] if isinstance(c, dict) and c.get("type")}
    return known


def parse_for(value: Any, path: str) -> int:
    """``"10m"``, ``"1h30m"``, ``"90s"`` or an integer of seconds → seconds (10 s to 30 days).
    Raises 400 ``invalid_repair_rule`` naming ``path``."""
    if isinstance(value, int) and not isinstance(value, bool):
        seconds = value
    elif isinstance(value, str) and value.strip() and (match := DURATION.match(value.strip())) and any(match.groups()):
        hours, minutes, secs = (int(g or 0) for g in match.groups())
        seconds = hours * 3600 + minutes * 60 + secs
    else:
        raise _bad(path, 'must be a duration like "10m", "1h30m", "90s" or a number of seconds')
    if not MIN_FOR <= seconds <= MAX_FOR:
        raise _bad(path, f"must be from {MIN_FOR} seconds to 30 days")
    return seconds


def parse_rules(value: Any, *, pool: Pool) -> list[dict]:
    """A PATCH's ``repair_rules`` → the stored list ``[{"condition", "status", "for": seconds,
    "action"}]``. Raises 400 ``invalid_repair_rule`` naming ``repair_rules[i].<member>``."""
    if not isinstance(value, list) or len(value) > MAX_RULES:
        raise _bad("repair_rules", f"must be a list of at most {MAX_RULES} rules")
    known = known_conditions(pool) if value else set()
    rules = []
    for i, rule in enumerate(value):
        path = f"repair_rules[{i}]"
        if not isinstance(rule, dict):
            raise _bad(path, "must be an object {condition, status, for, action}")
        unknown = sorted(set(rule) - set(RULE_MEMBERS))
        if unknown:
            raise _bad(f"{path}.{unknown[0]}", "unknown member")
        for member in RULE_MEMBERS:
            if member not in rule:
                raise _bad(f"{path}.{member}", "is required")
        condition = rule["condition"]
        if not isinstance(condition, str) or not CONDITION_TYPE.fullmatch(condition) or condition not in known:
            raise _bad(
                f"{path}.condition",
                f"unknown condition {condition!r}: a node condition type ({', '.join(sorted(known))})",
            )
        status = rule["status"]
        if status not in CONDITION_STATUSES:
            raise _bad(f"{path}.status", 'must be "True", "False" or "Unknown"')
        if condition == DEVICES_HEALTHY and status != FALSE:
            raise _bad(f"{path}.status", 'DevicesHealthy rules match "False" (a device unhealthy or missing)')
        action = rule["action"]
        if action not in RepairAction.values:
            raise _bad(f"{path}.action", f"must be one of {', '.join(RepairAction.values)}")
        rules.append({"condition": condition, "status": status, "for": parse_for(rule["for"], f"{path}.for"),
                      "action": action})  # fmt: skip
    return rules


def check_actions(rules: list[dict], provider: str) -> None:
    """Every rule's action must be one the pool can do: ``replace`` needs a provider.
    Raises 400 ``invalid_repair_rule`` naming ``repair_rules[i].action``."""
    for i, rule in enumerate(rules):
        if rule["action"] == RepairAction.REPLACE and provider == ProviderKind.NONE:
            raise _bad(f"repair_rules[{i}].action", "replace needs the pool's provider (the pool has none)")


# --- reading conditions ---------------------------------------------------------------------------
def _bad_devices(node_ids) -> dict:
    """``{node_id: earliest fault time}`` of nodes with a device unhealthy or missing (one query)."""
    found: dict = {}
    for node_id, fault_at, seen_at in Device.objects.filter(
        node_id__in=list(node_ids), retired_at__isnull=True, health__in=BAD_DEVICE_HEALTH
    ).values_list("node_id", "last_fault_at", "last_seen_at"):
        at = fault_at or seen_at
        found[node_id] = min(found.get(node_id, at), at)
    return found


def condition_since(node: Node, rule: dict, bad_devices: dict, now: datetime) -> datetime | None:
    """Since when ``rule``'s condition holds on ``node`` (its ``last_transition_time``), or None."""
    if rule["condition"] == DEVICES_HEALTHY:
        return bad_devices.get(node.pk)
    for condition in node.conditions or []:
        if condition.get("type") == rule["condition"]:
            if condition.get("status") != rule["status"]:
                return None
            stamp = condition.get("last_transition_time")
            parsed = parse_datetime(stamp) if isinstance(stamp, str) and stamp else None
            return parsed or node.last_status_report_at or now
    return None


def _label(rule: dict) -> str:
    return f"{rule['condition']}={rule['status']}"


# --- the outage guard -----------------------------------------------------------------------------
def guard(pool: Pool, *, now: datetime, recovered: datetime | None) -> str:
    """Why repairs of ``pool`` must wait for the control plane (``""`` when they need not): the one
    outage guard (:func:`operations.expiry.guard_engaged`) with this pool's mass-silence groups
    and ``REPAIR_SETTLE`` seconds after a recovery."""
    settle = float(conf.get("REPAIR_SETTLE"))
    reason = expiry.guard_engaged(now, pool=pool, settle=settle, recovered=recovered)
    return f"outage guard: {reason}; repairs wait {settle:g}s after a recovery" if reason else ""


def due_at(since: datetime, seconds: int, *, recovered: datetime | None, gaps) -> datetime:
    """When a condition holding since ``since`` has held ``seconds`` of control-plane time: counted
    from the latest recovery when later, and extended past every detected gap."""
    start = max(since, recovered) if recovered is not None else since
    return clock.extend_past_gaps(start, start + timedelta(seconds=seconds), gaps)
