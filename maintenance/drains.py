"""Drains: move a node's work off by a deadline, within disruption budgets, then park it in maintenance.

A drain is evaluated (:func:`evaluate_drain`) when it starts, by a Celery task at its deadline,
and by a beat sweep over every active drain (the safety net for a task that fires late, twice or
never). Each evaluation, under the node's row lock:

1. ends the leases whose workloads reported ``checkpointed`` after a checkpoint request;
2. applies the eviction policy to what is left, within the disruption budgets
   (``wait``: nothing; ``checkpoint``: set ``Lease.checkpoint_requested_at``, which the heartbeat
   response turns into a checkpoint instruction; ``terminate``: revoke now);
3. records progress: leases remaining, those at risk (their ``expires_at`` falls after the
   deadline), and what the drain waits on and why;
4. completes the drain when every lease on the node is terminal **and the node no longer
   reports any of them** (rule below) → node ``maintenance``, never ``ready``.

At or after the deadline the evaluation instead *enforces*: it claims the drain with a
compare-and-swap (``state=active, deadline<=now`` → ``forced``) and, only if the claim won,
revokes every live lease (fenced) and moves the node to maintenance. A second, late or duplicate
timer finds the drain no longer active and does nothing: enforcement happens exactly once.

**"No longer reported" rule** (agreed with the heartbeat and leases apps): the heartbeat stamps
``Node.last_heartbeat_at`` with its receipt time, and reconciliation stamps
``Lease.last_reported_at`` with a time at or after it for every lease id the heartbeat lists
(live or not). A terminal lease is *unconfirmed* while ``ended_at >= node.last_heartbeat_at``
(no heartbeat since it ended) or ``last_reported_at >= node.last_heartbeat_at`` (the latest
heartbeat still listed it). A node that has never sent a heartbeat reports nothing.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone
from django_fsm import can_proceed

from fleet.choices import NodeEventType
from fleet.events import Actor, record_event
from fleet.models import Node
from leases import services as lease_services
from leases.choices import LIVE_LEASE_STATES, WorkloadState
from leases.models import Lease
from nodepool.api.problems import Conflict, NotFound, Unprocessable
from nodepool.api.versioning import check_version

from . import conf
from .budgets import ration, statuses_for_groups
from .choices import DrainState, EvictionKind, EvictionPolicy, WaitingOn
from .models import Drain, Eviction
from .services import apply_transition, lock_node, save_transition, transition_refused

logger = logging.getLogger(__name__)

PROGRESS_LIST_LIMIT = 100


def validate_deadline(deadline: datetime, *, now) -> None:
    """Raises Unprocessable (422 ``deadline_in_past`` / ``deadline_too_far``)."""
    if deadline <= now:
        raise Unprocessable("The drain deadline must be in the future.", "deadline_in_past")
    limit = conf.get("DRAIN_MAX_DURATION")
    if deadline > now + timedelta(seconds=limit):
        raise Unprocessable(f"The drain deadline may be at most {limit} seconds away.", "deadline_too_far")


def _user(actor: Actor):
    user = actor.user
    return user if user is not None and getattr(user, "is_authenticated", False) else None


def _schedule_deadline(drain: Drain) -> None:
    """After commit, queue the deadline task with ``eta`` = deadline; the sweep covers its loss."""
    from . import tasks

    drain_id, deadline = str(drain.pk), drain.deadline
    transaction.on_commit(
        lambda: tasks.enforce_drain_deadline.apply_async(args=[drain_id], eta=deadline),
        robust=True,  # a broker outage must not fail the committed request; the sweep still runs
    )


def start_drain(
    *, node_id, expected_version: int, policy: str, deadline: datetime, reason: str, actor: Actor, now=None
) -> Drain:
    """ready | cordoned → draining, and start moving the node's leases off under ``policy``.

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
        record_event(
            node,
            NodeEventType.LIFECYCLE,
            actor,
            from_state=from_state,
            to_state=node.lifecycle,
            reason=reason,
            data=data,
        )
        record_event(
            node, NodeEventType.DRAIN, actor, to_state=DrainState.ACTIVE, reason=reason, data={**data, "leases": leases}
        )
        _evaluate(drain, node, actor=actor, now=now)
        _schedule_deadline(drain)
    drain.refresh_from_db()
    return drain


