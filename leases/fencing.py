"""Fenced writes on a lease: renew, release, job events, checkpoint requests, token validation.

Every write carries the lease's fencing token and node incarnation and is checked by
:func:`check_fence` before a compare-and-swap that repeats the same conditions, so a stale writer
is refused (409/410) and changes nothing even when it races a legitimate one. Re-exported by
:mod:`leases.services`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from fleet.choices import Lifecycle, NodeEventType
from fleet.events import Actor, record_event
from fleet.models import Node
from nodepool.api.problems import Conflict, Gone, NotFound

from .choices import LIVE_LEASE_STATES, TERMINAL_LEASE_STATES, LeaseState, WorkloadState
from .models import FencingSequence, Lease
from .spec import bad


def _services():
    # Imported on use: leases.services re-exports this module, so either may be imported first.
    from . import services

    return services


# --- fencing checks ------------------------------------------------------------------------------
def _int_field(data: Any, name: str, *, required: bool = True) -> int | None:
    value = data.get(name) if isinstance(data, dict) else None
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad(name, "required: a non-negative integer")
    return value


def check_fence(lease: Lease, *, fencing_token: int, node_incarnation: int, now) -> None:
    """Refuse a write carrying a stale view of ``lease``. Order matters: the most specific answer.

    Raises:
        Gone 410 ``node_retired``; Conflict 409 ``lease_superseded`` (a newer lease exists for the
        workload); Gone 410 ``lease_ended`` / ``lease_expired``; Conflict 409 ``stale_fencing_token``
        or ``stale_incarnation``.
    """
    node = lease.node
    if node.lifecycle == Lifecycle.RETIRED:
        raise Gone("The lease's node is retired.", "node_retired")
    latest = FencingSequence.objects.filter(pk=lease.workload_id).values_list("last_token", flat=True).first() or 0
    newer = Lease.objects.filter(workload_id=lease.workload_id, fencing_token__gt=lease.fencing_token).exists()
    if newer:
        raise Conflict(
            f"Lease {lease.pk} was superseded by a newer lease of {lease.workload_id!r}.",
            "lease_superseded",
            current_token=latest,
        )
    if lease.state in TERMINAL_LEASE_STATES:
        code = "lease_expired" if lease.state == LeaseState.EXPIRED else "lease_ended"
        raise Gone(f"Lease {lease.pk} is {lease.state}; terminal leases never come back.", code)
    if lease.expires_at <= now:
        raise Gone(f"Lease {lease.pk} expired at {lease.expires_at.isoformat()}.", "lease_expired")
    if fencing_token != lease.fencing_token:
        raise Conflict(
            f"Fencing token {fencing_token} is not this lease's ({lease.fencing_token}).",
            "stale_fencing_token",
            current_token=lease.fencing_token,
        )
    if node_incarnation != lease.node_incarnation or node_incarnation < node.incarnation:
        raise Conflict(
            f"Node incarnation {node_incarnation} is stale (lease holds {lease.node_incarnation}, "
            f"node is at {node.incarnation}).",
            "stale_incarnation",
            current_incarnation=node.incarnation,
        )


def _lease_for_write(lease_id, *, user=None, node=None) -> Lease:
    queryset = Lease.objects.select_related("node")
    if node is not None:
        queryset = queryset.filter(node=node)
    elif user is not None:
        queryset = _services()._visible(queryset, user)
    lease = queryset.filter(pk=lease_id).first()
    if lease is None:
        raise NotFound("No such lease.", "lease_not_found")
    return lease


def lease_renew(*, lease_id, data: Any, user, actor: Actor, now=None) -> Lease:
    """Extend a live lease by ``ttl_seconds`` (default: its own TTL) from now. Raises as :func:`check_fence`."""
    now = now or timezone.now()
    token, incarnation = _int_field(data, "fencing_token"), _int_field(data, "node_incarnation")
    ttl = _int_field(data, "ttl_seconds", required=False)
    if ttl is not None and not 1 <= ttl <= 7 * 24 * 3600:
        raise bad("ttl_seconds", "must be from 1 to 604800")
    lease = _lease_for_write(lease_id, user=user)
    check_fence(lease, fencing_token=token, node_incarnation=incarnation, now=now)
    ttl = ttl or lease.ttl_seconds
    with transaction.atomic():
        renewed = Lease.objects.filter(
            pk=lease.pk,
            state__in=LIVE_LEASE_STATES,
            expires_at__gt=now,
            fencing_token=token,
            node_incarnation=incarnation,
        ).update(expires_at=now + timedelta(seconds=ttl), ttl_seconds=ttl, version=F("version") + 1)
    if not renewed:  # it changed between the check and the swap: answer from the new state
        check_fence(
            Lease.objects.select_related("node").get(pk=lease.pk),
            fencing_token=token,
            node_incarnation=incarnation,
            now=now,
        )
        raise Conflict("The lease changed while renewing; read it again.", "concurrent_modification")
    return Lease.objects.select_related("pool", "shape", "client").get(pk=lease.pk)


def lease_release(*, lease_id, data: Any, user, actor: Actor, now=None) -> Lease:
    """End a live lease as ``released`` with an ``outcome`` (succeeded, failed, cancelled…)."""
    from .choices import ReleaseOutcome

    now = now or timezone.now()
    token, incarnation = _int_field(data, "fencing_token"), _int_field(data, "node_incarnation")
    outcome = data.get("outcome") or ReleaseOutcome.UNKNOWN
    if outcome not in ReleaseOutcome.values:
        raise bad("outcome", f"must be one of {', '.join(ReleaseOutcome.values)}")
    reason = data.get("reason") or f"released by {actor.name}: {outcome}"
    if not isinstance(reason, str):
        raise bad("reason", "must be a string")
    lease = _lease_for_write(lease_id, user=user)
    check_fence(lease, fencing_token=token, node_incarnation=incarnation, now=now)
    fence = {"fencing_token": token, "node_incarnation": incarnation}
    ended = _services().end_lease(
        lease.pk, to_state=LeaseState.RELEASED, actor=actor, reason=reason, now=now, outcome=outcome, fence=fence
    )
    if ended is None:
        check_fence(
            Lease.objects.select_related("node").get(pk=lease.pk),
            fencing_token=token,
            node_incarnation=incarnation,
            now=now,
        )
        raise Conflict("The lease changed while releasing; read it again.", "concurrent_modification")
    return ended


def lease_report_event(*, lease_id, data: Any, node: Node, actor: Actor, now=None) -> Lease:
    """A node reports its job's state. ``running`` activates a granted lease; ``succeeded`` and
    ``failed`` end it as released with that outcome; ``checkpointed`` clears a checkpoint request."""
    now = now or timezone.now()
    token, incarnation = _int_field(data, "fencing_token"), _int_field(data, "node_incarnation")
    state = data.get("state")
    if state not in WorkloadState.values:
        raise bad("state", f"must be one of {', '.join(WorkloadState.values)}")
    message = data.get("message") or ""
    if not isinstance(message, str) or len(message) > 2000:
        raise bad("message", "must be a string of at most 2000 characters")
    lease = _lease_for_write(lease_id, node=node)
    check_fence(lease, fencing_token=token, node_incarnation=incarnation, now=now)
    fence = {"fencing_token": token, "node_incarnation": incarnation}
    if state in (WorkloadState.SUCCEEDED, WorkloadState.FAILED):
        ended = _services().end_lease(
            lease.pk,
            to_state=LeaseState.RELEASED,
            actor=actor,
            now=now,
            outcome=state,
            workload_state=state,
            reason=message or f"the node reported {state}",
            fence=fence,
        )
        if ended is None:
            raise Conflict("The lease changed while reporting; read it again.", "concurrent_modification")
        return ended
    with transaction.atomic():
        claim = Lease.objects.filter(pk=lease.pk, state__in=LIVE_LEASE_STATES, **fence)
        changes: dict[str, Any] = {"workload_state": state, "last_reported_at": now, "version": F("version") + 1}
        if state == WorkloadState.RUNNING:
            activated = claim.filter(state=LeaseState.GRANTED).update(
                state=LeaseState.ACTIVE, activated_at=now, missed_reports=0, **changes
            )
            if activated:
                record_event(
                    lease.node_id,
                    NodeEventType.LEASE,
                    actor,
                    from_state=LeaseState.GRANTED,
                    to_state=LeaseState.ACTIVE,
                    reason=message or "the node reported running",
                    data={"lease_id": str(lease.pk), "fencing_token": token},
                )
            elif not claim.update(missed_reports=0, **changes):
                raise Conflict("The lease changed while reporting; read it again.", "concurrent_modification")
        else:
            if not claim.update(checkpoint_requested_at=None, **changes):
                raise Conflict("The lease changed while reporting; read it again.", "concurrent_modification")
    return Lease.objects.select_related("pool", "shape", "client").get(pk=lease.pk)


def fencing_validate(*, data: Any) -> dict:
    """Is ``(workload_id, fencing_token)`` the workload's current, live lease?

    Returns ``{"valid": bool, "current_token": int | None, "lease_id": str | None}``.
    """
    workload_id = data.get("workload_id") if isinstance(data, dict) else None
    if not isinstance(workload_id, str) or not workload_id:
        raise bad("workload_id", "required: the workload's id")
    token = _int_field(data, "fencing_token")
    current = FencingSequence.objects.filter(pk=workload_id).values_list("last_token", flat=True).first()
    live = Lease.objects.filter(workload_id=workload_id, state__in=LIVE_LEASE_STATES).first()
    valid = live is not None and live.fencing_token == token and token == current
    return {
        "valid": valid,
        "current_token": live.fencing_token if live else None,
        "last_issued_token": current,
        "lease_id": str(live.pk) if live else None,
    }


def request_checkpoint(*, lease: Lease, actor: Actor, now=None) -> int:
    """Ask the node (in its next heartbeat) to checkpoint ``lease``. Returns 1 if newly asked."""
    now = now or timezone.now()
    return Lease.objects.filter(pk=lease.pk, state__in=LIVE_LEASE_STATES, checkpoint_requested_at__isnull=True).update(
        checkpoint_requested_at=now, version=F("version") + 1
    )
