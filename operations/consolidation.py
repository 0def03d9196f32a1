"""Consolidation: fewer or cheaper machines for the same work, under the pool disruption budgets.

Optional per pool (``PoolOperations.consolidate_after`` seconds; null = off), after Karpenter's
``disruption.consolidationPolicy: WhenEmptyOrUnderutilized`` with ``consolidateAfter``. One step
per pool per autoscaling pass (:func:`consolidate_pool`, from the beat entry ``operations-autoscale``
after the autoscaler's pass), under the pool's settings row lock, acting on machines a provider
created only:

1. **a replacement that is ready** takes its node's place: the node it replaces is cordoned and
   drained through the one gate (reason ``consolidation``, hold ``system:consolidation``), its
   leases requeued and placed, then its machine deleted (the autoscaler's follow step);
2. otherwise, among the pool's ready machines whose node has been **settled** for
   ``consolidate_after`` (no lease granted or ended on it, and ready, that long), emptiest first:

   * **delete** an empty node, or one whose live leases the placement preview shows fit on the
     other nodes *together* (:func:`leases.preview.preview_leases`) — never below ``min_nodes``;
   * **replace** an under-used node (below ``scale_down_utilization``) by one node of the pool's
     current template when its leases fit on that one node and the template's hourly ``price``
     saves at least ``consolidation_min_saving`` of the machine's (both prices set); **never** by a
     node of the same type (resources) and price — so a pool at steady state never churns. The
     gate is asked *before* the replacement is launched (``record``: the node shows why not): a
     node that may not be disrupted now launches nothing (the pass would otherwise launch a node
     every cycle that nothing uses, kubernetes-sigs/karpenter #1842).

Nothing is consolidated while lease requests wait (demand first, as scale-down), while a machine of
the pool is on its way, being drained or deleted (one disruption at a time), or while the pool
backs off. Each action is a :class:`ScaleDecision` (``data.consolidation``: ``delete`` |
``replace``, with the node, the machine and the saving) and a ``scale`` event; a held-back
replacement says why once.

Prices: the template's ``price`` (per machine-hour, the operator's figure); a machine remembers the
template it was made from (``ProviderMachine.template``). Karpenter reads instance prices from the
cloud's price list; the marketplace's per-resource prices are what owners are paid for leases, not
what a machine costs, and the marketplace app is the operations app's sibling (neither imports the
other), so they are not used.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from decimal import Decimal, InvalidOperation

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from fleet.choices import Lifecycle
from fleet.events import Actor
from fleet.models import Node
from leases.choices import LIVE_LEASE_STATES, LeaseRequestState
from leases.models import Lease, LeaseRequest
from leases.preview import lease_spec, preview_leases
from nodepool.api.problems import Problem

from . import autoscaler, capacity, demand, disruption, launches, machines, outofservice
from .choices import (
    ACTIVE_UPGRADE_STATES,
    DisruptionReason,
    MachineState,
    ProviderKind,
    ScaleDirection,
    ScaleOutcome,
)
from .models import PoolOperations, ProviderMachine, ScaleDecision, Upgrade

logger = logging.getLogger(__name__)
ACTOR = Actor.system(outofservice.CONSOLIDATION)
BUSY_STATES = (MachineState.REQUESTED, MachineState.ENROLLED, MachineState.DRAINING, MachineState.DELETING)


def consolidate_all(*, actor: Actor = ACTOR, now=None) -> dict:
    """:func:`consolidate_pool` for every pool with consolidation on; one failing pool is logged
    and skipped. Returns ``{pool id: what it did}``."""
    result = {}
    pools = PoolOperations.objects.exclude(provider=ProviderKind.NONE).filter(consolidate_after__isnull=False)
    for pool_id in pools.values_list("pool_id", flat=True):
        try:
            result[str(pool_id)] = consolidate_pool(pool_id=pool_id, actor=actor, now=now)
        except Exception:
            logger.exception("consolidating pool %s failed; the next pass tries again", pool_id)
    return result


def price(template: dict | None) -> Decimal | None:
    """A template's hourly ``price`` (None when not set or unreadable)."""
    value = (template or {}).get("price")
    try:
        return Decimal(str(value)) if value is not None else None
    except InvalidOperation:
        return None


def saving(old: dict | None, new: dict | None) -> float | None:
    """The fraction of ``old``'s hourly price a node of ``new`` saves (negative: dearer); None when
    either price is unknown, or the old one is 0."""
    before, after = price(old), price(new)
    if before is None or after is None or before <= 0:
        return None
    return float((before - after) / before)


def same_type_and_price(old: dict | None, new: dict | None) -> bool:
    """Same resources and the same price: replacing one by the other changes nothing."""
    old, new = old or {}, new or {}
    return old.get("resources") == new.get("resources") and price(old) == price(new)


