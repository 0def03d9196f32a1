"""Drains: move a node's work off by a deadline, within disruption budgets, then park it in maintenance.

A drain is evaluated (:func:`evaluate_drain`) when it starts, by a Celery task at its deadline,
and by a beat sweep over every active drain (the safety net for a task that fires late, twice or
never). Each evaluation, under the node's row lock:

1. ends the leases whose workloads reported ``checkpointed`` after this drain asked them to;
2. applies the eviction policy to what is left, within the disruption budgets
   (``wait``: nothing; ``checkpoint``: set ``Lease.checkpoint_requested_at``, which the heartbeat
   response turns into a checkpoint instruction; ``terminate``: revoke now);
3. records progress: leases remaining, those at risk (their ``expires_at`` falls after the
   deadline), and what the drain waits on and why;
4. completes the drain when every lease on the node is terminal **and the node no longer
   reports any of them** (rule below) → node ``maintenance``, never ``ready``.

At or after the deadline the evaluation instead *enforces*: it claims the drain with a
compare-and-swap (``Drain.force``: ``state=active, deadline<=now`` → ``forced``) and, only if the claim won,
revokes every live lease (fenced) and moves the node to maintenance. A second, late or duplicate
timer finds the drain no longer active and does nothing: enforcement happens exactly once.

**"No longer reported" rule** (agreed with the heartbeat and leases apps): a status report stamps
``Node.last_status_report_at`` with its receipt time, and reconciliation stamps
``Lease.last_reported_at`` with a time at or after it for every lease id the report lists
(live or not); a report that lists leases commits both in one transaction, so no evaluation sees
the node's stamp without the leases'. A terminal lease is *unconfirmed* while
``ended_at >= node.last_status_report_at`` (no report since it ended) or
``last_reported_at >= node.last_status_report_at`` (the latest report still listed it). A renewal
(``last_heartbeat_at`` only) says nothing about leases and confirms none gone
(:func:`maintenance.progress.last_lease_report_at`). A node that has never reported reports nothing.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db import transaction
from django.db.models import F
from django.utils import timezone
from django_fsm import can_proceed

from fleet import clock
from fleet.events import Actor, record_event
from fleet.instructions import Instruction, post_instructions
from fleet.models import Node
from leases import fencing as lease_fencing
from leases import reconcile as lease_reconcile
from leases.choices import LIVE_LEASE_STATES
from leases.models import Lease
from nodepool import fsm, metrics
from nodepool.api.problems import Conflict, NotFound
from nodepool.api.versioning import check_version
from nodepool.celery import app as celery_app

from . import event_types
from .budgets import overridden_budgets, ration, record_evictions, statuses_for_groups
from .choices import DrainState, EvictionKind, EvictionPolicy
from .errors import DRAIN_ACTIVE, DRAIN_NOT_ACTIVE, DRAIN_NOT_FOUND
from .holds import drain_owner, owner_for, place_hold, remove_holds_where
from .models import Drain, Eviction
from .progress import (
    PROGRESS_LIST_LIMIT,
    answered_checkpoint,
    build_progress,
    checkpoint_requests,
    live_leases,
    unconfirmed_leases,
    validate_deadline,
)
from .services import apply_transition, lock_node, record_transition, save_transition

logger = logging.getLogger(__name__)


def _user(actor: Actor):
    user = actor.user
    return user if user is not None and getattr(user, "is_authenticated", False) else None


def _schedule_deadline(drain: Drain) -> None:
    """After commit, queue the deadline task with ``eta`` = deadline; the sweep covers its loss.

    Named, not imported: maintenance.tasks runs this module (no import cycle); the task is
    registered by the time this runs (maintenance.apps imports maintenance.tasks)."""
    drain_id, deadline = str(drain.pk), drain.deadline
    enforce = celery_app.signature("maintenance.enforce_drain_deadline", args=[drain_id])
    transaction.on_commit(
        lambda: enforce.apply_async(eta=deadline),
        robust=True,  # a broker outage must not fail the committed request; the sweep still runs
    )


def start_drain(
    *, node_id, expected_version: int, policy: str, deadline: datetime, reason: str, actor: Actor, now=None
) -> Drain:
    """ready → draining, and start moving the node's leases off under ``policy``.

    The drain places its own hold (owner ``drain:<id>``), so the node stays cordoned after the
    drain completes (maintenance) until it returns to service, and other actors' holds are left
    alone; cancelling the drain removes only the drain's hold.

    Args:
        policy: an :class:`EvictionPolicy` value.
        deadline: aware datetime in the future; at it the remaining leases are revoked.

    Raises: NotFound (404), Unprocessable (422), PreconditionFailed (412),
    Conflict (409 ``transition_not_allowed``).
    """
    now = now or timezone.now()
    validate_deadline(deadline, now=now)
    with transaction.atomic():
        node = lock_node(node_id)
        check_version(node.version, expected_version)
        from_state = apply_transition(node, "drain", action="drain", reason=reason, now=now)
        save_transition(node)
        leases = Lease.objects.filter(node=node, state__in=LIVE_LEASE_STATES).count()
        drain = Drain.objects.create(
            node=node,
            policy=policy,
            reason=reason,
            deadline=deadline,
            requested_by=_user(actor),
            requested_by_name=actor.name[:150],
            created_at=now,
            leases_at_start=leases,
            leases_remaining=leases,
        )
        data = {"action": "drain", "drain_id": str(drain.pk), "policy": policy, "deadline": deadline.isoformat()}
        record_transition(node, actor, from_state=from_state, reason=reason, data=data)
        place_hold(node, drain_owner(drain.pk), f"drain: {reason}", actor=actor, bump_version=False, now=now)
        record_event(
            node, event_types.DRAIN, actor, to_state=DrainState.ACTIVE, reason=reason, data={**data, "leases": leases}
        )
        _evaluate(drain, node, actor=actor, now=now)
        _schedule_deadline(drain)
    drain.refresh_from_db()
    return drain


def _lock_drain(drain_id) -> tuple[Drain, Node]:
    """Lock the drain's node then the drain (always this order, as every drain path does)."""
    node_id = Drain.objects.filter(pk=drain_id).values_list("node_id", flat=True).first()
    if node_id is None:
        raise NotFound(f"No drain {drain_id}.", DRAIN_NOT_FOUND)
    node = lock_node(node_id)
    return Drain.objects.select_for_update().get(pk=drain_id), node