def _lock_drain(drain_id) -> tuple[Drain, Node]:
    """Lock the drain's node then the drain (always this order, as every drain path does)."""
    node_id = Drain.objects.filter(pk=drain_id).values_list("node_id", flat=True).first()
    if node_id is None:
        raise NotFound(f"No drain {drain_id}.", "drain_not_found")
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


def _live_leases(node: Node, *, lock: bool) -> list[Lease]:
    qs = Lease.objects.filter(node=node, state__in=LIVE_LEASE_STATES).order_by("granted_at", "pk")
    return list(qs.select_for_update() if lock else qs)


def unconfirmed_leases(node: Node) -> list[Lease]:
    """Terminal leases on ``node`` that the node may still be running (see the module's rule)."""
    heard = node.last_heartbeat_at
    if heard is None:
        return []
    qs = Lease.objects.filter(node=node).exclude(state__in=LIVE_LEASE_STATES)
    return list(qs.filter(Q(ended_at__gte=heard) | Q(last_reported_at__gte=heard)).order_by("ended_at", "pk"))


def _record_evictions(drain: Drain, leases: list[Lease], kind: str, now) -> None:
    Eviction.objects.bulk_create(
        Eviction(
            drain=drain,
            lease=lease,
            workload_id=lease.workload_id,
            group=lease.group,
            fencing_token=lease.fencing_token,
            kind=kind,
            created_at=now,
        )
        for lease in leases
    )


def _evaluate(drain: Drain, node: Node, *, actor: Actor, now) -> None:
    """One evaluation before the deadline (node and drain locked, drain active)."""
    live = _live_leases(node, lock=True)
    for lease in live:
        if lease.checkpoint_requested_at is not None and lease.workload_state == WorkloadState.CHECKPOINTED:
            lease_services.revoke_lease(lease, actor=actor, reason="workload checkpointed for drain", now=now)
    live = [lease for lease in live if lease.state in LIVE_LEASE_STATES]

    if drain.policy == EvictionPolicy.TERMINATE:
        allowed, held, budgets = ration(live, now=now, lock=True)
        revoked = [
            lease
            for lease in allowed
            if lease_services.revoke_lease(lease, actor=actor, reason=f"drain (terminate): {drain.reason}", now=now)
        ]
        _record_evictions(drain, revoked, EvictionKind.TERMINATE, now)
    elif drain.policy == EvictionPolicy.CHECKPOINT:
        waiting = [lease for lease in live if lease.checkpoint_requested_at is None]
        allowed, held, budgets = ration(waiting, now=now, lock=True)
        if allowed:
            Lease.objects.filter(
                pk__in=[lease.pk for lease in allowed],
                state__in=LIVE_LEASE_STATES,
                checkpoint_requested_at__isnull=True,
            ).update(checkpoint_requested_at=now, version=F("version") + 1)
            _record_evictions(drain, allowed, EvictionKind.CHECKPOINT, now)
            record_event(
                node,
                NodeEventType.DRAIN,
                actor,
                reason="checkpoint requested",
                data={"drain_id": str(drain.pk), "checkpoint_leases": [str(lease.pk) for lease in allowed]},
            )
    else:
        # The wait policy disrupts nothing before the deadline; budgets are shown, never spent.
        _, _, budgets = ration(live, now=now, lock=False)
        held = {}

    live = _live_leases(node, lock=False)
    # Statuses after this evaluation's evictions, so the snapshot shows what is left to spend.
    budgets = statuses_for_groups([status["group"] for status in budgets], now=now)
    unconfirmed = unconfirmed_leases(node)
    progress = build_progress(drain, node, live=live, unconfirmed=unconfirmed, held=held, budgets=budgets, now=now)
    if not live and not unconfirmed:
        _finish(drain, node, state=DrainState.COMPLETED, actor=actor, now=now, progress=progress)
        return
    before = {item["code"] for item in (drain.progress or {}).get("waiting_on", [])}
    after = {item["code"] for item in progress["waiting_on"]}
    Drain.objects.filter(pk=drain.pk).update(progress=progress, progress_at=now, leases_remaining=len(live))
    if before != after:
        # One event per change of what the drain waits on, not one per sweep.
        record_event(
            node,
            NodeEventType.DRAIN,
            actor,
            reason="waiting on: " + (", ".join(sorted(after)) or "nothing"),
            data={"drain_id": str(drain.pk), "waiting_on": progress["waiting_on"]},
        )


