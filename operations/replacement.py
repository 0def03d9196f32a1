"""Replacing a node under the pool's budgets: the step drift and expiry share (and repair may use).

:func:`replace_node` is the reusable entry ("replace this node under the budget"); the sweep
(:func:`sweep`, the beat task ``operations.sweep_replacements``) finds drifted and expired nodes and
moves every active :class:`~operations.models.NodeReplacement`. The flow follows Karpenter's
disruption controller (disruption docs, "Automated Graceful Methods"): check the budget, cordon
(Karpenter's ``karpenter.sh/disrupted:NoSchedule`` taint; here a hold of the reason's system actor),
pre-spin the replacement and wait for it to be ready, un-cordon and retry if it fails to come up,
then drain and delete::

    pending ──gate allows, pool autoscales──▶ launching ──replacement ready──▶ draining ──▶ replaced
       │  ▲                                    │                                  │
       │  └──────── replacement failed ────────┘                                  ├──▶ failed
       └──gate allows, no provider (or the node has no machine)──▶ draining ──────┘
    any active state ──▶ cancelled (no longer wanted, node retired or gone)

- **The gate** (:func:`operations.disruption.request_disruption`) is asked in the transaction that
  cordons, under the pool's settings lock; a refusal is recorded on the node (``disruption_blocked``)
  and the replacement waits in ``pending``. Its hold counts as disrupting from then on, so a node
  whose replacement is launching spends the budget, as in Karpenter.
- **Where the pool autoscales** and the node is a provider machine, one machine is requested
  (:func:`operations.launches.request_extra`, key ``{"replacement": "<id>:<attempt>"}``, the old
  node not counted against ``max_nodes``) and must be **ready before the old node is drained**; then
  the drained node's machine is deleted through the provider and the node retired.
- **Otherwise** the node is drained and **re-admitted**: it returns to service through admission
  (which records the pool's shape again and verifies the target); ready → ``replaced``, refused →
  ``failed`` with admission's reason (the node stays rejected for a person).
- **Forcing**: a replacement with ``force_at`` (expiry's ``termination_grace``) that is still refused
  at that time goes ahead anyway and records the blocker it overrode (``overrode``, and the event).
- Holds: the owner's hold is removed only by this module (re-admission lifts it; a cancelled or
  relaunched replacement removes it), never anyone else's.

Row locks: a replacement row is locked (``FOR UPDATE``) for each step, so two sweeps never move the
same replacement at once; the partial unique constraint ``replacement_one_active_per_node`` makes two
sweeps that find the same node start one replacement.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from fleet.choices import Lifecycle
from fleet.events import Actor, record_event
from fleet.models import Node
from maintenance import drains, holds
from maintenance.choices import DrainState
from maintenance.models import Drain

from . import disruption, event_types, launches, machines, outofservice
from .choices import ACTIVE_REPLACEMENT_STATES, ACTIVE_UPGRADE_STATES, MachineState, ProviderKind, ReplacementState
from .models import NodeReplacement, PoolOperations, ProviderMachine, ScaleDecision, Upgrade

logger = logging.getLogger(__name__)

RETRY_SECONDS = 60
OWNERS = {"drift": outofservice.DRIFT, "expiry": outofservice.EXPIRY, "repair": outofservice.REPAIR}


def replace_node(
    *, node: Node, reason: str, detail: str = "", force_at=None, actor: Actor | None = None, now=None
) -> tuple[NodeReplacement, bool]:
    """Replace ``node`` under its pool's budgets for ``reason`` (``drift``, ``expiry``, ``repair``):
    start its replacement (or find the active one) and take its next step now.

    ``force_at``: aware datetime after which a refusal by the gate is overridden (expiry's
    ``termination_grace``). Returns ``(replacement, started)``: ``started`` is False when the node
    already had an active replacement (of any reason: one at a time per node).

    Raises: ValueError for an unknown ``reason``. Steps that fail (a 409/412 racing an operator's
    action) are logged and retried by the next sweep; they never raise here.
    """
    if reason not in OWNERS:
        raise ValueError(f"unknown replacement reason {reason!r}")
    now = now or timezone.now()
    owner = OWNERS[reason]
    actor = actor or Actor.system(owner)
    try:
        with transaction.atomic():
            replacement = NodeReplacement.objects.create(
                node=node, pool_id=node.pool_id, reason=reason, owner=owner, detail=detail[:2000],
                wanted_since=now, force_at=force_at,
            )  # fmt: skip
            record_event(
                node,
                event_types.REPLACEMENT,
                actor,
                pool=node.pool_id,
                subject_type="replacement",
                subject_id=replacement.pk,
                to_state=ReplacementState.PENDING,
                reason=f"{reason}: {detail}"[:2000],
                data={"reason": reason, "replacement_id": str(replacement.pk)},
            )
        started = True
    except IntegrityError:
        replacement = NodeReplacement.objects.filter(node=node, state__in=ACTIVE_REPLACEMENT_STATES).first()
        if replacement is None:  # it finished between the insert and this read
            return NodeReplacement.objects.filter(node=node).order_by("-wanted_since").first(), False
        started = False
    return advance(replacement_id=replacement.pk, actor=actor, now=now) or replacement, started


def autoscaled(ops: PoolOperations | None, node: Node) -> bool:
    """Whether ``node`` is replaced by a new machine: its pool has a provider and it is one of the
    provider's machines (a node enrolled by hand in such a pool is re-admitted instead)."""
    return (
        ops is not None
        and ops.provider != ProviderKind.NONE
        and ProviderMachine.objects.filter(node=node, state=MachineState.READY).exists()
    )


