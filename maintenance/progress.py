"""Drain progress and plans: what a drain has done and waits on, and what a drain would do (dry run).

Reads only; the writes are in :mod:`maintenance.drains`. The "no longer reported" rule that
:func:`unconfirmed_leases` applies is described there.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Q
from django.utils import timezone
from django_fsm import can_proceed

from fleet.errors import NODE_NOT_FOUND
from fleet.models import Node
from leases import reconcile as lease_reconcile
from leases.choices import LIVE_LEASE_STATES, WorkloadState
from leases.models import Lease
from nodepool.api.problems import NotFound, Unprocessable
from nodepool.api.versioning import check_version

from . import conf
from .budgets import ration
from .choices import EvictionKind, EvictionPolicy, WaitingOn
from .errors import DEADLINE_IN_PAST, DEADLINE_TOO_FAR
from .models import Drain, Eviction
from .services import transition_refused

PROGRESS_LIST_LIMIT = 100


def validate_deadline(deadline: datetime, *, now) -> None:
    """Raises Unprocessable (422 ``deadline_in_past`` / ``deadline_too_far``)."""
    if deadline <= now:
        raise Unprocessable("The drain deadline must be in the future.", DEADLINE_IN_PAST)
    limit = conf.get("DRAIN_MAX_DURATION")
    if deadline > now + timedelta(seconds=limit):
        raise Unprocessable(f"The drain deadline may be at most {limit} seconds away.", DEADLINE_TOO_FAR)


def live_leases(node: Node, *, lock: bool = False) -> list[Lease]:
    """Live leases on ``node``, oldest first; ``lock`` takes their row locks (inside a transaction)."""
    qs = Lease.objects.filter(node=node, state__in=LIVE_LEASE_STATES).order_by("granted_at", "pk")
    return list(qs.select_for_update(no_key=True) if lock else qs)


def last_lease_report_at(node: Node):
    """When ``node`` last said which leases it runs: its last status report. A renewal says
    nothing about leases, so its time (in ``last_heartbeat_at``) confirms no lease gone; a node
    that has not sent a status report since that field exists falls back to its last heartbeat."""
    return node.last_status_report_at or node.last_heartbeat_at


def unconfirmed_leases(node: Node) -> list[Lease]:
    """Terminal leases on ``node`` that the node may still be running (see the module's rule)."""
    heard = last_lease_report_at(node)
    if heard is None:
        return []
    qs = Lease.objects.filter(node=node).exclude(state__in=LIVE_LEASE_STATES)
    return list(qs.filter(Q(ended_at__gte=heard) | Q(last_reported_at__gte=heard)).order_by("ended_at", "pk"))


def lease_summary(lease: Lease, deadline) -> dict:
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
    checkpointing: list[Lease],
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
    heard = last_lease_report_at(node)
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
        "remaining": [lease_summary(lease, drain.deadline) for lease in live[:PROGRESS_LIST_LIMIT]],
        "at_risk": ids(at_risk),
        "unconfirmed": ids(unconfirmed),
        "waiting_on": waiting,
        "budgets": budgets,
    }


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
        raise NotFound(f"No node {node_id}.", NODE_NOT_FOUND) from exc
    if expected_version is not None:
        check_version(node.version, expected_version)
    if not can_proceed(node.drain):
        raise transition_refused(node, "drain")
    live = live_leases(node)
    if policy == EvictionPolicy.WAIT:
        _, _, budgets = ration(live, now=now, lock=False)
        held: dict[str, list[Lease]] = {}
    else:
        _, held, budgets = ration(live, now=now, lock=False)
    held_ids = {lease.pk for leases in held.values() for lease in leases}
    action = {EvictionPolicy.WAIT: "wait", EvictionPolicy.CHECKPOINT: "checkpoint"}.get(policy, "revoke")
    entries = []
    for lease in live:
        placement = lease_reconcile.simulate_placement(lease, exclude_node_ids=[node.pk])
        entry = lease_summary(lease, deadline)
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


def checkpoint_requests(drain: Drain) -> set:
    """Ids of the leases this drain asked to checkpoint (requests not withdrawn).

    Kept on the drain's eviction rows, not read back from ``Lease.checkpoint_requested_at``: the
    leases app clears that field when the workload reports ``checkpointed`` (the instruction has
    been answered), and the drain must still know the lease is its to end.
    """
    return set(
        Eviction.objects.filter(drain=drain, kind=EvictionKind.CHECKPOINT, withdrawn_at__isnull=True).values_list(
            "lease_id", flat=True
        )
    )


def answered_checkpoint(lease: Lease) -> bool:
    """Has the workload answered the checkpoint request a drain set on ``lease`` (read locked)?

    The answer clears ``checkpoint_requested_at`` in the same UPDATE that records ``checkpointed``,
    so the request's own field tells, with no clock compared: a ``checkpointed`` left from before
    the drain asked (a client's earlier request, one taken unasked) is no answer while the
    drain's request is still set, and ending the lease on it would lose the work done since.
    """
    return lease.checkpoint_requested_at is None and lease.workload_state == WorkloadState.CHECKPOINTED
