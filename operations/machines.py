"""Following the machines a pool's provider was asked for (operations.autoscaler's follow step):
enrolled, ready, drained, removed. Passes do not lock each other out: every move of a machine is a
compare-and-swap built from ``ProviderMachine``'s declared transitions (:func:`_moved`); a removal
is claimed before the provider is asked to delete (:func:`_claim_removal`), and recorded once.
Also the pool's provisioning back-off (:func:`back_off`), which a failed machine starts.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import DatabaseError, transaction
from django.db.models import F
from django.utils import timezone

from fleet import services as fleet_services
from fleet.choices import Lifecycle
from fleet.events import Actor, record_event
from fleet.models import BootstrapToken, Node
from maintenance import drains
from maintenance import services as maintenance_services
from maintenance.choices import DrainState
from maintenance.models import Drain
from nodepool import fsm
from nodepool.api.problems import Problem

from . import event_types, outofservice, providers
from .choices import (
    LIVE_MACHINE_STATES,
    MachineState,
)
from .models import PoolOperations, ProviderMachine
from .providers import ProviderError

logger = logging.getLogger(__name__)


# --- follow ---------------------------------------------------------------------------------------
def follow_machines(*, pool_id, actor: Actor, now) -> None:
    ops = PoolOperations.objects.select_related("pool").get(pool_id=pool_id)
    for machine in ProviderMachine.objects.filter(
        pool_id=pool_id, state__in=[*LIVE_MACHINE_STATES, MachineState.DRAINING, MachineState.DELETING]
    ):
        try:
            _follow(machine, ops, actor, now)
        except Problem as exc:
            logger.info("machine %s not moved this pass: %s", machine.name, exc.detail)
        except (ProviderError, DatabaseError):
            # The provider failing to delete one machine, or one drain evaluation chosen as a
            # deadlock victim, must not cost the pool's other machines, nor its scale-up and
            # scale-down, this pass: the machine is followed again at the next one.
            logger.warning("machine %s not moved this pass", machine.name, exc_info=True)


def _moved(machine: ProviderMachine, verb: str, **changes) -> bool:
    """Move ``machine`` on from the state it was read in by its declared transition ``verb``
    (``nodepool.fsm.move``: the statement's states are the declaration's); False when a concurrent
    pass (or a preemption) moved it first, or the declaration does not allow the move from there.
    Passes do not lock each other out of following machines, so every change of a machine's state
    is this compare-and-swap, and its event is written once. On success the instance follows."""
    if not fsm.move(ProviderMachine.objects.filter(pk=machine.pk, state=machine.state), verb, **changes):
        return False
    getattr(machine, verb)()
    for name, value in changes.items():
        setattr(machine, name, value)
    return True


def _follow(machine: ProviderMachine, ops: PoolOperations, actor: Actor, now) -> None:
    if machine.state == MachineState.REQUESTED and machine.bootstrap_token_id:
        node = Node.objects.filter(bootstrap_token_id=machine.bootstrap_token_id).first()
        if node is not None and not _moved(machine, "enroll", node=node):
            return
    node = Node.objects.get(pk=machine.node_id) if machine.node_id else None
    if machine.state == MachineState.ENROLLED and node is not None:
        if node.lifecycle == Lifecycle.PENDING:
            fleet_services.node_admit(
                node_id=node.pk, expected_version=node.version, actor=actor, reason="a machine the autoscaler requested"
            )
        elif node.lifecycle == Lifecycle.READY:
            if not _moved(machine, "become_ready", ready_at=now):
                return
            # A machine that made it: the pool's back-off starts over.
            PoolOperations.objects.filter(pk=ops.pk, consecutive_failures__gt=0).update(
                consecutive_failures=0, backoff_until=None
            )
            seconds = (now - (machine.pending_since or machine.requested_at)).total_seconds()
            record_event(
                node,
                event_types.SCALE,
                actor,
                subject_type="machine",
                subject_id=machine.pk,
                to_state=MachineState.READY,
                reason=f"new machine ready {seconds:.1f}s after demand",
                data={"machine": machine.name, "scale_up_seconds": round(seconds, 3)},
            )
            return
        elif node.lifecycle == Lifecycle.REJECTED:
            _fail_machine(machine, ops, actor, now, f"admission refused the new node: {node.lifecycle_reason}")
            return
    if machine.state == MachineState.DELETING:
        _finish_removal(machine.pk, ops, actor)  # a claim whose provider call failed or never ran
    elif machine.state in (MachineState.REQUESTED, MachineState.ENROLLED):
        if now - machine.requested_at > timedelta(seconds=ops.boot_timeout):
            _fail_machine(machine, ops, actor, now, f"not ready within {ops.boot_timeout}s")
    elif machine.state == MachineState.DRAINING and node is not None:
        if node.lifecycle == Lifecycle.DRAINING:
            # Evaluate the drain now, not at the maintenance sweep's next run: checkpointed work
            # leaves (and is requeued) within one autoscaling pass.
            drain = Drain.objects.filter(node=node, state=DrainState.ACTIVE).first()
            if drain is not None:
                drains.evaluate_drain(drain_id=drain.pk, actor=actor, now=now)
                node = Node.objects.get(pk=node.pk)
        if node.lifecycle in (Lifecycle.MAINTENANCE, Lifecycle.RETIRED):
            _delete_machine(machine, ops, actor, reason="scale-down: node drained")


def _fail_machine(machine: ProviderMachine, ops: PoolOperations, actor: Actor, now, error: str) -> None:
    """Leave nothing half-done: token revoked, the provider told to delete, the node (if any) retired.

    See :func:`_remove` for why a pass that read the machine before another moved it (to ready,
    say, as its node turned ready past the boot timeout) changes nothing. A failed provider delete
    is recorded in the machine's error; the machine is failed all the same."""
    if not _claim_removal(machine, to_state=MachineState.FAILED, reason=error, now=now):
        return
    back_off(ops.pool_id, now=now)
    BootstrapToken.objects.filter(pk=machine.bootstrap_token_id, revoked_at__isnull=True).update(revoked_at=now)
    _finish_removal(machine.pk, ops, actor)