def upgrade_active(pool_id) -> Upgrade | None:
    return Upgrade.objects.filter(pool_id=pool_id, state__in=ACTIVE_UPGRADE_STATES).first()


def _move(replacement: NodeReplacement, verb: str, *, actor: Actor, detail: str, node=None, **data) -> None:
    """Apply transition ``verb`` (memory), save, and record the ``replacement`` event."""
    before = replacement.state
    getattr(replacement, verb)()
    replacement.detail = detail[:2000]
    replacement.version += 1
    if replacement.state not in ACTIVE_REPLACEMENT_STATES:
        replacement.finished_at = timezone.now()
    replacement.save()
    record_event(
        node or replacement.node_id,
        event_types.REPLACEMENT,
        actor,
        pool=replacement.pool_id,
        subject_type="replacement",
        subject_id=replacement.pk,
        from_state=before,
        to_state=replacement.state,
        reason=f"{replacement.reason}: {detail}"[:2000],
        data={"reason": replacement.reason, "replacement_id": str(replacement.pk), **data},
    )


def _note(replacement: NodeReplacement, detail: str) -> None:
    if replacement.detail != detail[:2000]:
        NodeReplacement.objects.filter(pk=replacement.pk).update(detail=detail[:2000])
        replacement.detail = detail[:2000]


def _lift_hold(node: Node, replacement: NodeReplacement, *, actor: Actor, why: str) -> None:
    locked = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    holds.remove_holds_where(locked, owner=replacement.owner, actor=actor, reason=why, bump_version=True)


def advance(*, replacement_id, actor: Actor | None = None, now=None) -> NodeReplacement | None:
    """Take the next step of one replacement (the module doc's flow). Returns it, or None when it
    is no longer active. Safe to call from two sweeps at once (row lock)."""
    now = now or timezone.now()
    after_commit: list = []
    try:
        with transaction.atomic():
            replacement = (
                NodeReplacement.objects.select_for_update(of=("self",))
                .filter(pk=replacement_id, state__in=ACTIVE_REPLACEMENT_STATES)
                .first()
            )
            if replacement is None:
                return None
            actor = actor or Actor.system(replacement.owner)
            node = Node.objects.get(pk=replacement.node_id)
            step = {
                ReplacementState.PENDING: _pending,
                ReplacementState.LAUNCHING: _launching,
                ReplacementState.DRAINING: _draining,
            }[replacement.state]
            step(replacement, node, actor=actor, now=now, after_commit=after_commit)
    except Exception:
        # A 409/412 racing an operator's action, a database hiccup: the next sweep tries again.
        logger.exception("replacement %s: step failed", replacement_id)
        return NodeReplacement.objects.filter(pk=replacement_id).first()
    for call in after_commit:
        call()
    return NodeReplacement.objects.filter(pk=replacement_id).first()


