"""An upgrade before it moves: the request body's grammar (:func:`parse_upgrade`), the pool's
operation settings row, how many nodes ``max_unavailable_nodes`` allows, the order nodes go in
(canary first, fewest live leases first) and the dry run's predicted minimum capacity. Changes
nothing but the settings row created on first use (:func:`pool_operations`).
"""

from __future__ import annotations

import math
import re
from typing import Any

from django.db.models import Count, Q

from fleet.choices import Lifecycle
from fleet.errors import UNKNOWN_POOL
from fleet.models import Node, Pool
from leases.choices import LIVE_LEASE_STATES
from nodepool.api.problems import Problem

from . import capacity, disruption
from .choices import (
    UpgradePhase,
)
from .errors import (
    INVALID_MAX_UNAVAILABLE,
    INVALID_UPGRADE,
)
from .models import PoolOperations, Upgrade
from .targets import parse_target

MAX_UNAVAILABLE = re.compile(r"^(\d{1,4})(%?)$")
LIMITS = {
    "canary_nodes": 1000,
    "max_surge_nodes": 1000,
    "soak_seconds": 7 * 86400,
    "failure_threshold": 10000,
    "node_timeout": 7 * 86400,
}


def pool_operations(pool: Pool, *, lock: bool = False) -> PoolOperations:
    """The pool's operation settings, created with defaults on first use."""
    ops, _ = PoolOperations.objects.get_or_create(pool=pool)
    if lock:
        ops = PoolOperations.objects.select_for_update().get(pk=ops.pk)
    return ops


def parse_max_unavailable(value: Any) -> str:
    """``2`` or ``"2"`` (nodes) or ``"10%"`` (of the pool's members). Raises 400 ``invalid_max_unavailable``."""
    text = str(value).strip() if isinstance(value, int | str) and not isinstance(value, bool) else ""
    match = MAX_UNAVAILABLE.match(text)
    if not match or int(match.group(1)) < 1 or (match.group(2) and int(match.group(1)) > 100):
        raise Problem(
            'max_unavailable_nodes must be a count of at least 1 ("2") or a percentage 1-100 ("10%").',
            INVALID_MAX_UNAVAILABLE,
        )
    return text


def unavailable_limit(upgrade: Upgrade, members: int) -> int:
    """The count ``max_unavailable_nodes`` allows for a pool of ``members`` nodes (a percentage
    rounds down, as Kubernetes' maxUnavailable does, but never below 1)."""
    text = upgrade.max_unavailable_nodes
    if text.endswith("%"):
        return max(1, math.floor(members * int(text[:-1]) / 100))
    return int(text)


# --- create --------------------------------------------------------------------------------------
def _int(data: dict, name: str, default: int) -> int:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= LIMITS[name]:
        raise Problem(f"{name} must be an integer from 0 to {LIMITS[name]}.", INVALID_UPGRADE)
    return value


def parse_upgrade(data: Any) -> dict:
    """Validate an upgrade request body; returns model field values. Raises 400."""
    if not isinstance(data, dict):
        raise Problem("The body must be a JSON object.", INVALID_UPGRADE)
    known = {
        "pool",
        "target",
        "max_unavailable_nodes",
        "max_surge_nodes",
        "canary_nodes",
        "canary_pool",
        "soak_seconds",
        "failure_threshold",
        "node_timeout",
        "auto_rollback",
        "reason",
    }
    unknown = sorted(set(data) - known)
    if unknown:
        raise Problem(f"Unknown member {unknown[0]!r}.", INVALID_UPGRADE)
    if not isinstance(data.get("pool"), str):
        raise Problem("pool is required: a pool name.", INVALID_UPGRADE)
    pool = Pool.objects.filter(name=data["pool"]).first()
    if pool is None:
        raise Problem(f"No pool named {data['pool']!r}.", UNKNOWN_POOL)
    canary_pool = None
    if data.get("canary_pool") is not None:
        if not isinstance(data["canary_pool"], str):
            raise Problem("canary_pool must be a pool name (a string) or null.", INVALID_UPGRADE)
        canary_pool = Pool.objects.filter(name=data["canary_pool"]).first()
        if canary_pool is None or canary_pool == pool:
            raise Problem("canary_pool must name another existing pool.", UNKNOWN_POOL)
    auto_rollback = data.get("auto_rollback", True)
    if not isinstance(auto_rollback, bool):
        raise Problem("auto_rollback must be true or false.", INVALID_UPGRADE)
    reason = data.get("reason", "")
    if not isinstance(reason, str) or len(reason) > 2000:
        raise Problem("reason must be a string of at most 2000 characters.", INVALID_UPGRADE)
    return {
        "pool": pool,
        "target": parse_target(data.get("target")),
        "max_unavailable_nodes": parse_max_unavailable(data.get("max_unavailable_nodes", "1")),
        "max_surge_nodes": _int(data, "max_surge_nodes", 0),
        "canary_nodes": _int(data, "canary_nodes", 1),
        "canary_pool": canary_pool,
        "soak_seconds": _int(data, "soak_seconds", 300),
        "failure_threshold": max(1, _int(data, "failure_threshold", 1)),
        "node_timeout": max(1, _int(data, "node_timeout", 900)),
        "auto_rollback": auto_rollback,
        "reason": reason,
    }