def evaluate_drain(*, drain_id, actor: Actor, now=None) -> Drain:
    """Advance one drain: enforce it if its deadline has passed, else evict, record progress, maybe complete.

    Safe to call any number of times, concurrently, early or late. Raises NotFound (404).
    """
    now = now or timezone.now()
    with transaction.atomic():
        drain, node = _lock_drain(drain_id)
        if drain.state == DrainState.ACTIVE:
            if drain.deadline <= now:
                _enforce(drain, node, actor=actor, now=now)
            else:
                _evaluate(drain, node, actor=actor, now=now)
    drain.refresh_from_db()
    return drain


def sweep_drains(*, actor: Actor, now=None, limit: int = 500) -> dict[str, int]:
    """Evaluate every active drain (earliest deadline first). One bad drain is logged and skipped.

    Returns ``{"evaluated", "completed", "forced", "failed"}``.
    """
    now = now or timezone.now()
    # A clock jump or outage since the last sweep moves deadlines first, so it forces no drain.
    clock.observe(now=now, actor=actor)
    ids = list(Drain.objects.filter(state=DrainState.ACTIVE).order_by("deadline").values_list("pk", flat=True)[:limit])
    counts = {"evaluated": 0, "completed": 0, "forced": 0, "failed": 0}
    for drain_id in ids:
        try:
            drain = evaluate_drain(drain_id=drain_id, actor=actor, now=now)
        except Exception:
            logger.exception("drain %s could not be evaluated; the next sweep tries again", drain_id)
            counts["failed"] += 1
            continue
        counts["evaluated"] += 1
        if drain.state in (DrainState.COMPLETED, DrainState.FORCED):
            counts[drain.state] += 1
    return counts


