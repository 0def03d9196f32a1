"""Changing a pool's operation settings (spot, fallback, drain policy, autoscaling, provider,
disruption budgets, repair rules).

The target is not set here: an upgrade sets it (and a rollback restores it), so the pool's
target always names the upgrade that put it there.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import transaction

from fleet import event_types as fleet_events
from fleet.errors import UNKNOWN_POOL
from fleet.events import Actor, record_event
from fleet.models import Pool
from fleet.services import pool_update
from leases.spec import resources_from_wire
from maintenance.choices import EvictionPolicy
from nodepool import egress
from nodepool.api.problems import Problem
from nodepool.api.versioning import check_version

from . import repair_rules
from .budgets import parse_budgets
from .choices import ProviderKind
from .errors import INVALID_POOL_OPERATIONS
from .models import PoolOperations
from .upgrade_plan import pool_operations

SPOT_TAINT = {"key": "nodepool.dev/spot", "value": "true", "effect": "NoSchedule"}
INTS = (
    "drain_timeout",
    "min_nodes",
    "max_nodes",
    "scale_up_delay",
    "scale_up_cooldown",
    "max_nodes_per_scale_up",
    "scale_down_after",
    "scale_down_cooldown",
    "boot_timeout",
    "max_launches_in_flight",
    "scale_up_backoff_base",
    "scale_up_backoff_max",
)
FIELDS = {
    *INTS,
    "drain_policy",
    "spot",
    "fallback_pool",
    "provider",
    "provider_url",
    "provider_secret",
    "node_template",
    "scale_down_utilization",
    "disruption_budgets",
    "fallback_pools",
    "consolidate_after",
    "consolidation_min_saving",
    "expire_after",
    "termination_grace",
    "repair_rules",
    "repair_max_unhealthy",
    "repair_max_concurrent",
}
MAX_FALLBACK_POOLS = 10
# Seconds, or null for "never": at least a minute, at most ten years.
OPTIONAL_SECONDS = ("expire_after", "termination_grace")


def _bad(field: str, message: str, code: str = INVALID_POOL_OPERATIONS) -> Problem:
    return Problem(f"{field}: {message}", code, field=field, errors=[{"field": field, "message": message}])


def parse_changes(data: Any, pool: Pool) -> dict:
    """Validate a PATCH body; returns model values. Raises 400 ``invalid_pool_operations``."""
    if not isinstance(data, dict):
        raise _bad("body", "must be a JSON object")
    changes = {}
    for name, value in data.items():
        if name == "expected_version":
            continue
        if name not in FIELDS:
            raise _bad(name, "unknown or read-only member")
        if name in INTS:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10**7:
                raise _bad(name, "must be an integer from 0 to 10000000")
        elif name in OPTIONAL_SECONDS:
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 60 <= value <= 10 * 365 * 86400
            ):
                raise _bad(name, "must be a number of seconds from 60 to 315360000, or null (never)")
        elif name == "drain_policy" and value not in EvictionPolicy.values:
            raise _bad(name, f"must be one of {', '.join(EvictionPolicy.values)}")
        elif name == "spot" and not isinstance(value, bool):
            raise _bad(name, "must be true or false")
        elif name == "provider" and value not in ProviderKind.values:
            raise _bad(name, "must be '', 'simulated' or 'webhook'")
        elif name in ("provider_url", "provider_secret") and (not isinstance(value, str) or len(value) > 200):
            raise _bad(name, "must be a string of at most 200 characters")
        elif name == "provider_url" and value:
            try:  # the form always; where it leads, below, once the provider is known
                egress.check_url(value, destination=False)
            except egress.EgressRefused as exc:
                raise _bad(name, exc.summary) from None
        elif name in ("scale_down_utilization", "consolidation_min_saving") and (
            isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1
        ):
            raise _bad(name, "must be a number from 0 to 1")
        elif (
            name == "consolidate_after"
            and value is not None
            and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10**7)
        ):
            raise _bad(name, "must be null (consolidation off) or an integer from 0 to 10000000 (seconds)")
        elif name == "fallback_pools":
            value = parse_fallback_pools(value, pool)
        elif name == "fallback_pool":
            if value is None:
                changes[name] = None
                continue
            if not isinstance(value, str):
                raise _bad(name, "must be a pool name (a string) or null")
            fallback = Pool.objects.filter(name=value).first()
            if fallback is None or fallback == pool:
                raise _bad(name, "must name another existing pool", UNKNOWN_POOL)
            value = fallback
        elif name == "node_template":
            value = parse_template(value)
        elif name == "disruption_budgets":
            value = parse_budgets(value)  # 400 invalid_disruption_budget naming the member
        elif name == "repair_rules":
            value = repair_rules.parse_rules(value, pool=pool)  # 400 invalid_repair_rule naming the member
        elif name == "repair_max_unhealthy" and (
            isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1
        ):
            raise _bad(name, "must be a fraction from 0 to 1 (0.2: no repair while over 20 % is unhealthy)")
        elif name == "repair_max_concurrent" and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000
        ):
            raise _bad(name, "must be an integer from 1 to 1000")
        changes[name] = value
    _check_webhook_destination(changes, pool)
    _check_repair_actions(changes, pool)
    return changes


def parse_fallback_pools(value: Any, pool: Pool) -> list[int]:
    """``["spare", "on-demand"]`` (pool names, in the order to try) → the pools' ids.

    Raises 400 naming the member (``fallback_pools[1]``): ``unknown_pool`` for a name that is no
    pool, ``invalid_pool_operations`` for the pool itself, a repeat, more than
    :data:`MAX_FALLBACK_POOLS`, or a cycle (a fallback whose own fallbacks lead back here: a
    back-off in both would hand requests to and fro)."""
    if not isinstance(value, list) or len(value) > MAX_FALLBACK_POOLS:
        raise _bad("fallback_pools", f"must be a list of at most {MAX_FALLBACK_POOLS} pool names")
    ids: list[int] = []
    for index, name in enumerate(value):
        path = f"fallback_pools[{index}]"
        if not isinstance(name, str):
            raise _bad(path, "must be a pool name (a string)")
        other = Pool.objects.filter(name=name).first()
        if other is None:
            raise _bad(path, f"no pool is named {name!r}", UNKNOWN_POOL)
        if other.pk == pool.pk:
            raise _bad(path, "a pool cannot fall back to itself")
        if other.pk in ids:
            raise _bad(path, f"{name!r} is named twice")
        ids.append(other.pk)
    # A cycle: walk the fallbacks' own fallbacks (as stored) and refuse any way back to this pool.
    stored = dict(PoolOperations.objects.exclude(pool=pool).values_list("pool_id", "fallback_pools"))
    for index, start in enumerate(ids):
        seen, frontier = set(), [start]
        while frontier:
            current = frontier.pop()
            if current == pool.pk:
                cycle = f"{value[index]!r} falls back, in turn, to {pool.name!r}: a cycle"
                raise _bad(f"fallback_pools[{index}]", cycle)
            if current in seen:
                continue
            seen.add(current)
            frontier.extend(stored.get(current) or [])
    return ids


def _check_repair_actions(changes: dict, pool: Pool) -> None:
    """A repair rule's action must be one the pool can do after the change (``replace`` needs a
    provider): checked when the rules or the provider change. 400 ``invalid_repair_rule``."""
    if "repair_rules" not in changes and "provider" not in changes:
        return
    current = PoolOperations.objects.filter(pool=pool).values("provider", "repair_rules").first() or {}
    rules = changes.get("repair_rules", current.get("repair_rules") or [])
    repair_rules.check_actions(rules, changes.get("provider", current.get("provider", ProviderKind.NONE)))


def _check_webhook_destination(changes: dict, pool: Pool) -> None:
    """A webhook provider's URL must lead somewhere the server may call (nodepool.egress):
    checked when either the provider or the URL changes, against the values after the change."""
    if "provider" not in changes and "provider_url" not in changes:
        return
    current = PoolOperations.objects.filter(pool=pool).values("provider", "provider_url").first() or {}
    provider = changes.get("provider", current.get("provider"))
    url = changes.get("provider_url", current.get("provider_url"))
    if provider == ProviderKind.WEBHOOK and url:
        try:
            egress.check_url(url)
        except egress.EgressRefused as exc:
            raise _bad("provider_url", exc.summary) from None


def parse_template(value: Any) -> dict:
    """``{"resources": {name: quantity}, "labels": {}, "taints": [...], "features": {}, "price": "0.40"}``
    → canonical. ``price`` (optional): what one such machine costs per hour, a non-negative decimal
    string in the operator's currency (consolidation compares it; Karpenter reads instance prices
    from the cloud's price list, a webhook provider has none, so the operator states it)."""
    if not isinstance(value, dict) or set(value) - {"resources", "labels", "taints", "features", "price"}:
        raise _bad("node_template", "must be {resources, labels, taints, features, price}")
    price = value.get("price")
    if price is not None:
        try:
            amount = Decimal(price) if isinstance(price, str) else None
        except InvalidOperation:
            amount = None
        if amount is None or not amount.is_finite() or amount < 0 or amount > 10**9:
            raise _bad("node_template.price", 'must be a non-negative decimal string per hour, e.g. "0.40"')
        price = str(amount)
    try:
        resources = resources_from_wire(value.get("resources") or {})
    except Problem as exc:
        raise _bad("node_template.resources", str(exc.detail)) from None
    labels = value.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise _bad("node_template.labels", "must be an object of strings")
    taints = value.get("taints") or []
    if not isinstance(taints, list) or not all(isinstance(t, dict) and "key" in t and "effect" in t for t in taints):
        raise _bad("node_template.taints", "must be a list of {key, value, effect}")
    features = value.get("features") or {}
    if not isinstance(features, dict):
        raise _bad("node_template.features", "must be an object")
    template = {"resources": resources, "labels": labels, "taints": taints, "features": features}
    if price is not None:
        template["price"] = price
    return template