def _gone(replacement: NodeReplacement, node: Node) -> str:
    if node.lifecycle in (Lifecycle.RETIRED, Lifecycle.QUARANTINED):
        return f"the node is {node.lifecycle}"
    if node.pool_id != replacement.pool_id:
        return "the node moved to another pool"
    return ""


def _pending(replacement: NodeReplacement, node: Node, *, actor: Actor, now, after_commit: list) -> None:
    gone = _gone(replacement, node)
    if gone:
        _move(replacement, "cancel", actor=actor, detail=gone, node=node)
        disruption.clear_blocked(node)
        return
    if replacement.reason == "drift" and (upgrade := upgrade_active(replacement.pool_id)) is not None:
        _note(replacement, f"suspended: upgrade {upgrade.pk} of the pool is {upgrade.state} and owns the roll")
        return
    if node.lifecycle != Lifecycle.READY:
        _note(replacement, f"waiting: the node is {node.lifecycle}")
        return
    if replacement.not_before and now < replacement.not_before:
        return
    verdict = disruption.request_disruption(
        node=node, reason=replacement.reason, owner=replacement.owner, now=now, record=False
    )
    forced = False
    if not verdict.allowed:
        if replacement.force_at is None or now < replacement.force_at:
            # Recorded after this transaction commits: a refusal must survive whatever follows.
            blocked = disruption.DisruptionBlocked(verdict, node=node, owner=replacement.owner, now=now)
            after_commit.insert(0, blocked.record)
            _note(replacement, f"waiting: {verdict.describe()}")
            return
        forced = True
        replacement.forced, replacement.overrode = True, verdict.blocker
    ops = PoolOperations.objects.get(pool_id=replacement.pool_id)
    why = replacement.detail or replacement.reason
    overrode = f"; forced after termination_grace, overriding {verdict.describe()}" if forced else ""
    replacement.started_at = replacement.started_at or now
    if autoscaled(ops, node):
        holds.place_hold(node, replacement.owner, f"{replacement.reason}: {why}", actor=actor,
                         expected_version=node.version, now=now)  # fmt: skip
        replacement.attempt += 1
        _move(replacement, "launch", actor=actor, detail=f"cordoned; replacement requested{overrode}", node=node,
              attempt=replacement.attempt, overrode=replacement.overrode)  # fmt: skip
        after_commit.append(lambda: _request_machine(replacement, actor=actor, now=now))
    else:
        drain = outofservice.take_out_of_service(
            node=node, owner=replacement.owner, reason=f"{replacement.reason}: {why}", policy=ops.drain_policy,
            timeout=ops.drain_timeout, now=now,
        )  # fmt: skip
        replacement.drain_id = drain.pk
        _move(replacement, "drain", actor=actor, detail=f"draining, then re-admitted{overrode}", node=node,
              drain_id=str(drain.pk), overrode=replacement.overrode)  # fmt: skip
    disruption.clear_blocked(node)


def _request_machine(replacement: NodeReplacement, *, actor: Actor, now) -> None:
    try:
        launches.request_extra(
            pool_id=replacement.pool_id,
            count=1,
            why=f"replacement for a node's {replacement.reason}: {{count}} node(s)",
            key={"replacement": replacement.key},
            actor=Actor.system(outofservice.AUTOSCALER),
            now=now,
            leaving=[replacement.node_id],
        )
    except Exception:
        # The machine rows say what happened; the launching step sees no machine and relaunches.
        logger.exception("replacement %s: the provider request failed", replacement.pk)


