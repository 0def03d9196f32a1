"""Automated node repair: a pool's repair rules, the sweep that applies them, and its safety breaker.

A pool's ``PoolOperations.repair_rules`` is a list of rules (after EKS/GKE node auto-repair and
Karpenter's node repair policies, ``{conditionType, conditionStatus, tolerationDuration}``)::

    [{"condition": "Ready", "status": "False", "for": "10m", "action": "reboot"},
     {"condition": "DevicesHealthy", "status": "False", "for": "30m", "action": "replace"}]

- ``condition``: a node condition type: the built-in ones (:data:`WELL_KNOWN_CONDITIONS`), the
  pool's health policy lists, any type a node of the pool reports, or ``DevicesHealthy`` (``False``
  while a device of the node is unhealthy or missing: device health from fleet.devices, which never
  feeds the node's own health). ``status``: ``"True"``, ``"False"`` or ``"Unknown"``.
- ``for``: how long the condition must hold, in control-plane time (``"10m"``, ``"1h30m"`` or
  seconds; 10 s to 30 days).
- ``action``: ``reboot`` (the agent runs its operator-configured reboot command; the server never
  sends a command), ``replace`` (through the pool's provider: a pool without one is refused when
  the rule is written) or ``quarantine`` (revokes the node's credential: it comes back only when a
  person releases it).

The sweep (:func:`sweep`, beat ``operations-sweep-repairs``):

1. **Outage guard.** It observes the control-plane clock first (:func:`fleet.clock.observe`).
   While a gap of the control plane (clock jump or outage: ``ControlPlaneClock.last_gap_ended_at``,
   ``LivenessSweepState.recovered_at``) is less than ``REPAIR_SETTLE`` seconds behind, or the
   mass-silence guard holds the pool, no repair starts or escalates, and every repair timer counts
   from the recovery and is extended past detected gaps: an outage of the control plane never
   triggers mass repairs.
2. **Safety breaker** (Karpenter's node repair: none while more than 20 % of a NodePool is
   unhealthy): a member is unhealthy when a repair rule's condition holds on it now (whatever its
   duration) or it is ``unreachable``/``lost``. Above ``repair_max_unhealthy`` (0.2) of the members,
   the breaker is open and no repair starts; it opens and closes with a ``repair_breaker`` event,
   is shown on the pool and exported as ``nodepool_pool_repair_breaker_open``.
3. **At most ``repair_max_concurrent``** (1) repairs in progress per pool, counted under the
   pool's settings row lock; one repair per node (a partial unique index), so two sweeps never
   start two repairs of one node.
4. Every disruption asks the one gate (:func:`operations.disruption.disrupt`, reason ``repair``):
   the node gets a ``system:repair`` hold and a drain; a quarantine asks the gate too.

A :class:`~operations.models.Repair` moves (django-fsm-2)::

    pending ─drained─▶ rebooting ─new boot─▶ verifying ─healthy─▶ succeeded (returned to service)
                                                 └─still failing after "for"─▶ escalated → replace
    pending ─drained─▶ replacing ─node removed─▶ succeeded;  pending ─quarantined─▶ succeeded

A rebooted node returns to service only when its health checks pass (Slurm's ``ReturnToService``
with a ``HealthCheckProgram``): the rule's condition no longer holds, health is schedulable and it
reports ready; then maintenance → admitting → admission, and the ``system:repair`` hold is lifted
(other actors' holds stay). The reboot is recorded as planned (event ``repair``, ``planned_reboot``);
any other new boot id is not. Still failing ``for`` after the reboot, the repair escalates to
``replace`` (pool with a provider) or else ``quarantine``.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from fleet import clock
from fleet.choices import Lifecycle, Liveness
from fleet.events import Actor, record_event
from fleet.instructions import Instruction, post_instructions
from fleet.models import (
    Node,
    NodeHold,
    Pool,
)
from fleet.selectors import SCHEDULABLE_HEALTH
from maintenance import holds
from maintenance import services as maintenance_services
from maintenance.choices import DrainState
from maintenance.models import Drain
from nodepool.api.problems import Problem

from . import conf, disruption, event_types, launches, machines, outofservice
from .choices import ACTIVE_REPAIR_STATES, DisruptionReason, ProviderKind, RepairAction, RepairState
from .expiry import recovered_at
from .models import PoolOperations, Repair
from .repair_rules import DEVICES_HEALTHY, _bad_devices, _label, condition_since, due_at, guard

logger = logging.getLogger(__name__)

UNREACHABLE = (Liveness.UNREACHABLE, Liveness.LOST)


# --- the breaker ----------------------------------------------------------------------------------
def pool_health(pool: Pool, rules: list[dict], *, now: datetime) -> dict:
    """``{"members", "unhealthy", "fraction", "matches": {node_id: [(index, rule, since)]}}``: the
    members (not retired), those unhealthy for the breaker (a rule's condition holds, or
    unreachable/lost) and, per node, the rules whose condition holds with since when."""
    nodes = list(Node.objects.filter(pool=pool).exclude(lifecycle=Lifecycle.RETIRED))
    bad_devices = _bad_devices(n.pk for n in nodes) if any(r["condition"] == DEVICES_HEALTHY for r in rules) else {}
    matches: dict = {}
    unhealthy = 0
    for node in nodes:
        found = []
        for index, rule in enumerate(rules):
            since = condition_since(node, rule, bad_devices, now)
            if since is not None:
                found.append((index, rule, since))
        if found:
            matches[node.pk] = found
        if found or node.liveness in UNREACHABLE:
            unhealthy += 1
    members = len(nodes)
    return {
        "members": members,
        "unhealthy": unhealthy,
        "fraction": unhealthy / members if members else 0.0,
        "matches": matches,
        "nodes": {n.pk: n for n in nodes},
    }


def _set_breaker(ops: PoolOperations, *, open_: bool, detail: str, now: datetime, actor: Actor) -> None:
    """Store the breaker's state on the pool's settings row; an event and a log line when it changes."""
    with transaction.atomic():
        row = PoolOperations.objects.select_for_update(of=("self",)).get(pk=ops.pk)
        if row.repair_breaker_open == open_ and (not open_ or row.repair_breaker_detail == detail):
            return
        changed = row.repair_breaker_open != open_
        row.repair_breaker_open, row.repair_breaker_detail = open_, detail
        if changed:
            row.repair_breaker_since = now
        row.save(update_fields=["repair_breaker_open", "repair_breaker_detail", "repair_breaker_since"])
        if changed:
            record_event(None, event_types.REPAIR_BREAKER, actor, pool=ops.pool_id, subject_type="pool",
                         to_state="open" if open_ else "closed", reason=detail or "repair breaker closed",
                         data={"open": open_, "detail": detail})  # fmt: skip
            logger.warning("repair_breaker_%s", "opened" if open_ else "closed",
                           extra={"pool": ops.pool.name, "detail": detail})  # fmt: skip


# --- the sweep ------------------------------------------------------------------------------------
def sweep(*, now: datetime | None = None, actor: Actor | None = None) -> dict:
    """One repair pass over every pool with repair rules or repairs in progress; safe to run twice
    at once (claims under the pool's settings row lock and the one-repair-per-node index). A pool
    that fails is logged and skipped. Returns ``{pool name: {"started", "advanced", "guard",
    "breaker"}}``."""
    now = now or timezone.now()
    actor = actor or Actor.system(outofservice.REPAIR)
    clock.observe(now=now, actor=actor)
    recovered = recovered_at()
    gaps = clock.detected_gaps() if recovered is not None else []
    pool_ids = set(Repair.objects.filter(state__in=ACTIVE_REPAIR_STATES).values_list("pool_id", flat=True))
    for pool_id, rules in PoolOperations.objects.values_list("pool_id", "repair_rules"):
        if rules:
            pool_ids.add(pool_id)
    result = {}
    for ops in PoolOperations.objects.filter(pool_id__in=pool_ids).select_related("pool").order_by("pool__name"):
        try:
            result[ops.pool.name] = sweep_pool(ops=ops, now=now, actor=actor, recovered=recovered, gaps=gaps)
        except Exception:  # one pool's failure must not hold back the others (tried again next run)
            logger.exception("repair_sweep_pool_failed", extra={"pool": ops.pool.name})
    return result


def sweep_pool(*, ops: PoolOperations, now: datetime, actor: Actor, recovered=None, gaps=()) -> dict:
    """Advance the pool's repairs in progress, then start new ones where the rules, the guard, the
    breaker and the concurrency limit allow (see the module doc)."""
    pool = ops.pool
    rules = ops.repair_rules or []
    held = guard(pool, now=now, recovered=recovered)
    advanced = 0
    for repair in Repair.objects.filter(pool=pool, state__in=ACTIVE_REPAIR_STATES).order_by("created_at"):
        advanced += advance(repair_id=repair.pk, now=now, actor=actor, held=held, recovered=recovered, gaps=gaps)
    health = pool_health(pool, rules, now=now)
    limit = ops.repair_max_unhealthy
    open_ = health["members"] > 0 and health["fraction"] > limit
    detail = (
        f"{health['unhealthy']} of {health['members']} nodes unhealthy ({health['fraction']:.0%}), more than "
        f"repair_max_unhealthy {limit:.0%}: no automated repair"
        if open_
        else ""
    )
    _set_breaker(ops, open_=open_, detail=detail, now=now, actor=actor)
    started = 0
    if rules and not held and not open_:
        started = _start_due(ops, health, now=now, actor=actor, recovered=recovered, gaps=gaps)
    return {"started": started, "advanced": advanced, "guard": held, "breaker": detail}


def _start_due(ops: PoolOperations, health: dict, *, now, actor, recovered, gaps) -> int:
    """Start repairs of the nodes whose rule is due, longest-failing first, up to the limit."""
    active_nodes = set(Repair.objects.filter(state__in=ACTIVE_REPAIR_STATES).values_list("node_id", flat=True))
    due = []
    for node_id, found in health["matches"].items():
        node = health["nodes"][node_id]
        if node_id in active_nodes or node.lifecycle != Lifecycle.READY:
            continue  # a node in maintenance, draining, admitting… is someone else's business now
        for index, rule, since in found:  # rules in order: the first due one applies
            if due_at(since, rule["for"], recovered=recovered, gaps=gaps) <= now:
                due.append((since, str(node_id), index, rule))
                break
    started = 0
    for _since, node_id, index, rule in sorted(due):
        outcome = start(pool_id=ops.pool_id, node_id=node_id, rule=rule, rule_index=index, now=now, actor=actor)
        if outcome == "limit":
            break
        started += outcome == "started"
    return started


def start(*, pool_id, node_id, rule: dict, rule_index: int, now: datetime, actor: Actor) -> str:
    """Claim a repair of ``node_id`` by ``rule`` and take the node out through the one gate.

    Under the pool's settings row lock (the gate's own lock, taken first here): the pool's repairs
    in progress are counted against ``repair_max_concurrent``, then the Repair row is inserted
    (the partial unique index ``repair_one_active_per_node`` refuses a second one of the node).

    Returns ``"started"``, ``"limit"`` (the pool has its repairs in progress), ``"taken"`` (another
    sweep repairs the node, or another actor moved it meanwhile) or ``"blocked"`` (the gate said
    no: recorded on the node, nothing kept).
    """
    blocked = None
    with transaction.atomic():
        ops = disruption.lock_pool_operations(pool_id)
        if Repair.objects.filter(pool_id=pool_id, state__in=ACTIVE_REPAIR_STATES).count() >= ops.repair_max_concurrent:
            return "limit"
        node = Node.objects.get(pk=node_id)
        if node.lifecycle != Lifecycle.READY:
            return "taken"
        try:
            with transaction.atomic():
                repair = Repair.objects.create(
                    pool_id=pool_id, node=node, action=rule["action"], rule=rule, rule_index=rule_index,
                    condition=_label(rule), created_at=now,
                )  # fmt: skip
        except IntegrityError:
            return "taken"
        why = f"repair: {_label(rule)} for {rule['for']}s: {rule['action']}"
        try:
            with transaction.atomic():
                _take_out(repair, node, ops=ops, why=why, now=now, actor=actor)
        except disruption.DisruptionBlocked as exc:
            blocked = exc
            transaction.set_rollback(True)
        except Problem:
            # Another actor moved the node meanwhile (a drift replacement's drain, an operator's
            # action: 409/412 from the drain): nothing kept, the next sweep looks again.
            transaction.set_rollback(True)
            return "taken"
    if blocked is not None:
        blocked.record()
        return "blocked"
    return "started"


def _take_out(repair: Repair, node: Node, *, ops: PoolOperations, why: str, now, actor: Actor) -> None:
    """The gate, then the action's first step (in the claiming transaction)."""
    if repair.action == RepairAction.QUARANTINE:
        verdict = disruption.request_disruption(
            node=node, reason=DisruptionReason.REPAIR, owner=outofservice.REPAIR, now=now, record=False
        )
        if not verdict.allowed:
            raise disruption.DisruptionBlocked(verdict, node=node, owner=outofservice.REPAIR, now=now)
        _quarantine(repair, node, why=why, now=now, actor=actor)
        return
    drain = disruption.disrupt(node=node, reason=DisruptionReason.REPAIR, owner=outofservice.REPAIR, why=why,
                               policy=ops.drain_policy, timeout=ops.drain_timeout, now=now)  # fmt: skip
    repair.drain_id = drain.pk
    repair.save(update_fields=["drain_id", "updated_at"])
    _event(repair, actor, f"repair started: {why}; cordoned and draining", drain_id=str(drain.pk))


