"""Autoscaling: turn pending demand into machines, idle machines into fewer, through a provider.

One pass per pool (:func:`autoscale_pool`, from the beat entry ``operations-autoscale``), under a
lock of the pool's :class:`PoolOperations` row so two passes never decide at once (that row alone,
``of=("self",)``: the joined pool row stays unlocked, since every event of the pool's nodes takes
``FOR KEY SHARE`` on it, and a sweep holding the node being drained deadlocked on it; following
machines takes no lock: each change of a machine's state is a compare-and-swap, so two passes
following the same machine move it, and record it, once; a delete or a failure is claimed by that
compare-and-swap (state ``deleting``, committed) before the provider is called, so no lock is held
during the call and the provider deletes a machine at least once, recorded exactly once):

1. **follow machines**: a requested machine whose bootstrap token enrolled a node is linked to
   it (and admitted if the pool admits manually: the autoscaler asked for it); a linked node
   that became ready marks the machine ready and records the scale-up time (request pending →
   node ready); a machine not ready within ``boot_timeout`` is failed and cleaned up (token
   revoked, provider delete, node retired); a machine being removed whose node is drained is
   deleted through the provider and its node retired.
2. **scale up** when lease requests of the pool have waited ``scale_up_delay`` seconds and a
   preview of the pool's node template shows a new node would hold them: enough template nodes
   to hold them (first fit), minus machines already on their way, bounded by ``max_nodes``,
   ``max_nodes_per_scale_up`` and ``scale_up_cooldown``; below ``min_nodes`` it tops up.
3. **scale down** one machine a pass whose node stayed below ``scale_down_utilization`` for
   ``scale_down_after`` seconds, whose live leases can all be placed elsewhere now (the drain dry
   run: :func:`leases.reconcile.simulate_placement`) and whose lease groups' disruption budgets
   allow it; never below ``min_nodes``, and not within ``scale_down_cooldown`` of the last change.
   It is cordoned by ``system:autoscaler`` and drained with the pool's policy (its work requeued).

Every decision that acts or is held back is a :class:`ScaleDecision` with its reason (held-back
decisions only when the reason changes) and a ``scale`` event. A provider that fails or times
out is retried at most ``PROVIDER_MAX_ATTEMPTS`` times; then the machines it was asked for are
marked failed, their tokens revoked and the provider asked to delete them, so nothing half-done
remains, and the failure is visible on the decision (``outcome=failed``, ``error``).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from fleet.choices import Lifecycle
from fleet.events import Actor
from fleet.models import Node, NodeResource
from leases.choices import LIVE_LEASE_STATES, LeaseRequestState
from leases.models import Lease, LeaseRequest
from leases.reconcile import simulate_placement
from nodepool.api.problems import Problem

from . import capacity, disruption, outofservice
from .choices import (
    ACTIVE_UPGRADE_STATES,
    DisruptionReason,
    MachineState,
    ProviderKind,
    ScaleDirection,
    ScaleOutcome,
)
from .demand import _bins_needed, scale_up
from .launches import _decide, _held_back
from .machines import _moved, follow_machines
from .models import PoolOperations, ProviderMachine, Upgrade

logger = logging.getLogger(__name__)


def autoscale_all(*, actor: Actor, now=None) -> dict:
    """One pass over every pool with a provider; one failing pool is logged and skipped."""
    result = {}
    for pool_id in PoolOperations.objects.exclude(provider=ProviderKind.NONE).values_list("pool_id", flat=True):
        try:
            result[str(pool_id)] = autoscale_pool(pool_id=pool_id, actor=actor, now=now)
        except Exception:
            logger.exception("autoscaling pool %s failed; the next pass tries again", pool_id)
    return result


def autoscale_pool(*, pool_id, actor: Actor, now=None) -> dict:
    """Follow machines, then scale up or down at most once. Returns what it did."""
    now = now or timezone.now()
    follow_machines(pool_id=pool_id, actor=actor, now=now)
    up = scale_up(pool_id=pool_id, actor=actor, now=now)
    down = 0 if up else scale_down(pool_id=pool_id, actor=actor, now=now)
    return {"up": up, "down": down}


# --- scale down -----------------------------------------------------------------------------------
def utilization(node: Node) -> float:
    """The node's highest allocated / allocatable over its resources (0 for an empty inventory)."""
    ratios = [r.allocated / r.allocatable for r in NodeResource.objects.filter(node=node) if r.allocatable > 0]
    return max(ratios, default=0.0)