def _launching(replacement: NodeReplacement, node: Node, *, actor: Actor, now, after_commit: list) -> None:
    gone = _gone(replacement, node)
    if gone:
        _lift_hold(node, replacement, actor=actor, why=gone)
        _move(replacement, "cancel", actor=actor, detail=gone, node=node)
        return
    machines = list(
        ProviderMachine.objects.filter(decision__data__replacement=replacement.key).values_list("state", flat=True)
    )
    if MachineState.READY in machines:
        ops = PoolOperations.objects.get(pool_id=replacement.pool_id)
        drain = drains.start_drain(
            node_id=node.pk, expected_version=node.version, policy=ops.drain_policy,
            deadline=now + timedelta(seconds=ops.drain_timeout), reason=f"{replacement.owner}: {replacement.reason}",
            actor=actor, now=now,
        )  # fmt: skip
        replacement.drain_id = drain.pk
        _move(replacement, "drain", actor=actor, detail="replacement ready; draining", node=node,
              drain_id=str(drain.pk))  # fmt: skip
        return
    if any(state in (MachineState.REQUESTED, MachineState.ENROLLED) for state in machines):
        _note(replacement, "cordoned; waiting for the replacement to be ready")
        return
    # Every machine asked for failed, or none could be asked (at max_nodes, provider gone): lift
    # the cordon and try again later, backing off (Karpenter un-taints and starts over too).
    why = "the replacement did not come up" if machines else "no replacement could be requested"
    held = _held_back(replacement)
    _lift_hold(node, replacement, actor=actor, why=why)
    replacement.not_before = now + timedelta(seconds=min(3600, RETRY_SECONDS * 2 ** min(replacement.attempt, 8)))
    _move(replacement, "relaunch", actor=actor, detail=f"{why}{': ' + held if held else ''}; uncordoned, retrying",
          node=node)  # fmt: skip


def _held_back(replacement: NodeReplacement) -> str:
    decision = ScaleDecision.objects.filter(data__replacement=replacement.key, outcome="blocked").first()
    return decision.reason if decision else ""


def _draining(replacement: NodeReplacement, node: Node, *, actor: Actor, now, after_commit: list) -> None:
    if node.lifecycle == Lifecycle.RETIRED:
        _move(replacement, "finish", actor=actor, detail="machine deleted, node retired", node=node)
        return
    drain = Drain.objects.filter(pk=replacement.drain_id).first() if replacement.drain_id else None
    if node.lifecycle == Lifecycle.DRAINING and drain is not None and drain.state == DrainState.ACTIVE:
        drains.evaluate_drain(drain_id=drain.pk, actor=actor, now=now)
        node = Node.objects.get(pk=node.pk)
        drain.refresh_from_db()
    if node.lifecycle == Lifecycle.DRAINING:
        _note(replacement, "draining")
        return
    machine = ProviderMachine.objects.filter(node=node).exclude(state__in=[MachineState.DELETED]).first()
    if node.lifecycle == Lifecycle.MAINTENANCE:
        if machine is not None and replacement.attempt:
            # The new machine is ready: delete the old one through the provider (after commit: no
            # lock is held during the provider call) and retire its node.
            after_commit.append(lambda: _remove_machine(node, replacement, actor=actor))
            _note(replacement, "drained; deleting the machine")
            return
        outofservice.return_to_service(node=node, owner=replacement.owner, reason=f"{replacement.reason}: re-admitted")
        _note(replacement, "drained; re-admitting")
        return
    if node.lifecycle in (Lifecycle.PENDING, Lifecycle.ADMITTING):
        _note(replacement, "re-admitting")
        return
    if (
        node.lifecycle == Lifecycle.READY
        and drain is not None
        and drain.state in (DrainState.COMPLETED, DrainState.FORCED)
    ):
        _move(replacement, "finish", actor=actor, detail="re-admitted at the pool's shape", node=node)
        return
    if node.lifecycle == Lifecycle.REJECTED:
        _move(replacement, "fail", actor=actor, detail=f"re-admission refused: {node.lifecycle_reason}", node=node)
        return
    # The drain was cancelled or aborted by someone else: lift this replacement's hold, say so.
    _lift_hold(node, replacement, actor=actor, why="the drain ended otherwise")
    _move(replacement, "fail", actor=actor, detail=f"the drain ended otherwise (node {node.lifecycle})", node=node)


def _remove_machine(node: Node, replacement: NodeReplacement, *, actor: Actor) -> None:
    try:
        machines.remove_machine_of(node, actor=actor, reason=f"{replacement.reason}: replaced")
    except Exception:
        logger.exception("replacement %s: deleting the old machine failed", replacement.pk)