def _quarantine(repair: Repair, node: Node, *, why: str, now, actor: Actor) -> None:
    maintenance_services.quarantine_node(
        node_id=node.pk,
        reason=f"{outofservice.REPAIR}: {why}",
        evidence={"repair_id": str(repair.pk), "condition": repair.condition, "rule": repair.rule},
        actor=Actor.system(outofservice.REPAIR),
        now=now,
    )
    _remove_hold(node, actor, "quarantined by repair")
    repair.succeed()
    _finish(repair, now, "quarantined: the credential is revoked; a person must release the node")
    _event(repair, actor, f"repair quarantined the node ({repair.condition}); it needs a person to come back")


def _event(repair: Repair, actor: Actor, reason: str, **data) -> None:
    record_event(repair.node_id, event_types.REPAIR, actor, pool=repair.pool_id, subject_type="repair",
                 subject_id=repair.pk, to_state=repair.state, reason=reason,
                 data={"action": repair.action, "condition": repair.condition, **data})  # fmt: skip


def _finish(repair: Repair, now, detail: str) -> None:
    repair.finished_at, repair.detail = now, detail[:2000]
    repair.save()


def _remove_hold(node: Node, actor: Actor, reason: str) -> None:
    """Lift the ``system:repair`` hold only (other actors' holds stay)."""
    locked = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    holds.remove_holds_where(locked, owner=outofservice.REPAIR, actor=Actor.system(outofservice.REPAIR),
                             reason=reason, bump_version=True)  # fmt: skip