def _evaluate(drain: Drain, node: Node, *, actor: Actor, now) -> None:
    """One evaluation before the deadline (node and drain locked, drain active)."""
    live = live_leases(node, lock=True)
    asked = checkpoint_requests(drain)
    ended = {
        lease.pk
        for lease in live
        if lease.pk in asked
        and answered_checkpoint(lease)
        and lease_reconcile.revoke_lease(lease, actor=actor, reason="workload checkpointed for drain", now=now)
    }
    live = [lease for lease in live if lease.pk not in ended]

    if drain.policy == EvictionPolicy.TERMINATE:
        allowed, held, budgets = ration(live, now=now, lock=True)
        revoked = [
            lease
            for lease in allowed
            if lease_reconcile.revoke_lease(lease, actor=actor, reason=f"drain (terminate): {drain.reason}", now=now)
        ]
        record_evictions(drain, revoked, EvictionKind.TERMINATE, now)
    elif drain.policy == EvictionPolicy.CHECKPOINT:
        allowed, held, budgets = ration([lease for lease in live if lease.pk not in asked], now=now, lock=True)
        if allowed:
            # The heartbeat response turns checkpoint_requested_at into a checkpoint instruction.
            Lease.objects.filter(pk__in=[lease.pk for lease in allowed], state__in=LIVE_LEASE_STATES).update(
                checkpoint_requested_at=now, version=F("version") + 1
            )
            lease_fencing.record_checkpoint_requests(allowed, actor=actor, now=now)
            post_instructions([node.pk], Instruction.CHECKPOINT)
            record_evictions(drain, allowed, EvictionKind.CHECKPOINT, now)
            record_event(
                node,
                event_types.DRAIN,
                actor,
                reason="checkpoint requested",
                data={"drain_id": str(drain.pk), "checkpoint_leases": [str(lease.pk) for lease in allowed]},
            )
    else:
        # The wait policy disrupts nothing before the deadline; budgets are shown, never spent.
        _, _, budgets = ration(live, now=now, lock=False)
        held = {}

    live = live_leases(node, lock=False)
    # Statuses after this evaluation's evictions, so the snapshot shows what is left to spend.
    budgets = statuses_for_groups([status["group"] for status in budgets], now=now)
    unconfirmed = unconfirmed_leases(node)
    checkpointing = checkpoint_requests(drain)
    progress = build_progress(
        drain,
        node,
        live=live,
        checkpointing=[lease for lease in live if lease.pk in checkpointing],
        unconfirmed=unconfirmed,
        held=held,
        budgets=budgets,
        now=now,
    )
    if not live and not unconfirmed:
        _complete(drain, node, actor=actor, now=now, progress=progress)
        return
    before = {item["code"] for item in (drain.progress or {}).get("waiting_on", [])}
    after = {item["code"] for item in progress["waiting_on"]}
    Drain.objects.filter(pk=drain.pk).update(progress=progress, progress_at=now, leases_remaining=len(live))
    if before != after:
        # One event per change of what the drain waits on, not one per sweep.
        record_event(
            node,
            event_types.DRAIN,
            actor,
            reason="waiting on: " + (", ".join(sorted(after)) or "nothing"),
            data={"drain_id": str(drain.pk), "waiting_on": progress["waiting_on"]},
        )


