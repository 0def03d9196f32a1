"""Lease services. The functions below are the interface other apps call; the leases issue
implements them (placement, grants, renewals and the rest live here too)."""

from __future__ import annotations

from typing import Any


def reconcile_heartbeat(
    node, *, incarnation: int, reported: list[dict[str, Any]], restarted: bool, actor
) -> dict[str, list[str]]:
    """Compare the leases a node reports with what the control plane holds.

    Args:
        node: the fleet.Node that sent an applied heartbeat (already saved).
        incarnation: the heartbeat's incarnation.
        reported: ``[{"lease_id": str, "fencing_token": int, "state": str}]`` from the heartbeat.
        restarted: True when this heartbeat started a new incarnation.
        actor: fleet.events.Actor.

    Returns:
        ``{"stop": [lease ids], "checkpoint": [lease ids]}`` instructions for the node.
    """
    return {"stop": [], "checkpoint": []}


def lose_node_leases(node_ids, *, actor, reason: str) -> int:
    """Declare every live lease on ``node_ids`` lost and free its capacity. Returns how many."""
    return 0


def revoke_node_leases(node, *, actor, reason: str) -> int:
    """Revoke every live lease on ``node`` (fenced: their tokens become stale). Returns how many."""
    return 0


def simulate_placement(lease, *, exclude_node_ids) -> dict:
    """Could ``lease``'s request be placed now on another node? Changes nothing.

    Returns ``{"placeable": bool, "node_id": str | None, "reasons": {code: count}, "message": str}``
    using the same filter and score rules as a real request (for drain dry-runs).
    """
    return {"placeable": False, "node_id": None, "reasons": {}, "message": "placement not implemented"}


def revoke_lease(lease, *, actor, reason: str, now=None) -> bool:
    """Revoke one live lease (fenced) and free its capacity, in one transaction.

    Its fencing token becomes stale at once (a revoked lease accepts no renew, release or
    event), and the workload may be placed again immediately: only live leases hold the
    one-live-lease-per-workload constraint.

    Args:
        lease: a leases.Lease (its ``resources`` are subtracted from ``NodeResource.allocated``).
        actor: fleet.events.Actor.
        reason: why, recorded in ``end_reason`` and in the node's event log.
        now: the time to record (default: now).

    Returns:
        True when this call revoked it; False when the lease was no longer live (nothing changed).
    """
    from django.db import transaction
    from django.db.models import F, Value
    from django.db.models.functions import Greatest
    from django.utils import timezone

    from fleet.choices import NodeEventType
    from fleet.events import record_event
    from fleet.models import NodeResource

    from .choices import LIVE_LEASE_STATES, LeaseState
    from .models import Lease

    now = now or timezone.now()
    with transaction.atomic():
        # Compare-and-swap on the state: two revokers (deadline task and sweep) free capacity once.
        claimed = Lease.objects.filter(pk=lease.pk, state__in=LIVE_LEASE_STATES).update(
            state=LeaseState.REVOKED, ended_at=now, end_reason=reason[:2000], version=F("version") + 1
        )
        if not claimed:
            return False
        for name, amount in sorted((lease.resources or {}).items()):
            NodeResource.objects.filter(node_id=lease.node_id, name=name).update(
                allocated=Greatest(F("allocated") - Value(int(amount)), Value(0))
            )
        record_event(
            lease.node_id,
            NodeEventType.LEASE,
            actor,
            from_state=lease.state,
            to_state=LeaseState.REVOKED,
            reason=reason,
            data={"lease_id": str(lease.pk), "workload_id": lease.workload_id, "fencing_token": lease.fencing_token},
        )
    lease.refresh_from_db()
    return True