# --- moving a repair ------------------------------------------------------------------------------
def advance(*, repair_id, now: datetime, actor: Actor, held: str = "", recovered=None, gaps=()) -> int:
    """One step of one repair, under its row lock; returns 1 if it moved. ``held``: the outage
    guard's reason (no escalation while it holds)."""
    with transaction.atomic():
        repair = Repair.objects.select_for_update(of=("self",)).filter(pk=repair_id).first()
        if repair is None or repair.state not in ACTIVE_REPAIR_STATES:
            return 0
        node = Node.objects.get(pk=repair.node_id)
        before = repair.state
        if node.lifecycle in (Lifecycle.RETIRED, Lifecycle.QUARANTINED) and repair.state != RepairState.REPLACING:
            repair.fail()
            _finish(repair, now, f"the node was {node.lifecycle} by someone else")
            _event(repair, actor, repair.detail)
        elif repair.state == RepairState.PENDING:
            _after_drain(repair, node, now=now, actor=actor)
        elif repair.state == RepairState.REBOOTING:
            _after_reboot(repair, node, now=now, actor=actor)
        elif repair.state == RepairState.VERIFYING:
            _verify(repair, node, now=now, actor=actor, held=held, recovered=recovered, gaps=gaps)
        elif repair.state == RepairState.REPLACING:
            _remove_node(repair, node, now=now, actor=actor)
        moved = repair.state != before
    return int(moved)