def _enforce(drain: Drain, node: Node, *, actor: Actor, now) -> bool:
    """At or after the deadline: claim the drain (CAS), revoke what is left, complete as forced."""
    live = live_leases(node, lock=True)
    claimed = fsm.move(
        Drain.objects.filter(pk=drain.pk, deadline__lte=now),
        "force",
        finished_at=now,
        finish_reason="deadline reached",
        version=F("version") + 1,
    )
    if not claimed:
        return False
    overrode = overridden_budgets(live, now=now)
    revoked = [
        lease
        for lease in live
        if lease_reconcile.revoke_lease(lease, actor=actor, reason=f"drain deadline reached: {drain.reason}", now=now)
    ]
    record_evictions(drain, revoked, EvictionKind.DEADLINE, now)
    progress = {
        **(drain.progress or {}),
        "evaluated_at": now.isoformat(),
        "leases_remaining": 0,
        "forced": {"revoked_lease_ids": [str(lease.pk) for lease in revoked][:PROGRESS_LIST_LIMIT]},
        "waiting_on": [],
    }
    Drain.objects.filter(pk=drain.pk).update(progress=progress, progress_at=now, leases_remaining=0)
    record_event(
        node,
        event_types.DRAIN,
        actor,
        from_state=DrainState.ACTIVE,
        to_state=DrainState.FORCED,
        reason="deadline reached"
        + (
            "; overrode the disruption budget of "
            + ", ".join(f"group {o['group']!r} (allowed {o['allowed']}, evicted {o['evicted']})" for o in overrode)
            if overrode
            else ""
        ),
        data={
            "drain_id": str(drain.pk),
            "leases_revoked": len(revoked),
            "deadline": drain.deadline.isoformat(),
            "overrode_budgets": overrode,
        },
    )
    _park_node(node, actor=actor, now=now, reason=f"drain forced at its deadline: {drain.reason}")
    _observe_duration(drain, node, now)
    return True


def _complete(drain: Drain, node: Node, *, actor: Actor, now, progress: dict) -> bool:
    claimed = fsm.move(
        Drain.objects.filter(pk=drain.pk),
        "complete",
        finished_at=now,
        finish_reason="every lease ended and the node no longer reports any",
        progress=progress,
        progress_at=now,
        leases_remaining=0,
        version=F("version") + 1,
    )
    if not claimed:
        return False
    record_event(
        node,
        event_types.DRAIN,
        actor,
        from_state=DrainState.ACTIVE,
        to_state=DrainState.COMPLETED,
        reason="drain completed",
        data={"drain_id": str(drain.pk)},
    )
    _park_node(node, actor=actor, now=now, reason=f"drained: {drain.reason}")
    _observe_duration(drain, node, now)
    return True


def _observe_duration(drain: Drain, node: Node, now) -> None:
    seconds = max(0.0, (now - drain.created_at).total_seconds())
    pool = node.pool.name
    transaction.on_commit(lambda: metrics.DRAIN_SECONDS.labels(pool).observe(seconds))


def _park_node(node: Node, *, actor: Actor, now, reason: str) -> None:
    """draining → maintenance (never ready: return-to-service runs admission again)."""
    if not can_proceed(node.complete_drain):
        logger.warning("drain of %s finished but the node is %s, not draining", node.pk, node.lifecycle)
        return
    from_state = apply_transition(node, "complete_drain", action="complete-drain", reason=reason, now=now)
    save_transition(node)
    record_transition(node, actor, from_state=from_state, reason=reason, data={"action": "complete-drain"})


def cancel_drain(*, drain_id, expected_version: int, reason: str, actor: Actor, now=None) -> Drain:
    """Cancel an active drain: node draining → ready with the drain's hold removed; pending
    checkpoint requests withdrawn. Any other actor's hold stays, so a node cordoned before the
    drain is still cordoned after it.

    ``expected_version`` is the drain's. Raises: NotFound (404), PreconditionFailed (412),
    Conflict (409 ``drain_not_active`` or ``transition_not_allowed``).
    """
    now = now or timezone.now()
    with transaction.atomic():
        drain, node = _lock_drain(drain_id)
        check_version(drain.version, expected_version)
        if drain.state != DrainState.ACTIVE:
            raise Conflict(f"The drain is {drain.state}, not active.", DRAIN_NOT_ACTIVE, state=drain.state)
        from_state = apply_transition(node, "cancel_drain", action="cancel-drain", reason=reason, now=now)
        save_transition(node)
        fsm.move(
            Drain.objects.filter(pk=drain.pk), "cancel", finished_at=now, finish_reason=reason, version=F("version") + 1
        )
        requested = Eviction.objects.filter(
            drain=drain, kind=EvictionKind.CHECKPOINT, withdrawn_at__isnull=True, lease__state__in=LIVE_LEASE_STATES
        )
        requested_ids = list(requested.values_list("lease_id", flat=True))
        withdrawn = Lease.objects.filter(pk__in=requested_ids).update(
            checkpoint_requested_at=None, version=F("version") + 1
        )
        lease_fencing.withdraw_checkpoint_requests(requested_ids)
        # Withdrawn requests no longer count against disruption budgets.
        requested.update(withdrawn_at=now)
        remove_holds_where(node, owner=drain_owner(drain.pk), actor=actor, reason=f"drain cancelled: {reason}", now=now)
        data = {"action": "cancel-drain", "drain_id": str(drain.pk), "checkpoints_withdrawn": withdrawn}
        record_transition(node, actor, from_state=from_state, reason=reason, data=data)
        record_event(
            node,
            event_types.DRAIN,
            actor,
            from_state=DrainState.ACTIVE,
            to_state=DrainState.CANCELLED,
            reason=reason,
            data=data,
        )
    drain.refresh_from_db()
    return drain