def _enforce(drain: Drain, node: Node, *, actor: Actor, now) -> bool:
    """At or after the deadline: claim the drain (CAS), revoke what is left, complete as forced."""
    live = _live_leases(node, lock=True)
    claimed = Drain.objects.filter(pk=drain.pk, state=DrainState.ACTIVE, deadline__lte=now).update(
        state=DrainState.FORCED, finished_at=now, finish_reason="deadline reached", version=F("version") + 1
    )
    if not claimed:
        return False
    revoked = [
        lease
        for lease in live
        if lease_services.revoke_lease(lease, actor=actor, reason=f"drain deadline reached: {drain.reason}", now=now)
    ]
    _record_evictions(drain, revoked, EvictionKind.DEADLINE, now)
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
        NodeEventType.DRAIN,
        actor,
        from_state=DrainState.ACTIVE,
        to_state=DrainState.FORCED,
        reason="deadline reached",
        data={"drain_id": str(drain.pk), "leases_revoked": len(revoked), "deadline": drain.deadline.isoformat()},
    )
    _park_node(node, actor=actor, now=now, reason=f"drain forced at its deadline: {drain.reason}")
    return True


def _finish(drain: Drain, node: Node, *, state: str, actor: Actor, now, progress: dict) -> bool:
    claimed = Drain.objects.filter(pk=drain.pk, state=DrainState.ACTIVE).update(
        state=state,
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
        NodeEventType.DRAIN,
        actor,
        from_state=DrainState.ACTIVE,
        to_state=state,
        reason="drain completed",
        data={"drain_id": str(drain.pk)},
    )
    _park_node(node, actor=actor, now=now, reason=f"drained: {drain.reason}")
    return True


def _park_node(node: Node, *, actor: Actor, now, reason: str) -> None:
    """draining → maintenance (never ready: return-to-service runs admission again)."""
    if not can_proceed(node.complete_drain):
        logger.warning("drain of %s finished but the node is %s, not draining", node.pk, node.lifecycle)
        return
    from_state = apply_transition(node, "complete_drain", action="complete-drain", reason=reason, now=now)
    save_transition(node)
    record_event(
        node,
        NodeEventType.LIFECYCLE,
        actor,
        from_state=from_state,
        to_state=node.lifecycle,
        reason=reason,
        data={"action": "complete-drain"},
    )


def _lease_summary(lease: Lease, deadline) -> dict:
    return {
        "lease_id": str(lease.pk),
        "workload_id": lease.workload_id,
        "group": lease.group,
        "state": lease.state,
        "workload_state": lease.workload_state,
        "expires_at": lease.expires_at.isoformat() if lease.expires_at else None,
        "checkpoint_requested_at": (
            lease.checkpoint_requested_at.isoformat() if lease.checkpoint_requested_at else None
        ),
        "at_risk": bool(lease.expires_at and lease.expires_at > deadline),
    }