def _after_drain(repair: Repair, node: Node, *, now, actor: Actor) -> None:
    """pending: once the drain parked the node (maintenance), reboot it or replace it."""
    drain = Drain.objects.filter(pk=repair.drain_id).first() if repair.drain_id else None
    if drain is not None and drain.state in (DrainState.CANCELLED, DrainState.ABORTED):
        repair.fail()
        _remove_hold(node, actor, "repair failed: its drain was cancelled")
        _finish(repair, now, f"the drain was {drain.state} by someone else; the repair's hold is lifted")
        _event(repair, actor, repair.detail)
        return
    if node.lifecycle != Lifecycle.MAINTENANCE:
        return  # still draining
    if repair.action == RepairAction.REBOOT:
        repair.reboot()
        repair.boot_id, repair.incarnation = node.boot_id, node.incarnation
        repair.detail = "drained; the agent is told to run its reboot command"
        repair.save()
        post_instructions([node.pk], Instruction.REPAIR)
        _event(repair, actor, repair.detail, boot_id=node.boot_id, incarnation=node.incarnation)
    else:
        _begin_replacement(repair, node, now=now, actor=actor)


def _begin_replacement(repair: Repair, node: Node, *, now, actor: Actor) -> None:
    """pending → replacing: ask the provider for one node now (not counting the leaving one)."""

    repair.replace()
    repair.detail = "drained; a replacement is asked of the provider and the node is being removed"
    repair.save()
    pool_id, node_id, repair_id = repair.pool_id, str(node.pk), str(repair.pk)
    transaction.on_commit(
        lambda: launches.request_extra(
            pool_id=pool_id, count=1, why="replacement for a repaired node: {count} node(s)",
            key={"repair_id": repair_id}, actor=actor, leaving=[node_id],
        )
    )  # fmt: skip
    _event(repair, actor, repair.detail)


