"""The drift and expiry sweep (beat ``operations-sweep-replacements``): per pool, find drifted
nodes (:mod:`operations.drift`) and expired ones (:mod:`operations.expiry`), mark drift on the node
(condition and event), start their replacements through :func:`operations.replacement.replace_node`
and move every replacement in progress; and the pool's replacement status the API shows.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from fleet.choices import Lifecycle
from fleet.clock import detected_gaps, observe
from fleet.events import Actor, record_event
from fleet.models import Node, Pool

from . import disruption, drift, event_types, expiry, outofservice
from .choices import ACTIVE_REPLACEMENT_STATES, ReplacementState
from .models import NodeReplacement, NodeShape, PoolOperations
from .replacement import _move, _note, advance, replace_node, upgrade_active

logger = logging.getLogger(__name__)


# --- the sweep: find drifted and expired nodes, move every replacement ------------------------------
def sweep_pool(*, pool, actor: Actor | None = None, now=None) -> dict:
    """One pass over ``pool``: record node shapes, mark drift, start replacements for drifted and
    expired ready nodes, and move every active replacement. Returns ``{"drifted", "expired",
    "started", "moved", "suspended": str, "guard": str}``.

    Drift is suspended while an upgrade of the pool is active; expiry while the control plane's
    outage guard is engaged (:func:`operations.expiry.guard_engaged`). When a reason's pool-level
    limit (budget, window) allows nothing now, its waiting replacements are told so without asking
    the gate one by one."""
    now = now or timezone.now()
    ops, _ = PoolOperations.objects.get_or_create(pool=pool)
    digest = drift.shape_hash(pool, ops.target)
    drift.record_shapes(pool, digest=digest, now=now)
    upgrade = upgrade_active(pool.pk)
    guard = expiry.guard_engaged(now) if ops.expire_after else ""
    gaps = detected_gaps() if ops.expire_after and not guard else []
    result = {"drifted": 0, "expired": 0, "started": 0, "moved": 0, "suspended": "", "guard": guard}
    if upgrade is not None:
        result["suspended"] = f"upgrade {upgrade.pk} is {upgrade.state}"
    active = set(
        NodeReplacement.objects.filter(pool=pool, state__in=ACTIVE_REPLACEMENT_STATES).values_list("node_id", flat=True)
    )
    wanted: list[tuple] = []
    shapes = NodeShape.objects.filter(pool=pool, node__lifecycle__in=drift.FOLLOWED).select_related("node")
    for shape in shapes:
        node = shape.node
        reasons = drift.drift_reasons(node, shape, digest=digest, target=ops.target or {})
        _mark_drift(shape, reasons, actor=actor or Actor.system(outofservice.DRIFT), now=now)
        _sync_condition(node, reasons, now=now)
        if reasons:
            result["drifted"] += 1
        due = None
        if ops.expire_after and not guard:
            due = expiry.expires_at(
                node_id=node.pk, admitted_at=shape.admitted_at, expire_after=ops.expire_after, gaps=gaps
            )
            result["expired"] += now >= due
        if node.lifecycle != Lifecycle.READY or node.pk in active:
            continue
        if due is not None and now >= due:
            force_at = due + timedelta(seconds=ops.termination_grace) if ops.termination_grace is not None else None
            detail = f"expired at {due.isoformat()} ({ops.expire_after}s after admission, spread per node)"
            wanted.append((due, node, "expiry", detail, force_at))
            continue
        if reasons and upgrade is None:
            wanted.append((shape.drifted_since or now, node, "drift", "; ".join(reasons), None))
    fresh = set()
    for _, node, reason, detail, force_at in sorted(wanted, key=lambda item: item[0]):
        row, started = replace_node(node=node, reason=reason, detail=detail, force_at=force_at, now=now)
        result["started"] += started
        if started and row is not None:
            fresh.add(row.pk)  # it took its first step just now
    budgets = ops.disruption_budgets or []
    refused: dict[str, disruption.Verdict] = {}
    for replacement in (
        NodeReplacement.objects.filter(pool=pool, state__in=ACTIVE_REPLACEMENT_STATES)
        .exclude(pk__in=fresh)
        .select_related("node")
    ):
        if replacement.state == ReplacementState.PENDING:
            if replacement.reason == "drift" and upgrade is not None:
                continue
            if replacement.reason not in refused:
                verdict = disruption.pool_allowance(pool, budgets, replacement.reason, now=now)
                refused[replacement.reason] = verdict if not verdict.allowed else None
            verdict = refused[replacement.reason]
            if verdict is not None and not (replacement.force_at and now >= replacement.force_at):
                disruption.record_blocked(node=replacement.node, reason=replacement.reason, owner=replacement.owner,
                                          blocker=verdict.blocker, now=now)  # fmt: skip
                _note(replacement, f"waiting: {verdict.describe()}")
                continue
        advanced = advance(replacement_id=replacement.pk, actor=actor, now=now)
        result["moved"] += advanced is None or advanced.state != replacement.state
        if (
            replacement.state == ReplacementState.PENDING
            and advanced is not None
            and advanced.state == replacement.state
        ):
            # Refused by the gate (the node's own view: workload budgets too); the pool-level limit
            # may be spent now: look again before the next one.
            refused.pop(replacement.reason, None)
    return result


def _mark_drift(shape: NodeShape, reasons: list[str], *, actor: Actor, now) -> None:
    """Keep the node's ``drifted`` flag, reasons and ``drifted_since``; one ``drift`` event per change."""
    if bool(reasons) == shape.drifted and reasons == shape.drift_reasons:
        return
    changed = bool(reasons) != shape.drifted
    shape.drifted, shape.drift_reasons = bool(reasons), reasons
    if changed:
        shape.drifted_since = now if reasons else None
    shape.save(update_fields=["drifted", "drift_reasons", "drifted_since"])
    if changed:
        condition = drift.condition(reasons)
        record_event(
            shape.node,
            event_types.DRIFT,
            actor,
            pool=shape.pool_id,
            from_state="False" if reasons else "True",
            to_state=condition["status"],
            reason=f"{drift.CONDITION}={condition['status']} ({condition['reason']}): {condition['message']}"[:2000],
            data={"condition": condition, "pool_hash": shape.pool_hash},
        )
    if not reasons:
        # A pending drift replacement is no longer wanted (the pool went back, the node was re-admitted).
        for replacement in NodeReplacement.objects.filter(
            node_id=shape.node_id, reason="drift", state=ReplacementState.PENDING
        ):
            with transaction.atomic():
                _move(replacement, "cancel", actor=actor, detail="the node is at its pool's shape again")
            disruption.clear_blocked(shape.node)