def build_progress(
    drain: Drain,
    node: Node,
    *,
    live: list[Lease],
    unconfirmed: list[Lease],
    held: dict[str, list[Lease]],
    budgets: list[dict],
    now,
) -> dict:
    """The progress snapshot stored on the drain (shape in :class:`maintenance.models.Drain`)."""
    deadline = drain.deadline.isoformat()
    at_risk = [lease for lease in live if lease.expires_at and lease.expires_at > drain.deadline]
    waiting: list[dict] = []
    ids = lambda leases: [str(lease.pk) for lease in leases][:PROGRESS_LIST_LIMIT]  # noqa: E731
    if live and drain.policy == EvictionPolicy.WAIT:
        waiting.append(
            {
                "code": WaitingOn.LEASES_RUNNING,
                "message": f"{len(live)} lease(s) still running; the wait policy lets them finish "
                f"({len(at_risk)} expire after the deadline {deadline} and will be revoked then).",
                "lease_ids": ids(live),
            }
        )
    checkpointing = [lease for lease in live if lease.checkpoint_requested_at is not None]
    if checkpointing:
        waiting.append(
            {
                "code": WaitingOn.CHECKPOINT_PENDING,
                "message": f"{len(checkpointing)} workload(s) were asked to checkpoint and have not reported "
                "'checkpointed' yet.",
                "lease_ids": ids(checkpointing),
            }
        )
    if held:
        blocked = [lease for leases in held.values() for lease in leases]
        waiting.append(
            {
                "code": WaitingOn.DISRUPTION_BUDGET,
                "message": f"The disruption budget of {', '.join(sorted(held))} allows no more disruptions now; "
                f"{len(blocked)} lease(s) wait for replacements elsewhere (until the deadline {deadline}).",
                "groups": sorted(held),
                "lease_ids": ids(blocked),
            }
        )
    heard = node.last_heartbeat_at
    # No heartbeat since the lease ended says more than "the last heartbeat listed it" (it was live then).
    unheard = [lease for lease in unconfirmed if heard is not None and lease.ended_at and lease.ended_at >= heard]
    reported = [lease for lease in unconfirmed if lease not in unheard]
    if reported:
        waiting.append(
            {
                "code": WaitingOn.NODE_STILL_REPORTING,
                "message": f"The node's latest heartbeat still lists {len(reported)} ended lease(s); "
                "it has been told to stop them.",
                "lease_ids": ids(reported),
            }
        )
    if unheard:
        waiting.append(
            {
                "code": WaitingOn.NO_HEARTBEAT_SINCE_END,
                "message": f"No heartbeat since {len(unheard)} lease(s) ended; the next one confirms they stopped.",
                "lease_ids": ids(unheard),
            }
        )
    return {
        "evaluated_at": now.isoformat(),
        "leases_remaining": len(live),
        "remaining": [_lease_summary(lease, drain.deadline) for lease in live[:PROGRESS_LIST_LIMIT]],
        "at_risk": ids(at_risk),
        "unconfirmed": ids(unconfirmed),
        "waiting_on": waiting,
        "budgets": budgets,
    }