def settled_since(node: Node, machine: ProviderMachine):
    """When the node last changed: the latest grant or end of a lease on it, or its machine's ready
    time (Karpenter's ``consolidateAfter`` counts from the last pod scheduled or removed)."""
    leases = Lease.objects.filter(node=node).aggregate(granted=Max("granted_at"), ended=Max("ended_at"))
    return max(filter(None, [machine.ready_at, machine.requested_at, leases["granted"], leases["ended"]]))


def _fits_one_template_node(pool, ops: PoolOperations, leases: list[Lease]) -> bool:
    """Would one empty node of the pool's template hold all ``leases`` at once (each passing the
    scheduler's filters on it, their resources summed)?"""
    free = capacity.template_allocatable(pool, ops.node_template)
    for lease in leases:
        spec = lease_spec(lease)
        if capacity.template_preview(pool, ops.node_template, spec) is not None:
            return False
        for name, amount in spec.resources.items():
            free[name] = free.get(name, 0) - amount
            if free[name] < 0:
                return False
    return True


def consolidate_pool(*, pool_id, actor: Actor = ACTOR, now=None) -> str:
    """One consolidation step for the pool (module doc). Returns what it did: ``off``, ``waiting``,
    ``disrupted``, ``deleted``, ``replacing``, ``blocked`` or ``nothing``."""
    now = now or timezone.now()
    launch = None
    with transaction.atomic():
        ops = PoolOperations.objects.select_for_update(of=("self",)).select_related("pool").get(pool_id=pool_id)
        if ops.consolidate_after is None or ops.provider == ProviderKind.NONE:
            return "off"
        pool = ops.pool
        pending = _pending_replacements(pool)
        for decision, old in pending:
            outcome = _take_place(ops, decision, old, actor=actor, now=now)
            if outcome:
                return outcome
        if pending:
            return "waiting"  # one replacement at a time
        if ProviderMachine.objects.filter(pool=pool, state__in=BUSY_STATES).exists():
            return "waiting"
        if LeaseRequest.objects.filter(pool=pool, state=LeaseRequestState.PENDING).exists():
            return "waiting"
        running = {
            str(pk)
            for pk in Upgrade.objects.filter(pool=pool, state__in=ACTIVE_UPGRADE_STATES).values_list("pk", flat=True)
        }
        candidates = []
        for machine in ProviderMachine.objects.filter(
            pool=pool, state=MachineState.READY, node__isnull=False
        ).select_related("node", "decision"):
            node = machine.node
            if node.lifecycle != Lifecycle.READY or node.cordoned:
                continue
            if autoscaler._surge_of(machine) in running:
                continue
            if now - settled_since(node, machine) < timedelta(seconds=ops.consolidate_after):
                continue
            candidates.append((autoscaler.utilization(node), machine.requested_at, machine))
        members = capacity.member_nodes(pool).count()
        held = []
        for usage, _at, machine in sorted(candidates, key=lambda c: (c[0], c[1])):
            node = machine.node
            leases = list(Lease.objects.filter(node=node, state__in=LIVE_LEASE_STATES).select_related("pool"))
            if members - 1 >= ops.min_nodes:
                fits = not leases or preview_leases(pool, leases, exclude_node_ids=[node.pk], now=now)["placeable"]
                if fits:
                    outcome = _delete(ops, machine, leases, actor=actor, now=now)
                    if outcome == "deleted":
                        return outcome
                    held.append(f"{node}: {outcome}")
                    continue
            if not leases or usage >= ops.scale_down_utilization:
                continue
            fraction = saving(machine.template, ops.node_template)
            if (
                fraction is None
                or fraction < ops.consolidation_min_saving
                or same_type_and_price(machine.template, ops.node_template)
                or not _fits_one_template_node(pool, ops, leases)
            ):
                continue
            launch = _replace(ops, machine, leases, fraction, members=members, actor=actor, now=now)
            if launch is None:
                held.append(f"{node}: replacement held back")
                continue
            break
        if launch is None:
            return "blocked" if held else "nothing"
    launches._call_provider(*launch, actor)
    return "replacing"


def _pending_replacements(pool) -> list[tuple[ScaleDecision, ProviderMachine]]:
    """Replacement decisions whose old machine is still ready (its node not taken out yet)."""
    out = []
    for decision in ScaleDecision.objects.filter(
        pool=pool, direction=ScaleDirection.UP, data__consolidation="replace"
    ).exclude(outcome__in=[ScaleOutcome.FAILED, ScaleOutcome.BLOCKED]):
        old = (
            ProviderMachine.objects.filter(name=decision.data.get("machine"), state=MachineState.READY)
            .select_related("node")
            .first()
        )
        if old is None:
            continue
        states = set(ProviderMachine.objects.filter(decision=decision).values_list("state", flat=True))
        if states and states <= {MachineState.FAILED, MachineState.DELETED, MachineState.DELETING}:
            continue  # the replacement never made it: the node may be tried again later
        out.append((decision, old))
    return out


