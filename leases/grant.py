"""The grant: place a request on a node and reserve it in one transaction (split out of
:mod:`leases.services`, whose :func:`~leases.services.lease_create` and the queue pass,
:func:`leases.sweeps.place_pending_requests`, call :func:`place`).

The reservation is one transaction in the order every grant keeps (the lock order: node, fencing
row, queued request, devices, capacity rows last; :func:`_reserve`). Its three raw statements
(the fencing upsert, the node's hold, the capacity UPDATE) are :mod:`leases.sql.grant`'s.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import NamedTuple

from django.db import transaction
from django.db.models import F

from fleet.choices import Lifecycle, Liveness
from fleet.events import Actor, record_event
from fleet.instructions import Instruction, post_instructions
from fleet.models import Pool
from fleet.selectors import SCHEDULABLE_HEALTH
from humanunits import quantity
from nodepool import fsm
from nodepool.db import insert_row
from nodepool.structured_logs import bind

from . import devices as lease_devices
from . import event_types, placement, requeue
from . import metrics as lease_metrics
from .choices import LeaseState
from .models import Lease, LeaseRequest
from .spec import PlacementSpec
from .sql import grant as grant_sql

# The grant's log lines keep the name they had before the split (log queries select on it).
logger = logging.getLogger("leases.services")
PLACEMENT_ROUNDS = 2  # re-run placement once when every candidate was taken by racing requests


class _LostRace(Exception):
    """Raised inside the reservation transaction to roll it back: the node filled up meanwhile."""


# --- grant ---------------------------------------------------------------------------------------
class _Held(NamedTuple):
    instructions: int  # the pending-instruction bits (fleet.instructions)
    incarnation: int


def _hold_schedulable_node(node_id) -> _Held | None:
    """Re-check, inside the grant's transaction, that the node may still take work, and hold it.

    Returns the node's pending-instruction bits and incarnation as they are under the hold when
    it is schedulable, None when it no longer is. The lease takes that incarnation, not the one
    the candidate search read: a restart reported in between must not leave the new lease on the
    old incarnation (lost at once).

    The candidate was read before this transaction; a cordon, drain or quarantine may have
    committed since. On PostgreSQL ``FOR SHARE`` also blocks one that has not committed yet until
    this grant commits, so a quarantine's revocation always sees the new lease (the operator
    actions lock the node ``FOR NO KEY UPDATE``, maintenance.services.lock_node, which conflicts
    with ``FOR SHARE``); grants on the same node still share the lock. SQLite runs one write
    transaction at a time, so the plain read is enough there.

    The same hold makes the returned bits stable until COMMIT: a status report clears them with an
    UPDATE of this row, which waits for the lock (PostgreSQL) or for this write transaction
    (SQLite), and reads the node's leases only afterwards. The read is
    :func:`leases.sql.grant.node_gate`.
    """
    row = grant_sql.node_gate(node_id)
    schedulable = bool(
        row
        and row[0] == Lifecycle.READY
        and row[1] == Liveness.ALIVE
        and row[2]
        and row[3] in SCHEDULABLE_HEALTH
        and not row[4]
        and not row[5]
    )
    return _Held(row[6], row[7]) if schedulable else None


def _reserve(
    *,
    pool: Pool,
    spec: PlacementSpec,
    shape,
    candidate,
    client,
    idempotency_key: str,
    request_hash: str,
    data: dict,
    actor: Actor,
    now,
    lease_request: LeaseRequest | None = None,
    examined: int = 0,
    patient: bool = True,
) -> Lease:
    """One transaction: fencing token, a conditional UPDATE per resource, the lease, the event.

    ``UPDATE … SET allocated = allocated + x WHERE allocated + x <= allocatable``
    (:func:`leases.sql.grant.take_capacity`) is the whole race guard: PostgreSQL re-evaluates the
    WHERE on the newest row version after waiting for a competing writer, SQLite runs one writer at
    a time, so a slot is never given twice.

    ``patient``: wait for the devices and capacity rows another transaction holds locked (False,
    the first round over the candidates: pass over a node another grant is reserving right now,
    leases.devices.claim and leases.sql.grant.take_capacity, instead of queueing behind its COMMIT).

    Raises:
        _LostRace: a resource no longer fits on this node (the caller tries the next candidate),
            or ``lease_request`` is no longer pending (the caller stops).
        IntegrityError: the workload got a live lease meanwhile (the partial unique index):
            lease_create answers 409 ``workload_has_live_lease``, the queue pass waits for it.
    """
    node = candidate.node
    decision = {
        "policy_version": placement.POLICY_VERSION,
        "policy": pool.scheduling_policy,
        "score": candidate.score["score"],
        "score_parts": candidate.score["parts"],
        "nodes_examined": examined,
        "reasons": _why(pool, spec, candidate),
    }
    with transaction.atomic():
        held = _hold_schedulable_node(node.pk)
        if held is None:
            raise _LostRace("node")
        # The workload's fencing row first, as every grant takes it (a direct grant then cancels
        # the workload's requeued request: request row second, never the other way round).
        token = grant_sql.next_fencing_token(spec.workload_id)
        # Then a queued request is claimed: a second queue pass placing the same request waited on
        # the fencing row for the first to commit, and now finds it placed and stands down.
        if lease_request is not None and not fsm.move(
            LeaseRequest.objects.filter(pk=lease_request.pk),
            "place",
            placed_at=now,
            version=F("version") + 1,
            attempts=F("attempts") + 1,
            last_attempt_at=now,  # the attempt that placed it counts too
        ):
            raise _LostRace("lease_request")  # another pass placed it, or its client cancelled it
        # The lease row next: the partial unique index refuses a second live lease of the workload
        # (IntegrityError, answered as 409 by lease_create) before any capacity is touched.
        lease = Lease(
            workload_id=spec.workload_id,
            fencing_token=token,
            node_id=node.pk,
            node_incarnation=held.incarnation,
            pool=pool,
            resources=spec.resources,
            shape=shape,
            shape_version=shape.version if shape else None,
            group=spec.spread_group,
            priority=spec.priority,
            command=list(spec.command),
            spec=data,
            decision=decision,
            ttl_seconds=spec.ttl_seconds,
            expires_at=now + timedelta(seconds=spec.ttl_seconds),
            granted_at=now,
            client=client,
            idempotency_key=idempotency_key if lease_request is None else "",
            request_hash=request_hash,
        )
        # Specific devices before the lease row (whose pk they name; the foreign key is checked at
        # COMMIT): the partial unique index on live LeaseDevice rows is the guard, and a racing
        # grant of the same device waits on it here and then loses (leases.devices). It is taken
        # before the capacity rows, like every grant, so the lock order stays one. Where the claim
        # is one statement (PostgreSQL, a plain request), the lease row goes in with it.
        if spec.devices:
            try:
                lease.devices = lease_devices.claim(
                    lease=lease,
                    node_id=node.pk,
                    requests=spec.devices,
                    tolerates=_device_tolerance(spec),
                    patient=patient,
                    insert_lease=True,  # in the claim's statement where it is one
                )
            except lease_devices.NoDevices as exc:
                raise _LostRace("devices") from exc
        if lease._state.adding:
            insert_row(lease)  # Lease.objects.create, prepared: nothing listens to a lease's save
        if lease_request is not None:
            LeaseRequest.objects.filter(pk=lease_request.pk).update(lease=lease)
        # A requeue names an earlier lease of the workload, which took a token from the fencing
        # sequence (never deleted): at token 1 there is none, and nothing to supersede.
        if token > 1 or lease_request is not None:
            requeue.on_granted(lease, lease_request, actor=actor)
        record_event(
            node.pk,
            event_types.LEASE,
            actor,
            to_state=LeaseState.GRANTED,
            reason=f"lease granted to {spec.workload_id}",
            data={"lease_id": str(lease.pk), "workload_id": spec.workload_id, "fencing_token": token},
            lease_id=lease.pk,
            workload_id=spec.workload_id,
        )
        # Capacity last: the node's rows stay locked only from here to COMMIT, which is what
        # bounds grants per second on one busy node.
        if grant_sql.take_capacity(node.pk, spec.resources, wait=patient) != len(spec.resources):
            raise _LostRace("capacity")

        # Once committed, the node's next renewal says a lease waits (fleet.instructions), unless
        # the bit is up already and held so by _hold_schedulable_node: one UPDATE and COMMIT less.
        if not held.instructions & Instruction.LEASES:
            post_instructions([node.pk], Instruction.LEASES)
    return lease


def _free(inventory: tuple[int, int]) -> int:
    """Free amount from an ``(allocatable, allocated)`` pair."""
    return inventory[0] - inventory[1]


def _device_tolerance(spec: PlacementSpec):
    """Whether the request's tolerations tolerate one device taint (Kubernetes semantics: an
    empty-key ``Exists`` toleration tolerates every device taint too)."""
    if not spec.tolerations:
        return None
    return lambda taint: any(t.tolerates(taint) for t in spec.tolerations)


def _why(pool: Pool, spec: PlacementSpec, candidate) -> list[str]:
    reasons = [
        "fits: "
        + ", ".join(
            f"{n} {quantity(n, a)} of {quantity(n, _free(candidate.inventory.get(n, (0, 0))))} free"
            for n, a in sorted(spec.resources.items())
        )
    ]
    policy = "most allocated (binpack)" if pool.scheduling_policy == "binpack" else "least allocated (spread)"
    reasons.append(f"pool policy {policy}: resources score {candidate.score['parts']['resources']}")
    for part in ("spread", "affinity", "taints"):
        if part in candidate.score["parts"]:
            reasons.append(f"{part} score {candidate.score['parts'][part]}")
    return reasons


def place(
    *,
    pool: Pool,
    spec: PlacementSpec,
    shape,
    client,
    idempotency_key: str,
    request_hash: str,
    data: dict,
    actor: Actor,
    now,
    lease_request: LeaseRequest | None = None,
) -> tuple[Lease | None, dict | None]:
    """Filter, score and reserve.

    Returns ``(lease, None)``, or ``(None, explanation)`` when nothing fits (after trying every
    candidate): ``explanation`` is :func:`placement.diagnose`'s answer when the search already ran
    the census, else None (the caller explains if it must).
    """
    started = time.perf_counter()
    lease, explanation = _place(
        pool=pool,
        spec=spec,
        shape=shape,
        client=client,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
        data=data,
        actor=actor,
        now=now,
        lease_request=lease_request,
    )
    if lease is not None:
        bind(lease_id=lease.pk, workload_id=lease.workload_id, pool=pool.name, node_id=lease.node_id)
        logger.info("lease_granted", extra={"fencing_token": lease.fencing_token})
        took = time.perf_counter() - started
        waited = (now - lease_request.created_at).total_seconds() if lease_request is not None else took
        lease_metrics.lease_granted(pool=pool.name, grant_seconds=took, pending_seconds=waited)
    return lease, explanation


def _place(*, pool, spec, shape, client, idempotency_key, request_hash, data, actor, now, lease_request):
    for round_ in range(PLACEMENT_ROUNDS):
        candidates, examined, explanation = placement.find_candidates(pool, spec, now=now)
        if not candidates:
            return None, explanation
        for candidate in candidates:
            try:
                return _reserve(
                    pool=pool,
                    spec=spec,
                    shape=shape,
                    candidate=candidate,
                    client=client,
                    idempotency_key=idempotency_key,
                    request_hash=request_hash,
                    data=data,
                    actor=actor,
                    now=now,
                    lease_request=lease_request,
                    examined=examined,
                    # The first round passes over nodes racing grants are reserving right now.
                    patient=round_ > 0,
                ), None
            except _LostRace as exc:
                if str(exc) == "lease_request":
                    return None, None
                continue
    return None, None