def cancel_drain(*, drain_id, expected_version: int, reason: str, actor: Actor, now=None) -> Drain:
    """Cancel an active drain: node draining → cordoned (never ready); pending checkpoint requests withdrawn.

    ``expected_version`` is the drain's. Raises: NotFound (404), PreconditionFailed (412),
    Conflict (409 ``drain_not_active`` or ``transition_not_allowed``).
    """
    now = now or timezone.now()
    with transaction.atomic():
        drain, node = _lock_drain(drain_id)
        check_version(drain.version, expected_version)
        if drain.state != DrainState.ACTIVE:
            raise Conflict(f"The drain is {drain.state}, not active.", "drain_not_active", state=drain.state)
        from_state = apply_transition(node, "cancel_drain", action="cancel-drain", reason=reason, now=now)
        save_transition(node)
        Drain.objects.filter(pk=drain.pk).update(
            state=DrainState.CANCELLED, finished_at=now, finish_reason=reason, version=F("version") + 1
        )
        withdrawn = Lease.objects.filter(
            node=node, state__in=LIVE_LEASE_STATES, checkpoint_requested_at__isnull=False
        ).update(checkpoint_requested_at=None, version=F("version") + 1)
        data = {"action": "cancel-drain", "drain_id": str(drain.pk), "checkpoints_withdrawn": withdrawn}
        record_event(
            node,
            NodeEventType.LIFECYCLE,
            actor,
            from_state=from_state,
            to_state=node.lifecycle,
            reason=reason,
            data=data,
        )
        record_event(
            node,
            NodeEventType.DRAIN,
            actor,
            from_state=DrainState.ACTIVE,
            to_state=DrainState.CANCELLED,
            reason=reason,
            data=data,
        )
    drain.refresh_from_db()
    return drain


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
            raise Conflict(f"The drain is {drain.state}, not active.", "drain_not_active", state=drain.state)
        previous = drain.deadline
        Drain.objects.filter(pk=drain.pk).update(deadline=deadline, version=F("version") + 1)
        record_event(
            node,
            NodeEventType.DRAIN,
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


def plan_drain(*, node_id, policy: str, deadline: datetime, expected_version: int | None = None, now=None) -> dict:
    """Dry run of :func:`start_drain`: change nothing, say what would happen.

    Returns ``{"dry_run": true, "node_id", "lifecycle", "allowed", "policy", "deadline",
    "leases": [{lease summary, "action", "placement": simulate_placement(...)}],
    "budgets": [{BudgetStatus, "leases_on_node", "blocks"}], "summary": {...}}``. Placement
    uses the leases app's ``simulate_placement`` (the same filters and scores as a real request),
    each lease on its own: leases that fit one at a time may not all fit together.

    Raises the same 404/412/409/422 as a real drain would (412 only when a version is given).
    """
    now = now or timezone.now()
    validate_deadline(deadline, now=now)
    try:
        node = Node.objects.get(pk=node_id)
    except (Node.DoesNotExist, ValueError) as exc:
        raise NotFound(f"No node {node_id}.", "node_not_found") from exc
    if expected_version is not None:
        check_version(node.version, expected_version)
    if not can_proceed(node.drain):
        raise transition_refused(node, "drain")
    live = _live_leases(node, lock=False)
    if policy == EvictionPolicy.WAIT:
        _, _, budgets = ration(live, now=now, lock=False)
        held: dict[str, list[Lease]] = {}
    else:
        _, held, budgets = ration(live, now=now, lock=False)
    held_ids = {lease.pk for leases in held.values() for lease in leases}
    action = {EvictionPolicy.WAIT: "wait", EvictionPolicy.CHECKPOINT: "checkpoint"}.get(policy, "revoke")
    entries = []
    for lease in live:
        placement = lease_services.simulate_placement(lease, exclude_node_ids=[node.pk])
        entry = _lease_summary(lease, deadline)
        entry.update(
            resources=lease.resources,
            action="blocked_by_budget" if lease.pk in held_ids else action,
            placement=placement,
        )
        entries.append(entry)
    on_node: dict[str, int] = {}
    for lease in live:
        on_node[lease.group] = on_node.get(lease.group, 0) + 1
    budgets = [
        {**status, "leases_on_node": on_node.get(status["group"], 0), "blocks": status["group"] in held}
        for status in budgets
    ]
    placeable = sum(1 for entry in entries if entry["placement"].get("placeable"))
    return {
        "dry_run": True,
        "node_id": str(node.pk),
        "lifecycle": node.lifecycle,
        "version": node.version,
        "allowed": True,
        "policy": policy,
        "deadline": deadline.isoformat(),
        "leases": entries,
        "budgets": budgets,
        "summary": {
            "leases": len(entries),
            "placeable_elsewhere": placeable,
            "unplaceable": len(entries) - placeable,
            "pool_can_take_all": placeable == len(entries),
            "at_risk": sum(1 for entry in entries if entry["at_risk"]),
            "blocked_by_budgets": len(held_ids),
            "would_complete_at_once": not entries and not unconfirmed_leases(node),
        },
    }