def _sync_condition(node: Node, reasons: list[str], *, now) -> None:
    """Put the server-owned ``Drifted`` condition on the node's own conditions when it differs
    (status or message); ``last_transition_time`` kept while the status holds. A node never had
    it until it first drifted. A heartbeat racing this write may carry the old list over it: the
    next sweep writes it again (the ``NodeShape`` row is the record; this is its display)."""
    want = drift.condition(reasons)
    have = next((c for c in node.conditions or [] if c.get("type") == drift.CONDITION), None)
    if have is None and not reasons:
        return
    if have is not None and (have.get("status"), have.get("message")) == (want["status"], want["message"]):
        return
    with transaction.atomic():
        locked = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
        before = next((c for c in locked.conditions or [] if c.get("type") == drift.CONDITION), None)
        same = before is not None and before.get("status") == want["status"]
        stamp = before.get("last_transition_time") if same else now.isoformat()
        conditions = [c for c in locked.conditions or [] if c.get("type") != drift.CONDITION]
        Node.objects.filter(pk=node.pk).update(conditions=[*conditions, {**want, "last_transition_time": stamp}])


def sweep(*, actor: Actor | None = None, now=None) -> dict:
    """Beat (``operations.sweep_replacements``): :func:`sweep_pool` for every pool with nodes; a
    pool that fails is logged and skipped (the next run tries again). Returns ``{pool name: result}``."""
    now = now or timezone.now()
    observe(now=now)  # a forward gap of the clock is detected (and paused) before any timer is read
    results = {}
    for pool in Pool.objects.filter(nodes__isnull=False).distinct().order_by("name"):
        try:
            results[pool.name] = sweep_pool(pool=pool, actor=actor, now=now)
        except Exception:
            logger.exception("replacement sweep: pool %s failed", pool.name)
            results[pool.name] = {"error": True}
    return results


def pool_status(pool, *, now=None, recent: int = 20) -> dict:
    """What ``GET /pools/{name}/replacements``, the admin and ``nodepoolctl describe pool`` show:
    ``{"pool", "shape_hash", "expire_after", "termination_grace", "guard": str,
    "drifted": [{"node_id", "node", "condition": {type, status, reason, message}, "since"}],
    "expired": [{"node_id", "node", "expired_at"}] (times ISO 8601; expired only with expire_after),
    "replacements": [{"id", "node_id", "node", "reason", "state", "detail", "forced", "overrode",
    "wanted_since", "finished_at"}]}`` (active replacements, then the ``recent`` latest finished)."""
    now = now or timezone.now()
    ops, _ = PoolOperations.objects.get_or_create(pool=pool)
    shapes = NodeShape.objects.filter(pool=pool, node__lifecycle__in=drift.FOLLOWED).select_related("node")
    drifted = [
        {
            "node_id": str(s.node_id),
            "node": str(s.node),
            "condition": drift.condition(s.drift_reasons),
            "since": s.drifted_since.isoformat() if s.drifted_since else None,
        }
        for s in shapes.filter(drifted=True).order_by("drifted_since")
    ]
    expired = []
    if ops.expire_after:
        gaps = detected_gaps()
        for s in shapes:
            due = expiry.expires_at(
                node_id=s.node_id, admitted_at=s.admitted_at, expire_after=ops.expire_after, gaps=gaps
            )
            if due <= now:
                expired.append({"node_id": str(s.node_id), "node": str(s.node), "expired_at": due.isoformat()})
        expired.sort(key=lambda e: e["expired_at"])
    rows = list(
        NodeReplacement.objects.filter(pool=pool, state__in=ACTIVE_REPLACEMENT_STATES).select_related("node")
    ) + list(
        NodeReplacement.objects.filter(pool=pool)
        .exclude(state__in=ACTIVE_REPLACEMENT_STATES)
        .select_related("node")
        .order_by("-finished_at")[:recent]
    )
    return {
        "pool": pool.name,
        "shape_hash": drift.shape_hash(pool, ops.target),
        "expire_after": ops.expire_after,
        "termination_grace": ops.termination_grace,
        "guard": expiry.guard_engaged(now) if ops.expire_after else "",
        "drifted": drifted,
        "expired": expired,
        "replacements": [
            {
                "id": str(r.pk),
                "node_id": str(r.node_id),
                "node": str(r.node),
                "reason": r.reason,
                "state": r.state,
                "detail": r.detail,
                "forced": r.forced,
                "overrode": r.overrode,
                "wanted_since": r.wanted_since.isoformat(),
                "finished_at": r.finished_at.isoformat() if r.finished_at else None,
            }
            for r in rows
        ],
    }
