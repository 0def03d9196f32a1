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