def pool_operations_update(*, pool: Pool, expected_version: int, data: Any, actor: Actor):
    """Change the pool's operation settings under its row lock (412 on a stale version).

    Marking a pool ``spot`` adds the taint ``nodepool.dev/spot=true:NoSchedule`` to the pool (and
    so to its nodes): only lease requests that tolerate spot are placed there. Unmarking removes it.
    """
    changes = parse_changes(data, pool)
    with transaction.atomic():
        ops = pool_operations(pool, lock=True)
        check_version(ops.version, expected_version)
        was_spot = ops.spot
        for name, value in changes.items():
            setattr(ops, name, value)
        if ops.max_nodes and ops.max_nodes < ops.min_nodes:
            raise _bad("max_nodes", "must be at least min_nodes (or 0)")
        if ops.scale_up_backoff_base > ops.scale_up_backoff_max:
            raise _bad("scale_up_backoff_base", "must be at most scale_up_backoff_max")
        if ops.max_launches_in_flight < 1:
            raise _bad("max_launches_in_flight", "must be at least 1 (0 would never launch)")
        ops.version += 1
        ops.save()
        if ops.spot != was_spot:
            _apply_spot_taint(pool, spot=ops.spot, actor=actor)
        record_event(
            None,
            fleet_events.POLICY,
            actor,
            pool=pool,
            reason="pool operation settings changed",
            data={k: (v.name if isinstance(v, Pool) else v) for k, v in changes.items() if k != "provider_secret"},
        )
    return ops


def _apply_spot_taint(pool: Pool, *, spot: bool, actor: Actor) -> None:

    taints = [t for t in (pool.taints or []) if t.get("key") != SPOT_TAINT["key"]]
    if spot:
        taints.append(dict(SPOT_TAINT))
    fresh = Pool.objects.get(pk=pool.pk)
    pool_update(pool_id=pool.pk, expected_version=fresh.version, changes={"taints": taints}, actor=actor)