def _remove_node(repair: Repair, node: Node, *, now, actor: Actor) -> None:
    """replacing: the node's machine deleted through the provider (or the node retired), then done."""

    if node.lifecycle != Lifecycle.RETIRED:
        if not machines.remove_machine_of(node, actor=actor, reason=f"repair {repair.pk}: replaced"):
            outofservice.retire(node=node, owner=outofservice.REPAIR, reason=f"replaced by repair {repair.pk}")
        node = Node.objects.get(pk=node.pk)
    if node.lifecycle == Lifecycle.RETIRED:
        NodeHold.objects.filter(node=node, owner=outofservice.REPAIR, removed_at__isnull=True).update(removed_at=now)
        repair.succeed()
        _finish(repair, now, "replaced: a new node was asked of the provider and this one removed")
        _event(repair, actor, repair.detail)


def _after_reboot(repair: Repair, node: Node, *, now, actor: Actor) -> None:
    """rebooting: a new boot id (or agent incarnation) is the planned reboot; none in time fails."""
    rebooted = (node.boot_id and node.boot_id != repair.boot_id) or node.incarnation > (repair.incarnation or 0)
    if rebooted:
        repair.rebooted()
        repair.rebooted_at = now
        repair.verify_until = now + timedelta(seconds=int(repair.rule.get("for", 600)))
        repair.detail = "rebooted (planned); waiting for the node's health checks to pass"
        repair.save()
        _event(repair, actor, "planned reboot by repair observed", planned_reboot=True,
               boot_id=node.boot_id, previous_boot_id=repair.boot_id, incarnation=node.incarnation)  # fmt: skip
        return
    timeout = float(conf.get("REPAIR_REBOOT_TIMEOUT"))
    if (now - repair.updated_at).total_seconds() > timeout:
        repair.fail()
        _remove_hold(node, actor, "repair failed: no reboot")
        _finish(repair, now, f"no new boot within {timeout:g}s of the reboot instruction (is the agent's "
                             "--repair-reboot-command set?); the node stays in maintenance")  # fmt: skip
        _event(repair, actor, repair.detail)


def healthy(node: Node, rule: dict, *, now) -> bool:
    """The health check a repaired node must pass to return: the rule's condition no longer holds,
    health is schedulable, it is alive and reports ready."""
    bad_devices = _bad_devices([node.pk]) if rule["condition"] == DEVICES_HEALTHY else {}
    return (
        condition_since(node, rule, bad_devices, now) is None
        and node.health in SCHEDULABLE_HEALTH
        and node.liveness == Liveness.ALIVE
        and node.ready
    )