def remove_failed(machine: ProviderMachine, ops: PoolOperations, actor: Actor, *, now, error: str) -> None:
    """Remove ``machine`` as failed, from the state it was read in (``enrolled`` or ``ready``: it
    has a node): the removal claimed to end ``failed`` (:func:`_claim_removal`), the provider told
    to delete it, its node retired, the event recorded once. Unlike :func:`_fail_machine` it counts
    no failure of the pool and revokes no token: the caller (a failed create) did both."""
    if _claim_removal(machine, to_state=MachineState.FAILED, reason=error, now=now):
        _finish_removal(machine.pk, ops, actor)


def _delete_machine(machine: ProviderMachine, ops: PoolOperations, actor: Actor, *, reason: str) -> None:
    """Delete ``machine`` through the provider and retire its node, once (:func:`_claim_removal`).

    Raises ProviderError (the machine stays ``deleting``: the next pass asks the provider again)."""
    if _claim_removal(machine, to_state=MachineState.DELETED, reason=reason, now=timezone.now()):
        _finish_removal(machine.pk, ops, actor)


def _claim_removal(machine: ProviderMachine, *, to_state: str, reason: str, now) -> bool:
    """Claim ``machine`` for removal: a compare-and-swap from the state it was read in to
    ``deleting`` (naming the state it ends in and why), committed **before** the provider is
    called. False when another pass (or a preemption) moved the machine first.

    The claim is committed first so that no lock is held during the provider call (up to
    ``PROVIDER_TIMEOUT``): a pass that read the machine before another claimed it asks the provider
    for nothing, and a process dying after the claim leaves a ``deleting`` machine that the next
    pass deletes again (:func:`_finish_removal`; providers' deletes are idempotent: "gone already
    is fine") — delete at least once, record exactly once."""
    with transaction.atomic():
        return _moved(
            machine,
            "claim_removal",
            removing_to=to_state,
            removal_reason=reason[:2000],
            error=(reason if to_state == MachineState.FAILED else machine.error)[:2000],
            deleted_at=now,
        )


