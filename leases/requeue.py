"""Requeued work: a lease request the control plane creates on behalf of a lease's client.

When the control plane takes a node away (a spot preemption, a scale-down, an upgrade's drain),
the work of each lease it ends is not simply dropped: :func:`requeue_lease` queues a new
:class:`LeaseRequest` for the same workload and the same client, optionally in another pool (a
spot pool's fallback). When it is placed, the new lease gets the workload's next fencing token
(so the old lease is fenced for good) and the old lease records ``superseded_by``.

The client learns of the move three ways: the old lease's state (``revoked``) and its
``superseded_by``; the old lease's events (a ``lease`` event naming the request); and the
request's own status (``GET /lease-requests/{id}``, ``requeued_from`` = the old lease). A client
that re-requests the workload itself still gets a lease as before: its own grant cancels the
pending requeue and becomes the old lease's ``superseded_by`` (:func:`on_granted`).
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import F

from fleet.events import Actor, record_event
from fleet.models import Pool
from nodepool import fsm

from . import event_types, kick
from .choices import LIVE_LEASE_STATES, LeaseRequestState
from .models import Lease, LeaseRequest


def requeue_lease(lease: Lease, *, pool: Pool | None, actor: Actor, reason: str, now) -> LeaseRequest | None:
    """Queue ``lease``'s work again for its client, in ``pool`` (default: the lease's own pool).

    Call inside the transaction that ended ``lease`` (it must no longer be live). Idempotent:
    a lease is requeued at most once, and not at all when its workload already holds a newer
    live lease (the client re-requested first) or has a pending request of its own.

    Returns the new pending request, or None when nothing was queued.
    """
    if lease.state in LIVE_LEASE_STATES:
        return None
    if LeaseRequest.objects.filter(requeued_from=lease).exists():
        return None
    if Lease.objects.filter(workload_id=lease.workload_id, state__in=LIVE_LEASE_STATES).exists():
        return None
    if LeaseRequest.objects.filter(workload_id=lease.workload_id, state=LeaseRequestState.PENDING).exists():
        return None
    target = pool or lease.pool
    spec = dict(lease.spec or {})
    spec.update(workload_id=lease.workload_id, pool=target.name, queue=True)
    request = LeaseRequest.objects.create(
        workload_id=lease.workload_id,
        pool=target,
        spec=spec,
        priority=lease.priority,
        client=lease.client,
        requeued_from=lease,
        message=f"requeued by the control plane: {reason}",
        created_at=now,  # the same instant as last_attempt_at
        last_attempt_at=now,
    )
    record_event(
        lease.node_id,
        event_types.LEASE,
        actor,
        lease_id=lease.pk,
        workload_id=lease.workload_id,
        reason=f"requeued: {reason}",
        data={"lease_id": str(lease.pk), "lease_request_id": str(request.pk), "pool": target.name},
    )
    transaction.on_commit(kick.kick_queue)
    return request


def on_granted(lease: Lease, lease_request: LeaseRequest | None, *, actor: Actor) -> None:
    """Record what a new grant supersedes (inside the grant's transaction).

    The request's ``requeued_from`` lease, and the old lease of any other pending requeue of the
    same workload (the client re-requested by itself: that requeue is cancelled), now point to
    ``lease`` through ``superseded_by``.
    """
    old_ids = []
    if lease_request is not None and lease_request.requeued_from_id:
        old_ids.append(lease_request.requeued_from_id)
    others = LeaseRequest.objects.filter(
        workload_id=lease.workload_id, state=LeaseRequestState.PENDING, requeued_from__isnull=False
    )
    if lease_request is not None:
        others = others.exclude(pk=lease_request.pk)
    for request in others:
        claimed = fsm.move(
            LeaseRequest.objects.filter(pk=request.pk),
            "cancel",
            message=f"superseded by lease {lease.pk}, which the client requested itself",
            version=F("version") + 1,
        )
        if claimed:
            old_ids.append(request.requeued_from_id)
    for old_id in old_ids:
        if Lease.objects.filter(pk=old_id, superseded_by__isnull=True).update(
            superseded_by=lease, version=F("version") + 1
        ):
            old = Lease.objects.only("node_id", "workload_id").get(pk=old_id)
            record_event(
                old.node_id,
                event_types.LEASE,
                actor,
                lease_id=old_id,
                workload_id=old.workload_id,
                reason=f"superseded by lease {lease.pk} (fencing token {lease.fencing_token})",
                data={"lease_id": str(old_id), "superseded_by": str(lease.pk), "fencing_token": lease.fencing_token},
            )