def _verify(repair: Repair, node: Node, *, now, actor: Actor, held: str, recovered, gaps) -> None:
    """verifying: healthy → return to service (admission again) and succeed; still failing once
    ``for`` has passed again (control-plane time) → escalate to a stronger action."""
    if healthy(node, repair.rule, now=now):
        outofservice.return_to_service(node=node, owner=outofservice.REPAIR, reason=f"repair {repair.pk}: healthy")
        repair.succeed()
        _finish(repair, now, "health checks passed after the reboot; returned to service (admission again)")
        _event(repair, actor, repair.detail)
        return
    until = clock.extend_past_gaps(repair.rebooted_at or now, repair.verify_until or now, gaps)
    if recovered is not None and repair.rebooted_at and recovered > repair.rebooted_at:
        until = max(until, recovered + timedelta(seconds=int(repair.rule.get("for", 600))))
    if held or now < until:
        return
    ops = PoolOperations.objects.get(pool_id=repair.pool_id)
    action = RepairAction.REPLACE if ops.provider != ProviderKind.NONE else RepairAction.QUARANTINE
    repair.escalate()
    _finish(repair, now, f"still {repair.condition} {repair.rule.get('for')}s after the reboot: escalated to {action}")
    _event(repair, actor, repair.detail, escalated_to=action)
    successor = Repair.objects.create(pool_id=repair.pool_id, node=node, action=action, rule=repair.rule,
                                      rule_index=repair.rule_index, condition=repair.condition,
                                      escalated_from=repair, created_at=now)  # fmt: skip
    _event(successor, actor, f"repair escalated from reboot to {action}", escalated_from=str(repair.pk))
    if action == RepairAction.REPLACE:
        _begin_replacement(successor, node, now=now, actor=actor)
    else:
        _quarantine(successor, node, why=f"escalated from reboot: {repair.condition}", now=now, actor=actor)


# --- what the node, the pool and the API see ------------------------------------------------------
def repair_instruction_for_report(sender, node, **kwargs) -> dict:
    """A status-report handler (fleet.instructions, order 310): ``{"repair": {"repair_id",
    "action": "reboot"}}`` while a repair waits for the node's reboot, else ``{}`` (one query)."""
    if node.lifecycle != Lifecycle.MAINTENANCE:
        return {}
    repair = Repair.objects.filter(node_id=node.pk, state=RepairState.REBOOTING).values_list("pk", flat=True).first()
    return {"repair": {"repair_id": str(repair), "action": RepairAction.REBOOT}} if repair else {}


def pool_status(pool: Pool, *, now: datetime | None = None) -> dict:
    """What ``GET /pools/{name}/repairs``, the admin and ``nodepoolctl describe pool`` show:
    ``{"pool", "rules", "max_unhealthy", "max_concurrent", "breaker": {"open", "since", "detail"},
    "members", "unhealthy", "guard", "in_progress": [repair dicts], "recent": [repair dicts]}``."""
    now = now or timezone.now()
    ops, _ = PoolOperations.objects.get_or_create(pool=pool)
    health = pool_health(pool, ops.repair_rules or [], now=now)
    repairs = Repair.objects.filter(pool=pool).select_related("node")
    return {
        "pool": pool.name,
        "rules": ops.repair_rules or [],
        "max_unhealthy": ops.repair_max_unhealthy,
        "max_concurrent": ops.repair_max_concurrent,
        "breaker": {
            "open": ops.repair_breaker_open,
            "since": ops.repair_breaker_since.isoformat() if ops.repair_breaker_since else None,
            "detail": ops.repair_breaker_detail,
        },
        "members": health["members"],
        "unhealthy": health["unhealthy"],
        "guard": guard(pool, now=now, recovered=recovered_at()),
        "in_progress": [repair_dict(r) for r in repairs.filter(state__in=ACTIVE_REPAIR_STATES)],
        "recent": [repair_dict(r) for r in repairs.exclude(state__in=ACTIVE_REPAIR_STATES)[:10]],
    }


def repair_dict(repair: Repair) -> dict:
    """``{"id", "node_id", "node", "action", "state", "condition", "rule", "escalated_from",
    "created_at", "finished_at", "detail"}``."""
    return {
        "id": str(repair.pk),
        "node_id": str(repair.node_id),
        "node": str(repair.node),
        "action": repair.action,
        "state": repair.state,
        "condition": repair.condition,
        "rule": repair.rule,
        "escalated_from": str(repair.escalated_from_id) if repair.escalated_from_id else None,
        "created_at": repair.created_at.isoformat(),
        "finished_at": repair.finished_at.isoformat() if repair.finished_at else None,
        "detail": repair.detail,
    }