def replaceable(node: Node) -> tuple[bool, str]:
    """Can every live lease on ``node`` be placed elsewhere now? (changes nothing; the budgets
    are the gate's: :func:`operations.disruption.disrupt`)"""
    for lease in Lease.objects.filter(node=node, state__in=LIVE_LEASE_STATES).select_related("pool"):
        outcome = simulate_placement(lease, exclude_node_ids=[node.pk])
        if not outcome["placeable"]:
            return False, f"lease {lease.pk} could not be placed elsewhere: {outcome['message']}"
    return True, ""


def scale_down(*, pool_id, actor: Actor, now) -> int:
    """Cordon and drain one idle machine of the pool (deleted once drained). Returns 1 or 0."""
    with transaction.atomic():
        ops = PoolOperations.objects.select_for_update(of=("self",)).select_related("pool").get(pool_id=pool_id)
        pool = ops.pool
        machines = list(
            ProviderMachine.objects.filter(pool=pool, state=MachineState.READY, node__isnull=False)
            .select_related("node", "decision")
            .order_by("requested_at")
        )
        # Surge nodes belong to their upgrade until it ends: scale-down leaves them alone meanwhile
        # (removing one mid-upgrade dropped the Ready ratio and paused the roll). Once it ended, they
        # go first, idle or not (their work moves under the budgets), so the pool returns to its size.
        running = {
            str(pk)
            for pk in Upgrade.objects.filter(pool=pool, state__in=ACTIVE_UPGRADE_STATES).values_list("pk", flat=True)
        }
        machines = [m for m in machines if _surge_of(m) not in running and not _replacing(m)]
        surplus = [m for m in machines if _surge_of(m) and m.node.lifecycle == Lifecycle.READY]
        underused = {}
        for machine in machines:
            node = machine.node
            if node.lifecycle == Lifecycle.READY and utilization(node) < ops.scale_down_utilization:
                underused[str(node.pk)] = (ops.underused_since or {}).get(str(node.pk), now.isoformat())
        if underused != (ops.underused_since or {}):
            ops.underused_since = underused
            ops.save(update_fields=["underused_since", "updated_at"])
        last_change = max(filter(None, [ops.last_scale_down_at, ops.last_scale_up_at]), default=None)
        if last_change and now < last_change + timedelta(seconds=ops.scale_down_cooldown):
            return 0
        removing = ProviderMachine.objects.filter(
            pool=pool, state__in=[MachineState.DRAINING, MachineState.DELETING]
        ).count()
        members = capacity.member_nodes(pool).count() - removing
        due = surplus + [
            m
            for m in machines
            if m not in surplus
            and str(m.node_id) in underused
            and now - _parse(underused[str(m.node_id)]) >= timedelta(seconds=ops.scale_down_after)
        ]
        if not due:
            return 0
        # Idle now, but not unneeded while lease requests wait that a node like these would hold
        # (cluster-autoscaler, likewise, removes no node that pending pods could use): a machine
        # that just became ready must not be drained before the queue pass places work on it, or
        # a loaded control plane churns machines up and down for the same demand.
        waiting = list(LeaseRequest.objects.filter(pool=pool, state=LeaseRequestState.PENDING))
        if not surplus and waiting and _bins_needed(pool, ops, waiting)[0]:
            _held_back(
                pool, ScaleDirection.DOWN,
                f"{len(due)} idle node(s); held back: {len(waiting)} lease request(s) pending", actor,
            )  # fmt: skip
            return 0
        if members - 1 < ops.min_nodes:
            _held_back(
                pool, ScaleDirection.DOWN, f"{len(due)} idle node(s); held back: at min_nodes {ops.min_nodes}", actor
            )
            return 0
        # Every candidate gets its own answer: one blocked node never stops the others.
        candidates: list[dict] = []
        for machine in due:
            node = machine.node
            ok, why = replaceable(node)
            if not ok:
                candidates.append({"node_id": str(node.pk), "node": str(node), "reason": why})
                continue
            try:
                with transaction.atomic():  # the machine's move and the node's drain, or neither
                    # A following pass (which takes no pool lock) may have moved the machine since
                    # it was read, when its node was lost or retired: then it is not ours to remove.
                    if not _moved(machine, "drain"):
                        candidates.append(
                            {"node_id": str(node.pk), "node": str(node), "reason": "machine moved on meanwhile"}
                        )
                        continue
                    disruption.disrupt(
                        node=node,
                        reason=DisruptionReason.SCALE_DOWN,
                        owner=outofservice.AUTOSCALER,
                        policy=ops.drain_policy,
                        why=f"scale-down: surge node of upgrade {_surge_of(machine)}, which ended"
                        if machine in surplus
                        else f"scale-down: below {ops.scale_down_utilization:.0%} for {ops.scale_down_after}s",
                        timeout=ops.drain_timeout,
                        now=now,
                    )
            except disruption.DisruptionBlocked as blocked:
                blocked.record()  # outside the rolled-back savepoint, so the node shows it
                candidates.append({"node_id": str(node.pk), "node": str(node), "reason": blocked.verdict.describe()})
                continue
            except Problem as exc:  # the node changed since it was read (an operator, a rule): not now
                candidates.append({"node_id": str(node.pk), "node": str(node), "reason": str(exc.detail)})
                continue
            ops.last_scale_down_at = now
            ops.underused_since = {k: v for k, v in underused.items() if k != str(node.pk)}
            ops.save(update_fields=["last_scale_down_at", "underused_since", "updated_at"])
            _decide(
                pool,
                ScaleDirection.DOWN,
                ScaleOutcome.REQUESTED,
                1,
                (
                    f"surge node {node} of upgrade {_surge_of(machine)}, which ended"
                    if machine in surplus
                    else f"node {node} below {ops.scale_down_utilization:.0%} utilization for {ops.scale_down_after}s"
                )
                + " and its leases can be placed elsewhere: cordon, drain, delete",
                actor,
                node_id=str(node.pk),
                machine=machine.name,
                candidates=candidates,
            )
            return 1
        _held_back(
            pool,
            ScaleDirection.DOWN,
            f"{len(due)} idle node(s); held back: "
            + "; ".join(f"{c['node']}: {c['reason']}" for c in candidates[:3])
            + (f"; and {len(candidates) - 3} more" if len(candidates) > 3 else ""),
            actor,
            candidates=candidates,
        )
    return 0


def _replacing(machine: ProviderMachine) -> bool:
    """A consolidation replacement whose old node is not taken out yet: idle on purpose, it waits
    for the work it was launched for (operations.consolidation), so scale-down leaves it alone."""
    data = (machine.decision.data or {}) if machine.decision_id else {}
    if data.get("consolidation") != "replace":
        return False
    return ProviderMachine.objects.filter(name=data.get("machine"), state=MachineState.READY).exists()


def _surge_of(machine: ProviderMachine) -> str | None:
    """The upgrade id a surge machine was asked for (``ScaleDecision.data.upgrade_id``), or None."""
    return ((machine.decision.data or {}) if machine.decision_id else {}).get("upgrade_id")


def _parse(value: str):

    return datetime.fromisoformat(value)