# --- plan and dry run ----------------------------------------------------------------------------
def node_order(pool: Pool, *, exclude_ids=()) -> list[Node]:
    """The pool's members in upgrade order: fewest live leases first (least disruption), then oldest."""
    return list(
        capacity.member_nodes(pool)
        .exclude(pk__in=list(exclude_ids))
        .annotate(live=Count("leases", filter=Q(leases__state__in=LIVE_LEASE_STATES)))
        .order_by("live", "created_at", "pk")
    )


def plan(upgrade: Upgrade) -> tuple[list[Node], list[Node]]:
    """``(canary nodes, roll nodes)``: the canary pool's members, or the first ``canary_nodes``."""
    if upgrade.canary_pool_id:
        return node_order(upgrade.canary_pool), node_order(upgrade.pool)
    ordered = node_order(upgrade.pool)
    count = min(upgrade.canary_nodes, len(ordered))
    return ordered[:count], ordered[count:]


def dry_run(upgrade: Upgrade) -> dict:
    """The order of nodes and the predicted minimum capacity during the roll. Changes nothing.

    The prediction takes nodes ``limit`` at a time in plan order (``limit`` = the nodes
    ``max_unavailable_nodes`` and the pool's always-active upgrade budgets allow, minus those
    already disrupting: :mod:`operations.disruption`) and reports, per resource,
    the pool's available allocatable minus the largest such window, plus ``max_surge_nodes`` nodes
    of the pool's template. Returns ``{"order": [{"position", "node_id", "name", "phase",
    "lifecycle"}], "max_unavailable": int, "already_unavailable": int, "current_capacity": {…},
    "predicted_minimum_capacity": {…}, "waves": int}``.
    """
    canary, roll = plan(upgrade)
    members = capacity.member_nodes(upgrade.pool).count()
    limit = unavailable_limit(upgrade, members)
    for budget in pool_operations(upgrade.pool).disruption_budgets or []:
        if not budget.get("schedule") and disruption.applies(budget, "upgrade"):
            limit = min(limit, disruption.budget_limit(budget["nodes"], members))
    already = disruption.disrupting(upgrade.pool)
    window = max(0, limit - already)
    current = capacity.pool_allocatable(upgrade.pool)
    pool_nodes = [n for n in [*canary, *roll] if n.pool_id == upgrade.pool_id and n.lifecycle == Lifecycle.READY]
    allocatable = capacity.allocatable_by_node(upgrade.pool, [n.pk for n in pool_nodes])
    surge = capacity.template_allocatable(upgrade.pool, pool_operations(upgrade.pool).node_template)
    worst = {name: 0 for name in current}
    if window:
        for start in range(0, len(pool_nodes), window):
            batch = pool_nodes[start : start + window]
            for name in current:
                taken = sum(allocatable.get(str(n.pk), {}).get(name, 0) for n in batch)
                worst[name] = max(worst[name], taken)
    minimum = {
        name: current[name] - worst[name] + upgrade.max_surge_nodes * surge.get(name, 0) for name in sorted(current)
    }
    order = [
        {
            "position": i,
            "node_id": str(n.pk),
            "name": str(n),
            "phase": phase,
            "lifecycle": n.lifecycle,
            "pool": upgrade.canary_pool.name
            if phase == UpgradePhase.CANARY and upgrade.canary_pool_id
            else upgrade.pool.name,
        }
        for i, (phase, n) in enumerate(
            [*((UpgradePhase.CANARY, n) for n in canary), *((UpgradePhase.ROLL, n) for n in roll)]
        )
    ]
    return {
        "order": order,
        "max_unavailable": limit,
        "already_unavailable": already,
        "current_capacity": current,
        "predicted_minimum_capacity": minimum,
        "waves": math.ceil(len(pool_nodes) / window) if window else None,
    }