def repair_stuck_drain(*, node_id, expected_version: int, reason: str, actor: Actor, now=None) -> Node:
    """Repair a node left ``draining`` with no active drain (an operator's recorded repair).

    Such a node cannot be cancelled (``cancel-drain`` needs the drain) and would never complete.
    The repair moves it ``draining → ready`` and puts the repairing operator's own hold on it, so
    it takes no new work until that operator uncordons it; holds of drains that are no longer
    active go. A node whose drain is still active is refused (409 ``drain_active``: cancel that
    drain instead). Recorded as a ``lifecycle`` event with ``data.action = "repair-drain"``.

    Raises: NotFound (404), PreconditionFailed (412), Conflict (409 ``transition_not_allowed`` /
    ``drain_active``).
    """
    now = now or timezone.now()
    with transaction.atomic():
        node = lock_node(node_id)
        check_version(node.version, expected_version)
        active = Drain.objects.filter(node=node, state=DrainState.ACTIVE).first()
        if active is not None:
            raise Conflict(
                f"The node's drain {active.pk} is active: cancel it instead (POST /api/v1/drains/{active.pk}/cancel).",
                DRAIN_ACTIVE,
                drain_id=str(active.pk),
            )
        from_state = apply_transition(node, "cancel_drain", action="repair-drain", reason=reason, now=now)
        save_transition(node)
        stale = [
            owner
            for owner in node.holds.filter(removed_at__isnull=True, owner__startswith="drain:").values_list(
                "owner", flat=True
            )
        ]
        for owner in stale:
            remove_holds_where(node, owner=owner, actor=actor, reason=f"stuck drain repaired: {reason}", now=now)
        place_hold(node, owner_for(actor), f"repaired stuck drain: {reason}", actor=actor, bump_version=False, now=now)
        record_transition(
            node,
            actor,
            from_state=from_state,
            reason=reason,
            data={"action": "repair-drain", "removed_drain_holds": stale, "hold_owner": owner_for(actor)},
        )
    return Node.objects.get(pk=node.pk)


def change_drain_deadline(
    *, drain_id, expected_version: int, deadline: datetime, reason: str, actor: Actor, now=None
) -> Drain:
    """Move an active drain's deadline (earlier or later); a new deadline task is queued.

    The old task still fires at the old time and finds the deadline not yet due (its claim
    requires ``deadline <= now``), so it changes nothing. Raises as :func:`cancel_drain`, plus 422.
    """
    now = now or timezone.now()
    validate_deadline(deadline, now=now)
    with transaction.atomic():
        drain, node = _lock_drain(drain_id)
        check_version(drain.version, expected_version)
        if drain.state != DrainState.ACTIVE:
            raise Conflict(f"The drain is {drain.state}, not active.", DRAIN_NOT_ACTIVE, state=drain.state)
        previous = drain.deadline
        Drain.objects.filter(pk=drain.pk).update(deadline=deadline, version=F("version") + 1)
        record_event(
            node,
            event_types.DRAIN,
            actor,
            reason=reason,
            data={
                "drain_id": str(drain.pk),
                "deadline": deadline.isoformat(),
                "previous_deadline": previous.isoformat(),
            },
        )
        drain.refresh_from_db()
        _schedule_deadline(drain)
    return drain