def _take_place(ops: PoolOperations, decision: ScaleDecision, old: ProviderMachine, *, actor, now) -> str | None:
    """When the replacement of ``old`` is ready, take ``old``'s node out through the gate."""
    if not ProviderMachine.objects.filter(decision=decision, state=MachineState.READY).exists():
        return None
    why = f"consolidation: replaced by a cheaper node ({decision.data.get('saving', 0):.0%} saving)"
    if _disrupt(ops, old, why=why, now=now):
        return "disrupted"
    return "blocked"


def _disrupt(ops: PoolOperations, machine: ProviderMachine, *, why: str, now) -> bool:
    """Cordon and drain ``machine``'s node through the gate and mark the machine draining (the
    autoscaler's follow step deletes it once drained). False (and the node says why) when the gate
    refuses or the node changed meanwhile."""
    node = machine.node
    try:
        with transaction.atomic():
            if not machines._moved(machine, "drain"):
                return False
            disruption.disrupt(
                node=node,
                reason=DisruptionReason.CONSOLIDATION,
                owner=outofservice.CONSOLIDATION,
                policy=ops.drain_policy,
                why=why,
                timeout=ops.drain_timeout,
                now=now,
            )
    except disruption.DisruptionBlocked as blocked:
        blocked.record()  # outside the rolled-back savepoint, so the node shows it
        return False
    except Problem as exc:  # the node changed since it was read (an operator, a rule): not now
        logger.info("consolidation of %s not now: %s", node, exc.detail)
        return False
    return True


def _delete(ops: PoolOperations, machine: ProviderMachine, leases: list[Lease], *, actor, now) -> str:
    node = machine.node
    empty = not leases
    why = "consolidation: empty" if empty else f"consolidation: its {len(leases)} lease(s) fit on the other nodes"
    if not _disrupt(ops, machine, why=why, now=now):
        return "blocked by the disruption gate"
    fraction = 1.0 if price(machine.template) else None
    launches._decide(
        ops.pool,
        ScaleDirection.DOWN,
        ScaleOutcome.REQUESTED,
        1,
        f"consolidation: node {node} "
        + (f"empty for {ops.consolidate_after}s" if empty else f"merged: its {len(leases)} lease(s) fit elsewhere")
        + ": cordon, drain, delete",
        actor,
        consolidation="delete",
        node_id=str(node.pk),
        machine=machine.name,
        saving=fraction,
    )
    return "deleted"


def _replace(ops: PoolOperations, machine: ProviderMachine, leases: list[Lease], fraction: float, *, members,
             actor, now):  # fmt: skip
    """Launch one template node to replace ``machine`` — only when the gate would let its node go
    now, the pool is not backing off and has room. ``(ops, decision, machine requests)`` or None."""
    node, pool = machine.node, ops.pool
    verdict = disruption.request_disruption(
        node=node, reason=DisruptionReason.CONSOLIDATION, owner=outofservice.CONSOLIDATION, now=now
    )
    in_flight = demand._in_flight(pool.pk)
    held = ""
    if not verdict.allowed:
        held = f"the disruption gate says no: {verdict.describe()}"
    elif ops.backoff_until and now < ops.backoff_until:
        held = f"backing off until {ops.backoff_until.isoformat()}"
    elif ops.max_nodes and members + in_flight >= ops.max_nodes:
        held = f"at max_nodes {ops.max_nodes} (a replacement needs room for one more node first)"
    elif in_flight >= ops.max_launches_in_flight:
        held = f"{in_flight} launch(es) in flight"
    reason = (
        f"consolidation: replace node {node} ({len(leases)} lease(s), price {price(machine.template)}/h) by a "
        f"template node (price {price(ops.node_template)}/h): {fraction:.0%} saving"
    )
    if held:
        launches._held_back(
            pool, ScaleDirection.UP, f"{reason}; held back: {held}", actor, consolidation_of=str(node.pk)
        )
        return None
    decision = launches._decide(
        pool,
        ScaleDirection.UP,
        ScaleOutcome.REQUESTED,
        1,
        reason,
        actor,
        consolidation="replace",
        consolidation_of=str(node.pk),
        machine=machine.name,
        saving=round(fraction, 4),
    )
    requests = launches._new_machines(ops, decision, 1, pending_since=now, now=now)
    return ops, decision, requests
