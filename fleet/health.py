"""Health: the control plane's judgement of a node's reported conditions under its pool's policy.

A node reports observations (conditions, each ``{"type", "status", "reason", "message"}`` with
status ``"True" | "False" | "Unknown"``, as Kubernetes' NodeCondition). The pool says which
condition types make a node *unhealthy* (``Pool.unhealthy_conditions``, by default
:data:`fleet.models.DEFAULT_UNHEALTHY_CONDITIONS`) and which only *degrade* it
(``Pool.degraded_conditions``, by default ``["ClockSkew"]``). Everything here is pure: no queries.

Polarity follows Kubernetes: ``Ready`` (and any type ending in ``Ready`` or ``Available``) is a
*positive* condition, bad when ``"False"``; pressure-style conditions (``MemoryPressure``,
``NetworkUnavailable``, ``ClockSkew``…) are bad when ``"True"``. ``Ready=False`` is always
unhealthy, whatever the policy lists; ``Ready=Unknown`` makes health ``unknown`` (the node's own
view of itself is unknown; Kubernetes schedules only on ``Ready=True``). Both are unschedulable,
with their own reason codes (fleet.selectors). An ``"Unknown"`` status of another listed condition
degrades.
"""

from __future__ import annotations

from collections.abc import Iterable

from .choices import Health
from .models import DEFAULT_DEGRADED_CONDITIONS, DEFAULT_UNHEALTHY_CONDITIONS

READY = "Ready"
CLOCK_SKEW = "ClockSkew"
# Server-owned: set by the liveness sweep when status reports stop (fleet.status_reports).
STATUS_REPORT_OVERDUE = "StatusReportOverdue"
# Server-owned: set by a failed re-verification, cleared by a passed one (fleet.trust).
UNVERIFIED = "Unverified"
# Server-owned conditions a node's report never sets or clears: carried over as stored
# (fleet.heartbeat_rules.merge_conditions). fleet.trust's Unverified, and those higher apps register from
# their AppConfig.ready() (operations' Drifted).
KEPT_CONDITIONS: list[str] = [UNVERIFIED]


def register_kept_condition(kind: str) -> None:
    """Keep the server-owned condition type ``kind`` across the node's reports (idempotent)."""
    if kind not in KEPT_CONDITIONS:
        KEPT_CONDITIONS.append(kind)


TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"
CONDITION_STATUSES = (TRUE, FALSE, UNKNOWN)


def is_positive(condition_type: str) -> bool:
    """True for conditions that are good when ``"True"`` (``Ready``, ``GPUReady``, ``RuntimeAvailable``)."""
    return condition_type.endswith("Ready") or condition_type.endswith("Available")


def is_bad(condition: dict) -> bool:
    """Whether the condition's status is its bad status (``False`` for positive types, else ``True``)."""
    bad = FALSE if is_positive(condition["type"]) else TRUE
    return condition.get("status") == bad


def pool_policy(pool) -> tuple[list[str], list[str]]:
    """``(unhealthy types, degraded types)`` of ``pool``; an empty list means the default."""
    unhealthy = list(getattr(pool, "unhealthy_conditions", None) or DEFAULT_UNHEALTHY_CONDITIONS)
    degraded = list(getattr(pool, "degraded_conditions", None) or DEFAULT_DEGRADED_CONDITIONS)
    return unhealthy, degraded


def evaluate(conditions: Iterable[dict], *, unhealthy: Iterable[str], degraded: Iterable[str]) -> tuple[str, list[str]]:
    """Summarise ``conditions`` into ``(health, reasons)``.

    Args:
        conditions: ``[{"type", "status", "reason"?, ...}]``.
        unhealthy: condition types whose bad status makes the node ``unhealthy``.
        degraded: condition types whose bad status makes the node ``degraded``.

    Returns:
        ``(Health value, ["MemoryPressure=True (KubeletHasInsufficientMemory)", ...])``; the
        reasons list the conditions that set the verdict, worst first. ``Ready=Unknown`` (and no
        condition in its bad state) is ``unknown``. No conditions at all is
        ``healthy``: a node that reports nothing wrong is judged on what it reports.
    """
    unhealthy_types, degraded_types = set(unhealthy) | {READY}, set(degraded)
    bad_unhealthy: list[str] = []
    bad_degraded: list[str] = []
    ready_unknown: list[str] = []
    for condition in conditions:
        kind = condition["type"]
        status = condition.get("status")
        label = f"{kind}={status}" + (f" ({condition['reason']})" if condition.get("reason") else "")
        if kind == READY and status == UNKNOWN:
            ready_unknown.append(label)
        elif kind in unhealthy_types:
            if is_bad(condition):
                bad_unhealthy.append(label)
            elif status == UNKNOWN:
                bad_degraded.append(label)
        elif kind in degraded_types and (is_bad(condition) or status == UNKNOWN):
            bad_degraded.append(label)
    if bad_unhealthy:
        return Health.UNHEALTHY, bad_unhealthy + ready_unknown + bad_degraded
    if ready_unknown:
        return Health.UNKNOWN, ready_unknown + bad_degraded
    if bad_degraded:
        return Health.DEGRADED, bad_degraded
    return Health.HEALTHY, []


def ready_status(conditions: Iterable[dict] | None) -> str | None:
    """The status of the ``Ready`` condition (``"True"``, ``"False"``, ``"Unknown"``), None when not reported."""
    for condition in conditions or []:
        if isinstance(condition, dict) and condition.get("type") == READY:
            return condition.get("status")
    return None


def evaluate_for_pool(conditions: Iterable[dict], pool) -> tuple[str, list[str]]:
    """:func:`evaluate` under ``pool``'s policy."""
    unhealthy, degraded = pool_policy(pool)
    return evaluate(conditions, unhealthy=unhealthy, degraded=degraded)