def _finish_removal(machine_id, ops: PoolOperations, actor: Actor) -> None:
    """Ask the provider to delete a ``deleting`` machine (no transaction, no lock held), then, in
    one transaction, move it to the state it ends in (a compare-and-swap: recorded once however
    many passes got here), retire its node and record the event. A delete that fails leaves a
    machine that is being deleted ``deleting`` (ProviderError raised: the next pass asks again);
    a failed machine is failed all the same, the error recorded."""
    machine = ProviderMachine.objects.get(pk=machine_id)
    reason = machine.removal_reason
    try:
        providers.provider_for(ops).delete(machine.name, machine.provider_data)
    except ProviderError as exc:
        if machine.removing_to != MachineState.FAILED:
            raise
        reason = f"{reason}; delete failed: {exc}"
    with transaction.atomic():
        # The node's row before the machine's, the order of the paths that lock both (preemption).
        node = maintenance_services.lock_node(machine.node_id) if machine.node_id else None
        failed = machine.removing_to == MachineState.FAILED
        changes = {"error": reason[:2000]} if failed else {}
        verb = "fail" if failed else "finish_deletion"
        if not fsm.move(ProviderMachine.objects.filter(pk=machine.pk, state=MachineState.DELETING), verb, **changes):
            return
        _removed(machine, node, actor, state=machine.removing_to, reason=reason)


def _removed(machine: ProviderMachine, node: Node | None, actor: Actor, *, state: str, reason: str) -> None:
    """The end of a removal, once the provider was asked: the node (if any) retired, its leases
    revoked, and the machine's event (``state``: failed or deleted)."""
    if node is not None and node.lifecycle != Lifecycle.RETIRED:
        outofservice.retire(node=node, owner=outofservice.AUTOSCALER, reason=reason)
    record_event(
        machine.node_id,
        event_types.SCALE,
        actor,
        pool=machine.pool_id,
        subject_type="machine",
        subject_id=machine.pk,
        to_state=state,
        reason=reason,
        data={"machine": machine.name},
    )


def remove_machine_of(node: Node, *, actor: Actor, reason: str) -> bool:
    """Delete the provider machine behind ``node`` (a drained spot node); False if it has none."""
    machine = ProviderMachine.objects.filter(node=node, state__in=[*LIVE_MACHINE_STATES, MachineState.DRAINING]).first()
    if machine is None:
        return False
    ops = PoolOperations.objects.select_related("pool").get(pool_id=machine.pool_id)
    _delete_machine(machine, ops, actor, reason=reason)
    return True


def back_off(pool_id, *, now) -> None:
    """One more consecutive failure of the pool's provisioning: scale-up waits
    ``scale_up_backoff_base × 2^(failures − 1)`` seconds, at most ``scale_up_backoff_max``
    (cluster-autoscaler's node-group back-off, exponential and capped; reset by a machine that
    becomes ready). Meanwhile the pool's ``fallback_pools`` are tried (:func:`scale_up`)."""
    PoolOperations.objects.filter(pool_id=pool_id).update(consecutive_failures=F("consecutive_failures") + 1)
    ops = PoolOperations.objects.get(pool_id=pool_id)
    base = max(1, ops.scale_up_backoff_base)
    seconds = min(ops.scale_up_backoff_max, base * 2 ** min(ops.consecutive_failures - 1, 30))
    PoolOperations.objects.filter(pk=ops.pk).update(backoff_until=now + timedelta(seconds=seconds))
