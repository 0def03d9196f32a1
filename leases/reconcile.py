"""What nodes report against what the control plane holds; the interface heartbeats and
maintenance call (keep the signatures)."""

from __future__ import annotations

import dataclasses
import uuid
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from fleet.choices import Lifecycle
from fleet.events import record_event
from fleet.models import Node

from . import conf, event_types, evidence, placement
from .choices import LIVE_LEASE_STATES, LeaseState
from .lifecycle import end_lease
from .models import Lease
from .secrets import lease_secret
from .spec import parse_spec


def missed_reports_limit() -> int:
    """Heartbeats in a row a live lease may go unreported before it is declared lost (default 3)."""
    return conf.get("LEASE_MISSED_REPORTS")


def _as_uuid(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except (TypeError, ValueError, AttributeError):
        return None


def reconcile_heartbeat(
    node, *, incarnation: int, reported: list[dict[str, Any]], restarted: bool, actor
) -> dict[str, list]:
    """Compare the leases a node reports with what the control plane holds.

    Args:
        node: the fleet.Node that sent an applied heartbeat (already saved).
        incarnation: the heartbeat's incarnation.
        reported: ``[{"lease_id": str, "fencing_token": int, "state": str}]`` from the heartbeat.
        restarted: True when this heartbeat started a new incarnation.
        actor: fleet.events.Actor.

    Rules: a reported lease that is unknown, on another node, terminal, or carries a token that is
    not the lease's (stale, superseded) → stop. A reported live lease is seen (its miss counter is
    reset; after a restart the lease is adopted by the new incarnation). A live lease the node did
    not report: after a restart, lost at once (the new process does not run it); otherwise, if it
    has a ``command`` (something the node runs), lost after :func:`missed_reports_limit` heartbeats
    in a row (a lease granted within the last heartbeat interval is not counted yet: the agent may
    not have started it). A lease without a command is placement only: the agent does not list it,
    so it is never counted missing; its TTL, release and the node's liveness end it. Leases with
    ``checkpoint_requested_at`` set come back in ``checkpoint``. A node that keeps listing a lease
    that has ended is still reporting it (``last_reported_at``): a drain waits until it stops.

    Cost: one SELECT of the node's live leases when nothing needs writing (the common heartbeat).

    Returns:
        ``{"stop": [lease ids], "checkpoint": [lease ids], "assigned": [{"lease_id", "fencing_token",
        "command"}]}``: instructions for the node, and every live lease it holds (how an agent learns
        its work; docs/api-contract.md).
    """
    now = timezone.now()
    limit = missed_reports_limit()
    live = {
        row["pk"]: row
        for row in Lease.objects.filter(node_id=node.pk, state__in=LIVE_LEASE_STATES).values(
            "pk",
            "workload_id",
            "fencing_token",
            "expires_at",
            "command",
            "checkpoint_requested_at",
            "node_incarnation",
            "granted_at",
            "missed_reports",
            "devices",
        )
    }
    stop: list[str] = []
    healthy: list[uuid.UUID] = []
    mismatched: set[uuid.UUID] = set()
    not_live: list[uuid.UUID] = []
    for item in reported or []:
        lease_id = _as_uuid(item.get("lease_id")) if isinstance(item, dict) else None
        if lease_id is None:
            stop.append(str(item.get("lease_id") if isinstance(item, dict) else item))
            continue
        token = item.get("fencing_token")
        row = live.get(lease_id)
        if row is not None and isinstance(token, int) and not isinstance(token, bool) and token == row["fencing_token"]:
            healthy.append(lease_id)
        else:
            stop.append(str(lease_id))
            if row is None:
                not_live.append(lease_id)
            else:
                mismatched.add(lease_id)
    grace = now - timedelta(seconds=node.pool.heartbeat_interval if node.pool_id else 10)
    lost_ids: list[uuid.UUID] = []
    counted: list[uuid.UUID] = []
    for pk, row in live.items():
        if pk in healthy:
            continue
        if restarted and row["node_incarnation"] < incarnation:
            lost_ids.append(pk)
        elif row["command"] and row["granted_at"] <= grace:
            # Only leases the node runs are expected back: the agent lists what it runs, and a lease
            # without a command is placement only (docs/api-contract.md). Counting those would declare
            # every placement-only lease lost after three heartbeats while its workload still runs.
            counted.append(pk)
            if row["missed_reports"] + 1 >= limit:
                lost_ids.append(pk)
    # Only drains read when a node last listed an ended lease (maintenance.drains): skip the write
    # for other nodes, so a node still listing a lease it was told to stop costs no UPDATE.
    if node.lifecycle != Lifecycle.DRAINING:
        not_live = []
    # Lease rows before evidence rows, the order a lease's end takes them (end_lease, under a
    # drain's or a sweep's lock), and the lease rows all at once, oldest first, as a drain locks
    # them (maintenance.progress.live_leases): either other order deadlocked with a drain.
    touched = [*healthy, *counted, *not_live]
    with transaction.atomic(savepoint=False) if (live or not_live) else nullcontext():
        if touched and connection.features.has_select_for_update:
            locking = Lease.objects.select_for_update(no_key=True).filter(pk__in=touched)
            list(locking.order_by("granted_at", "pk").values_list("pk", flat=True))
        if healthy:
            seen_qs = Lease.objects.filter(pk__in=healthy, state__in=LIVE_LEASE_STATES)
            seen_qs.update(missed_reports=0, last_reported_at=now)
            if restarted:
                # The new incarnation says it runs these: it now owns them (older incarnations are fenced).
                seen_qs.filter(node_incarnation__lt=incarnation).update(
                    node_incarnation=incarnation, version=F("version") + 1
                )
        if counted:
            Lease.objects.filter(pk__in=counted, state__in=LIVE_LEASE_STATES).update(
                missed_reports=F("missed_reports") + 1
            )
        if not_live:
            # Ended leases this node still lists: it is still "reporting" them.
            Lease.objects.filter(pk__in=not_live, node_id=node.pk).update(last_reported_at=now)
        # Execution evidence (docs/marketplace.md): what this report says the node runs.
        evidence.record_status_report(
            node=node, incarnation=incarnation, live=live, listed=set(healthy), mismatched=mismatched, now=now
        )
    for lease_id in lost_ids:
        reason = (
            "the node restarted (new incarnation) and does not run this lease"
            if restarted and live[lease_id]["node_incarnation"] < incarnation
            else f"not reported by the node for {limit} heartbeats"
        )
        end_lease(lease_id, to_state=LeaseState.LOST, actor=actor, reason=reason, now=now)
    lost = set(lost_ids)
    remaining = [row for pk, row in live.items() if pk not in lost]
    return {
        "stop": stop,
        "checkpoint": [str(row["pk"]) for row in remaining if row["checkpoint_requested_at"] is not None],
        "assigned": [_assigned(row) for row in remaining],
    }


def _assigned(row: dict) -> dict:
    """One entry of the heartbeat's ``leases``: the lease, its command and its per-lease secret
    (derived, never stored: leases.secrets), which the agent hands to the workload."""
    secret, expires_at = lease_secret(
        lease_id=row["pk"], workload_id=row["workload_id"], fencing_token=row["fencing_token"],
        expires_at=row["expires_at"],
    )  # fmt: skip
    return {
        "lease_id": str(row["pk"]),
        "fencing_token": row["fencing_token"],
        "command": row["command"] or None,
        # The devices the workload may see (DEVICES-WIRE.md): the agent sets CUDA_VISIBLE_DEVICES etc.
        "devices": row.get("devices") or [],
        "lease_secret": secret,
        "lease_secret_expires_at": expires_at.isoformat(),
    }


def _end_all(leases, *, to_state: str, actor, reason: str) -> int:
    now = timezone.now()
    ended = 0
    for lease_id in list(leases.values_list("pk", flat=True)):
        if end_lease(lease_id, to_state=to_state, actor=actor, reason=reason, now=now) is not None:
            ended += 1
    return ended


def lose_node_leases(node_ids, *, actor, reason: str) -> int:
    """Declare every live lease on ``node_ids`` lost and free its capacity. Returns how many.

    Safe to run twice at once: each lease is claimed by compare-and-swap, so it ends once."""
    leases = Lease.objects.filter(node_id__in=list(node_ids), state__in=LIVE_LEASE_STATES)
    return _end_all(leases, to_state=LeaseState.LOST, actor=actor, reason=reason)


def revoke_node_leases(node, *, actor, reason: str) -> int:
    """Revoke every live lease on ``node`` (fenced: their tokens become stale). Returns how many."""
    node_id = node.pk if isinstance(node, Node) else node
    leases = Lease.objects.filter(node_id=node_id, state__in=LIVE_LEASE_STATES)
    count = _end_all(leases, to_state=LeaseState.REVOKED, actor=actor, reason=reason)
    if count:
        record_event(node_id, event_types.LEASE, actor, reason=f"{count} lease(s) revoked: {reason}")
    return count


def simulate_placement(lease, *, exclude_node_ids) -> dict:
    """Could ``lease``'s request be placed now on another node? Changes nothing.

    Uses the same filter and score rules as a real request, with the lease's resolved resources
    (its shape version, not the shape's latest) and without counting the lease in its own spread
    group. ``exclude_node_ids`` typically holds the node being drained.

    Returns ``{"placeable": bool, "node_id": str | None, "reasons": {code: count}, "message": str}``.
    """
    try:
        spec = parse_spec(lease.spec)
    except Exception:  # a lease granted before a validation rule tightened: place by resources only
        spec = parse_spec({"workload_id": lease.workload_id, "pool": lease.pool.name, "resources": {"cpu": "1"}})
    spec = dataclasses.replace(spec, resources=dict(lease.resources or {}), pool=lease.pool.name)
    if not spec.resources:
        return {"placeable": True, "node_id": None, "reasons": {}, "message": "the lease holds no resources"}
    exclude = [str(pk) for pk in exclude_node_ids or []]
    search = placement.find_candidates(lease.pool, spec, exclude_node_ids=exclude, exclude_lease_id=lease.pk)
    if search.candidates:
        best = search.candidates[0]
        return {
            "placeable": True,
            "node_id": str(best.node.pk),
            "reasons": {},
            "message": f"would be placed on {best.node} (score {best.score['score']})",
        }
    explanation = search.explanation or placement.diagnose(
        lease.pool, spec, exclude_node_ids=exclude, exclude_lease_id=lease.pk
    )
    return {
        "placeable": False,
        "node_id": None,
        "reasons": explanation["reasons"],
        "message": explanation["message"],
    }


def revoke_lease(lease, *, actor, reason: str, now=None) -> bool:
    """Revoke one live lease (fenced) and free its capacity, in one transaction.

    Its fencing token becomes stale at once and the workload may be placed again immediately.
    Returns True when this call revoked it, False when it was no longer live (nothing changed).
    """
    return (
        end_lease(lease.pk, to_state=LeaseState.REVOKED, actor=actor, reason=reason, now=now or timezone.now())
        is not None
    )
