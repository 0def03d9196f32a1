"""Ending leases: the one compare-and-swap that moves a live lease to a terminal state and gives
its capacity back (:func:`end_lease`), which the fenced writes (leases.fencing), reconciliation
(leases.reconcile), the sweeps and the operators' actions all call.

Every end follows the house pattern: ``atomic()`` → compare-and-swap on the lease row → capacity
returned → event row, in one transaction. Capacity moves only in the transaction that changes a
lease's liveness, so ``NodeResource.allocated`` is always the sum of the node's live leases
(checked by :func:`leases.sweeps.check_consistency`).
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Case, F, Value, When
from django.db.models.functions import Greatest

from fleet.events import Actor, record_event
from fleet.instructions import Instruction, post_instructions
from fleet.models import NodeResource
from nodepool import fsm

from . import devices as lease_devices
from . import event_types, evidence, kick
from . import metrics as lease_metrics
from .choices import WorkloadState
from .models import ENDINGS, Lease, LeaseCheckpoint
from .signals import lease_ended


def return_capacity(lease: Lease) -> None:
    """Subtract ``lease.resources`` from its node (never below zero: drift is reported, not hidden
    behind a constraint error that would block ending the lease)."""
    if lease.devices:  # device rows before count rows: the lock order of every device writer
        lease_devices.release(lease.pk)
    for name, amount in sorted((lease.resources or {}).items()):
        NodeResource.objects.filter(node_id=lease.node_id, name=name).update(
            allocated=Greatest(F("allocated") - amount, 0)
        )


def end_lease(
    lease_id,
    *,
    to_state: str,
    actor: Actor,
    reason: str,
    now,
    outcome: str = "",
    workload_state: str = "",
    fence: dict | None = None,
    expiring: bool = False,
) -> Lease | None:
    """Move a live lease to a terminal state and give its capacity back, exactly once.

    The compare-and-swap (``state IN live`` plus the fence, if given) is the claim: of two sweeps
    or two releases racing, one updates the row and returns the capacity, the other gets None.
    """
    with transaction.atomic():
        # WHERE state IN (live) and the new state come from the declared ending (Lease.<verb>).
        claim = Lease.objects.filter(pk=lease_id, **(fence or {}))
        if expiring:
            claim = claim.filter(expires_at__lte=now)
        changes = {"ended_at": now, "end_reason": reason[:2000], "version": F("version") + 1}
        if outcome:
            changes["outcome"] = outcome
        if workload_state:
            changes["workload_state"] = workload_state
        else:
            # A workload last reported running cannot still be said to run on an ended lease.
            changes["workload_state"] = Case(
                When(workload_state=WorkloadState.RUNNING, then=Value(WorkloadState.UNKNOWN)),
                default=F("workload_state"),
            )
        if not fsm.move(claim, ENDINGS[to_state], **changes):
            return None
        lease = Lease.objects.select_related("pool").get(pk=lease_id)
        return_capacity(lease)
        lease_metrics.lease_ended(pool=lease.pool.name, to_state=to_state, reason=reason)
        if lease.command:  # something the agent runs: its next renewal says to stop it
            post_instructions([lease.node_id], Instruction.STOP)
        evidence.close_for_lease(lease.pk, now=now)
        fsm.move(LeaseCheckpoint.objects.filter(lease_id=lease.pk), "withdraw")
        # Higher apps (the marketplace's usage record) act in this same transaction.
        lease_ended.send(sender=Lease, lease=lease, actor=actor, now=now)
        record_event(
            lease.node_id,
            event_types.LEASE,
            actor,
            to_state=to_state,
            reason=reason,
            data={"lease_id": str(lease.pk), "workload_id": lease.workload_id, "fencing_token": lease.fencing_token},
            lease_id=lease.pk,
            workload_id=lease.workload_id,
        )
        transaction.on_commit(kick.kick_queue)
    return lease
