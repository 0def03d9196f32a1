"""Autoscaling: turn pending demand into machines, idle machines into fewer, through a provider.

One pass per pool (:func:`autoscale_pool`, from the beat entry ``operations-autoscale``), under a
lock of the pool's :class:`PoolOperations` row so two passes never decide at once (that row alone,
``of=("self",)``: the joined pool row stays unlocked, since every event of the pool's nodes takes
``FOR KEY SHARE`` on it, and a sweep holding the node being drained deadlocked on it; following
machines takes no lock: each change of a machine's state is a compare-and-swap, so two passes
following the same machine move it, and record it, once; a delete or a failure is claimed by that
compare-and-swap (state ``deleting``, committed) before the provider is called, so no lock is held
during the call and the provider deletes a machine at least once, recorded exactly once):

1. **follow machines**: a requested machine whose bootstrap token enrolled a node is linked to
   it (and admitted if the pool admits manually: the autoscaler asked for it); a linked node
   that became ready marks the machine ready and records the scale-up time (request pending →
   node ready); a machine not ready within ``boot_timeout`` is failed and cleaned up (token
   revoked, provider delete, node retired); a machine being removed whose node is drained is
   deleted through the provider and its node retired.
2. **scale up** when lease requests of the pool have waited ``scale_up_delay`` seconds and a
   preview of the pool's node template shows a new node would hold them: enough template nodes
   to hold them (first fit), minus machines already on their way, bounded by ``max_nodes``,
   ``max_nodes_per_scale_up`` and ``scale_up_cooldown``; below ``min_nodes`` it tops up.
3. **scale down** one machine a pass whose node stayed below ``scale_down_utilization`` for
   ``scale_down_after`` seconds, whose live leases can all be placed elsewhere now (the drain dry
   run: :func:`leases.services.simulate_placement`) and whose lease groups' disruption budgets
   allow it; never below ``min_nodes``, and not within ``scale_down_cooldown`` of the last change.
   It is cordoned by ``system:autoscaler`` and drained with the pool's policy (its work requeued).

Every decision that acts or is held back is a :class:`ScaleDecision` with its reason (held-back
decisions only when the reason changes) and a ``scale`` event. A provider that fails or times
out is retried at most ``PROVIDER_MAX_ATTEMPTS`` times; then the machines it was asked for are
marked failed, their tokens revoked and the provider asked to delete them, so nothing half-done
remains, and the failure is visible on the decision (``outcome=failed``, ``error``).
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import datetime, timedelta

from django.db import DatabaseError, transaction
from django.db.models import F
from django.utils import timezone

from fleet import services as fleet_services
from fleet.choices import Lifecycle
from fleet.events import Actor, record_event
from fleet.models import BootstrapToken, Node, NodeResource, Pool
from leases import event_types as lease_events
from leases.choices import LIVE_LEASE_STATES, LeaseRequestState
from leases.models import Lease, LeaseRequest
from leases.services import simulate_placement
from leases.spec import parse_spec
from maintenance import drains
from maintenance import services as maintenance_services
from maintenance.choices import DrainState
from maintenance.models import Drain
from nodepool import fsm
from nodepool.api.problems import Problem

from . import capacity, conf, disruption, event_types, outofservice
from .choices import (
    ACTIVE_UPGRADE_STATES,
    LIVE_MACHINE_STATES,
    DisruptionReason,
    MachineState,
    ProviderKind,
    ScaleDirection,
    ScaleOutcome,
)
from .models import PoolOperations, ProviderMachine, ScaleDecision, Upgrade
from .providers import MachineRequest, ProviderError, provider_for

logger = logging.getLogger(__name__)
FRESH_SECONDS = 30


def autoscale_all(*, actor: Actor, now=None) -> dict:
    """One pass over every pool with a provider; one failing pool is logged and skipped."""
    result = {}
    for pool_id in PoolOperations.objects.exclude(provider=ProviderKind.NONE).values_list("pool_id", flat=True):
        try:
            result[str(pool_id)] = autoscale_pool(pool_id=pool_id, actor=actor, now=now)
        except Exception:
            logger.exception("autoscaling pool %s failed; the next pass tries again", pool_id)
    return result


def autoscale_pool(*, pool_id, actor: Actor, now=None) -> dict:
    """Follow machines, then scale up or down at most once. Returns what it did."""
    now = now or timezone.now()
    follow_machines(pool_id=pool_id, actor=actor, now=now)
    up = scale_up(pool_id=pool_id, actor=actor, now=now)
    down = 0 if up else scale_down(pool_id=pool_id, actor=actor, now=now)
    return {"up": up, "down": down}


def _decide(pool: Pool, direction: str, outcome: str, count: int, reason: str, actor: Actor, **data) -> ScaleDecision:
    decision = ScaleDecision.objects.create(
        pool=pool, direction=direction, outcome=outcome, count=count, reason=reason, data=data
    )
    record_event(
        None,
        event_types.SCALE,
        actor,
        pool=pool,
        subject_type="scale_decision",
        subject_id=decision.pk,
        to_state=outcome,
        reason=reason,
        data={"direction": direction, "count": count, **data},
    )
    return decision


def _held_back(pool: Pool, direction: str, reason: str, actor: Actor, **data) -> None:
    """Record a held-back decision unless the pool's latest decision says the same."""
    last = ScaleDecision.objects.filter(pool=pool).order_by("-created_at", "-id").first()
    if last is None or last.outcome != ScaleOutcome.BLOCKED or last.reason != reason:
        _decide(pool, direction, ScaleOutcome.BLOCKED, 0, reason, actor, **data)


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
        provider_for(ops).delete(machine.name, machine.provider_data)
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


# --- scale up -------------------------------------------------------------------------------------
def _template_fits(pool: Pool, ops: PoolOperations, requests: list[LeaseRequest]) -> list[tuple[LeaseRequest, object]]:
    """The requests an empty node of ``pool``'s template would hold, with their parsed specs.

    Left out as not pending demand (they would launch a node every pass that no request uses):
    a request whose workload still holds a live lease — the work waits for that lease to end, on a
    node whose drain waits on a budget or a window, not for capacity (Karpenter excludes pods that
    no new node would let schedule, kubernetes-sigs/karpenter #1842) — and one the template's
    node could not take for its spread group's anti-affinity (the group already holds the
    template's topology domain)."""
    live = set(
        Lease.objects.filter(
            workload_id__in=[r.workload_id for r in requests], state__in=LIVE_LEASE_STATES
        ).values_list("workload_id", flat=True)
    )
    fitting = []
    for request in requests:
        if request.workload_id in live:
            continue
        try:
            spec = parse_spec({**(request.spec or {}), "pool": pool.name})
        except Problem:
            continue
        if capacity.template_preview(pool, ops.node_template, spec) is None:
            fitting.append((request, spec))
    return fitting


def _pack(size: dict[str, int], fitting: list[tuple[LeaseRequest, object]]) -> list[list[LeaseRequest]]:
    """Template nodes (of allocatable ``size``) holding ``fitting``: first fit, largest first; the
    requests each bin holds, in bin order."""
    bins: list[tuple[dict[str, int], list[LeaseRequest]]] = []
    for request, spec in sorted(fitting, key=lambda item: -sum(item[1].resources.values())):
        for free, held in bins:
            if all(free.get(k, 0) >= v for k, v in spec.resources.items()):
                for k, v in spec.resources.items():
                    free[k] -= v
                held.append(request)
                break
        else:
            free = dict(size)
            for k, v in spec.resources.items():
                free[k] = free.get(k, 0) - v
            bins.append((free, [request]))
    return [held for _free, held in bins]


def _bins_needed(pool: Pool, ops: PoolOperations, requests: list[LeaseRequest]) -> tuple[int, list[str]]:
    """Template nodes needed to hold ``requests`` (first fit, largest first) and the ids that fit one."""
    fitting = _template_fits(pool, ops, requests)
    bins = _pack(capacity.template_allocatable(pool, ops.node_template), fitting)
    return len(bins), [str(r.pk) for r, _ in fitting]


def fallback_pool_names(ops: PoolOperations) -> list[str]:
    """``ops.fallback_pools`` as names, in order (a pool deleted since drops out)."""
    ids = list(ops.fallback_pools or [])
    names = dict(Pool.objects.filter(pk__in=ids).values_list("pk", "name"))
    return [names[pk] for pk in ids if pk in names]


def scale_up(*, pool_id, actor: Actor, now) -> int:
    """Request machines for pending demand (or up to ``min_nodes``). Returns machines requested
    (in this pool, or in a fallback pool while this one backs off or is at ``max_nodes``)."""
    with transaction.atomic():
        ops = PoolOperations.objects.select_for_update(of=("self",)).select_related("pool").get(pool_id=pool_id)
        pool = ops.pool
        waiting = list(
            LeaseRequest.objects.filter(
                pool=pool, state=LeaseRequestState.PENDING, created_at__lte=now - timedelta(seconds=ops.scale_up_delay)
            ).order_by("created_at")
        )
        in_flight = _in_flight(pool.pk)
        # A machine that just became ready and holds nothing yet is capacity the queue is about to
        # use (placement runs on its own): counting it again would ask twice for one demand.
        fresh = (
            ProviderMachine.objects.filter(
                pool=pool, state=MachineState.READY, ready_at__gte=now - timedelta(seconds=FRESH_SECONDS)
            )
            .exclude(node__leases__state__in=LIVE_LEASE_STATES)
            .count()
        )
        members = capacity.member_nodes(pool).count()
        fitting = _template_fits(pool, ops, waiting)
        bins = _pack(capacity.template_allocatable(pool, ops.node_template), fitting)
        wanted = max(len(bins) - in_flight - fresh, ops.min_nodes - members - in_flight, 0)
        if not wanted:
            return 0
        reason_base = (
            f"{len(fitting)} lease request(s) pending ≥ {ops.scale_up_delay}s fit the node template"
            if len(bins) > in_flight + fresh
            else f"{members} node(s), below min_nodes {ops.min_nodes}"
        )
        room = ops.max_nodes - members - in_flight
        held = ""
        if room <= 0:
            held = f"at max_nodes {ops.max_nodes}"
        elif ops.backoff_until and now < ops.backoff_until:
            held = (
                f"backing off after {ops.consecutive_failures} consecutive failure(s) "
                f"until {ops.backoff_until.isoformat()}"
            )
        if held:
            # The requests the pool's own launches would not cover go to its fallback pools, in
            # order (cluster-autoscaler's priority expander): the unlaunched bins' requests.
            unserved = [r for bin_ in bins[in_flight + fresh :] for r in bin_]
            handed = _scale_up_in_fallbacks(ops, unserved, actor=actor, now=now) if unserved else None
            if handed is None:
                _held_back(pool, ScaleDirection.UP, f"{reason_base}; held back: {held}", actor, wanted=wanted)
                return 0
            launch, moved = handed
            fallback_name = launch[0].pool.name
            _held_back(
                pool, ScaleDirection.UP,
                f"{reason_base}; held back: {held}; {moved} request(s) handed to fallback pool "
                f"{fallback_name} ({len(launch[2])} node(s) requested there)",
                actor, wanted=wanted, fallback_pool=fallback_name,
            )  # fmt: skip
        else:
            launch = _launch_here(ops, fitting, waiting, wanted=wanted, room=room, in_flight=in_flight,
                                  members=members, reason_base=reason_base, actor=actor, now=now)  # fmt: skip
            if launch is None:
                return 0
    # The provider is called outside the transaction: the machines are visible as requested first,
    # so a crash here leaves rows the boot timeout cleans up, never machines nobody knows about.
    _call_provider(*launch, actor)
    return len(launch[2])


def _launch_here(ops, fitting, waiting, *, wanted, room, in_flight, members, reason_base, actor, now):
    """Scale-up in the pool itself, bounded by ``max_launches_in_flight``, the cool-down and the
    rate; ``(ops, decision, machine requests)``, or None (held back, and said why)."""
    pool = ops.pool
    launch_room = ops.max_launches_in_flight - in_flight
    if launch_room <= 0:
        _held_back(
            pool,
            ScaleDirection.UP,
            f"{reason_base}; held back: {in_flight} launch(es) in flight (max_launches_in_flight "
            f"{ops.max_launches_in_flight})",
            actor,
            wanted=wanted,
        )
        return None
    room = min(room, launch_room)
    if ops.last_scale_up_at and now < ops.last_scale_up_at + timedelta(seconds=ops.scale_up_cooldown):
        until = ops.last_scale_up_at + timedelta(seconds=ops.scale_up_cooldown)
        held = f"{reason_base}; held back: cool-down until {until.isoformat()}"
        _held_back(pool, ScaleDirection.UP, held, actor, wanted=wanted)
        return None
    count = min(wanted, room, ops.max_nodes_per_scale_up)
    reason = f"{reason_base}: requesting {count} node(s)"
    if count < wanted:
        reason += f" of {wanted} wanted (bounded by max_nodes / max_nodes_per_scale_up / max_launches_in_flight)"
    decision = _decide(
        pool,
        ScaleDirection.UP,
        ScaleOutcome.REQUESTED,
        count,
        reason,
        actor,
        lease_requests=[str(r.pk) for r, _ in fitting][:50],
        in_flight=in_flight,
        members=members,
    )
    pending_since = waiting[0].created_at if waiting else now
    requests = _new_machines(ops, decision, count, pending_since=pending_since, now=now)
    ops.last_scale_up_at = now
    ops.save(update_fields=["last_scale_up_at", "updated_at"])
    return ops, decision, requests


def _in_flight(pool_id) -> int:
    """Launches on their way: machines requested or enrolled, not ready yet."""
    return ProviderMachine.objects.filter(
        pool_id=pool_id, state__in=[MachineState.REQUESTED, MachineState.ENROLLED]
    ).count()


def _scale_up_in_fallbacks(
    ops: PoolOperations, requests: list[LeaseRequest], *, actor: Actor, now
) -> tuple[tuple, int] | None:
    """Launch nodes for ``requests`` (pending in ``ops.pool``) in the first of its
    ``fallback_pools`` that can: a provider, no back-off, room under ``max_nodes`` and
    ``max_launches_in_flight``, no cool-down, and a template holding them. The requests it
    launches for move to that pool (their ``pool`` and ``spec.pool``, a compare-and-swap on the
    pending request, with a ``lease`` event each), as a preempted lease's work is requeued in the
    ``fallback_pool``. Returns ``((fallback ops, decision, machine requests), requests moved)`` —
    the provider is called by the caller once the transaction commits — or None.

    Called under the lock of ``ops``'s row; takes each fallback's row lock in turn. Cycles are
    refused when fallbacks are written (:func:`operations.services.parse_fallback_pools`), so
    locks follow the fallback order and two pools never wait on each other.
    """

    for fallback_id in ops.fallback_pools or []:
        fallback = (
            PoolOperations.objects.select_for_update(of=("self",))
            .select_related("pool")
            .filter(pool_id=fallback_id)
            .first()
        )
        if fallback is None or fallback.provider == ProviderKind.NONE or not fallback.max_nodes:
            continue
        if fallback.backoff_until and now < fallback.backoff_until:
            continue
        if fallback.last_scale_up_at and now < fallback.last_scale_up_at + timedelta(
            seconds=fallback.scale_up_cooldown
        ):
            continue
        in_flight = _in_flight(fallback.pool_id)
        room = min(
            fallback.max_nodes - capacity.member_nodes(fallback.pool).count() - in_flight,
            fallback.max_launches_in_flight - in_flight,
            fallback.max_nodes_per_scale_up,
        )
        if room <= 0:
            continue
        bins = _pack(
            capacity.template_allocatable(fallback.pool, fallback.node_template),
            _template_fits(fallback.pool, fallback, requests),
        )[:room]
        if not bins:
            continue
        moved = 0
        for request in (r for bin_ in bins for r in bin_):
            spec = {**(request.spec or {}), "pool": fallback.pool.name}
            if LeaseRequest.objects.filter(pk=request.pk, pool=ops.pool, state=LeaseRequestState.PENDING).update(
                pool=fallback.pool, spec=spec, version=F("version") + 1
            ):
                moved += 1
                record_event(
                    None,
                    lease_events.LEASE,
                    actor,
                    pool=ops.pool,
                    workload_id=request.workload_id,
                    subject_type="lease_request",
                    subject_id=request.pk,
                    reason=f"moved to fallback pool {fallback.pool.name}: pool {ops.pool.name} cannot launch now",
                    data={"lease_request_id": str(request.pk), "from_pool": ops.pool.name,
                          "pool": fallback.pool.name},
                )  # fmt: skip
        if not moved:
            continue
        count = len(bins)
        decision = _decide(
            fallback.pool,
            ScaleDirection.UP,
            ScaleOutcome.REQUESTED,
            count,
            f"{moved} lease request(s) of pool {ops.pool.name} (fallback while it cannot launch): "
            f"requesting {count} node(s)",
            actor,
            fallback_of=ops.pool.name,
            lease_requests=[str(r.pk) for bin_ in bins for r in bin_][:50],
        )
        machines = _new_machines(fallback, decision, count, pending_since=requests[0].created_at, now=now)
        fallback.last_scale_up_at = now
        fallback.save(update_fields=["last_scale_up_at", "updated_at"])
        return (fallback, decision, machines), moved
    return None


def _new_machines(ops: PoolOperations, decision: ScaleDecision, count: int, *, pending_since, now) -> list:
    """``count`` machine rows, each with a fresh single-use bootstrap token, and the provider requests."""
    pool = ops.pool
    requests = []
    for _ in range(count):
        name = f"{pool.name[:40]}-{uuid.uuid4().hex[:10]}"
        token, secret = fleet_services.bootstrap_token_create(
            pool=pool,
            expires_at=now + timedelta(seconds=ops.boot_timeout),
            max_uses=1,
            description=f"autoscaler machine {name}",
            now=now,
        )
        ProviderMachine.objects.create(
            pool=pool,
            provider=ops.provider,
            name=name,
            decision=decision,
            bootstrap_token=token,
            requested_at=now,
            pending_since=pending_since,
            template=ops.node_template or {},
        )
        requests.append(
            MachineRequest(
                name=name,
                bootstrap_token=secret,
                template=ops.node_template,
                version=(ops.target or {}).get("version", ""),
            )
        )
    return requests


def request_surge(*, pool_id, count: int, upgrade_id, actor: Actor, now=None) -> int:
    """Ask the provider for ``count`` extra nodes before an upgrade takes nodes out (its
    ``max_surge_nodes``), within ``max_nodes``. Once per upgrade. Returns machines requested."""
    return request_extra(
        pool_id=pool_id,
        count=count,
        why="upgrade surge: {count} node(s) before nodes are taken out",
        key={"upgrade_id": str(upgrade_id)},
        actor=actor,
        now=now,
    )


def request_replacement(*, pool_id, preemption_id, node_id, actor: Actor, now=None) -> int:
    """Replacement capacity for a preempted node, asked at once (not when its evicted work comes
    back as pending requests): one node of the pool's template, or of its ``fallback_pool``'s when
    the pool has no provider or no room. The preempted node does not count against ``max_nodes``:
    it is going away. A pool without autoscaling (no operations settings, or no provider) cannot
    replace; when neither pool can, the preempted pool records why (a held-back decision) and
    nothing is requested. Once per preemption. Returns machines requested (0 or 1)."""
    ops = PoolOperations.objects.select_related("pool", "fallback_pool").filter(pool_id=pool_id).first()
    key = {"preemption_id": preemption_id}
    why = "replacement for a preempted node: {count} node(s) at once"
    got = request_extra(pool_id=pool_id, count=1, why=why, key=key, actor=actor, now=now, leaving=[node_id])
    if got:
        return got
    fallback = ops.fallback_pool if ops is not None else None
    if fallback is not None:
        pool_name = ops.pool.name
        got = request_extra(
            pool_id=fallback.pk,
            count=1,
            why=why + f" (fallback of {pool_name})",
            key=key,
            actor=actor,
            now=now,
        )
        if got:
            return got
    # Neither pool asked its provider. Say why, once, unless a pool already did (e.g. at max_nodes).
    if not ScaleDecision.objects.filter(data__preemption_id=preemption_id).exists():
        pool = ops.pool if ops is not None else Pool.objects.filter(pk=pool_id).first()
        if pool is not None:
            reasons = [f"pool {pool.name}: {_no_replacement(ops)}"]
            if fallback is not None:
                fallback_ops = PoolOperations.objects.filter(pool_id=fallback.pk).first()
                reasons.append(f"fallback pool {fallback.name}: {_no_replacement(fallback_ops)}")
            else:
                reasons.append("no fallback pool")
            _decide(
                pool,
                ScaleDirection.UP,
                ScaleOutcome.BLOCKED,
                0,
                why.format(count=0) + "; held back: " + "; ".join(reasons),
                actor,
                **key,
            )
    return 0


def _no_replacement(ops: PoolOperations | None) -> str:
    if ops is None or ops.provider == ProviderKind.NONE:
        return "no autoscaling (no provider)"
    return "no replacement"


def request_extra(*, pool_id, count: int, why: str, key: dict, actor: Actor, now=None, leaving=()) -> int:
    """``count`` extra nodes from the pool's provider within ``max_nodes`` (``leaving``: node ids
    not counted as members), once per ``key`` (a ``ScaleDecision.data`` member naming the cause).
    The decision is recorded under the pool's settings lock; the provider is called after it
    commits. Returns machines requested."""
    now = now or timezone.now()
    ((name, value),) = key.items()
    with transaction.atomic():
        ops = (
            PoolOperations.objects.select_for_update(of=("self",))
            .select_related("pool")
            .filter(pool_id=pool_id)
            .first()
        )
        if ops is None or ops.provider == ProviderKind.NONE:  # no autoscaling here
            return 0
        if ScaleDecision.objects.filter(pool_id=pool_id, **{f"data__{name}": value}).exists():
            return 0
        members = capacity.member_nodes(ops.pool).exclude(pk__in=list(leaving)).count()
        in_flight = ProviderMachine.objects.filter(
            pool_id=pool_id, state__in=[MachineState.REQUESTED, MachineState.ENROLLED]
        ).count()
        room = (ops.max_nodes - members - in_flight) if ops.max_nodes else 0
        count = max(0, min(count, room))
        reason = why.format(count=count)
        if count == 0:
            _decide(
                ops.pool,
                ScaleDirection.UP,
                ScaleOutcome.BLOCKED,
                0,
                reason + f"; held back: at max_nodes {ops.max_nodes}",
                actor,
                **key,
            )
            return 0
        decision = _decide(ops.pool, ScaleDirection.UP, ScaleOutcome.REQUESTED, count, reason, actor, **key)
        requests = _new_machines(ops, decision, count, pending_since=now, now=now)
    _call_provider(ops, decision, requests, actor)
    return count


def surge_ready(*, pool_id, upgrade_id) -> int:
    """Surge machines of ``upgrade_id`` that are ready now (they add room under max_unavailable_nodes)."""
    return ProviderMachine.objects.filter(
        pool_id=pool_id, state=MachineState.READY, decision__data__upgrade_id=str(upgrade_id)
    ).count()


def _call_provider(ops: PoolOperations, decision: ScaleDecision, requests: list[MachineRequest], actor: Actor) -> None:
    attempts, error = 0, ""
    max_attempts = int(conf.get("PROVIDER_MAX_ATTEMPTS"))
    created: dict[str, dict] = {}
    while attempts < max_attempts:
        attempts += 1
        try:
            created = provider_for(ops).create(requests)
            break
        except ProviderError as exc:
            error = str(exc)
            if attempts < max_attempts:
                time.sleep(min(2.0, 0.2 * 2**attempts))
    now = timezone.now()
    with transaction.atomic():
        if created:
            for name, data in created.items():
                ProviderMachine.objects.filter(name=name).update(provider_data=data or {})
            _finish_decision(
                ops,
                decision,
                actor,
                outcome=ScaleOutcome.SUCCEEDED,
                attempts=attempts,
                now=now,
                reason=f"provider accepted {len(requests)} machine(s)",
            )
            return
        back_off(ops.pool_id, now=now)
        machines = ProviderMachine.objects.filter(decision=decision)
        BootstrapToken.objects.filter(pk__in=machines.values("bootstrap_token_id"), revoked_at__isnull=True).update(
            revoked_at=now
        )
        fsm.move(machines, "fail", error=error[:2000], deleted_at=now)
        _finish_decision(
            ops,
            decision,
            actor,
            outcome=ScaleOutcome.FAILED,
            attempts=attempts,
            now=now,
            reason=f"provider failed after {attempts} attempt(s): {error}",
            error=error,
        )
    for request in requests:  # best effort: the provider may have created some before failing
        try:
            provider_for(ops).delete(request.name, {})
        except ProviderError:
            logger.warning("could not ask the provider to delete %s after a failed create", request.name)


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


def _finish_decision(
    ops: PoolOperations,
    decision: ScaleDecision,
    actor: Actor,
    *,
    outcome: str,
    attempts: int,
    now,
    reason: str,
    error: str = "",
) -> None:
    """A requested decision's outcome once the provider answered (or ``attempts`` ran out), and its event."""
    ScaleDecision.objects.filter(pk=decision.pk).update(
        outcome=outcome, attempts=attempts, error=error[:2000], finished_at=now
    )
    record_event(
        None,
        event_types.SCALE,
        actor,
        pool=ops.pool_id,
        subject_type="scale_decision",
        subject_id=decision.pk,
        from_state=ScaleOutcome.REQUESTED,
        to_state=outcome,
        reason=reason,
        data={"attempts": attempts},
    )


# --- scale down -----------------------------------------------------------------------------------
def utilization(node: Node) -> float:
    """The node's highest allocated / allocatable over its resources (0 for an empty inventory)."""
    ratios = [r.allocated / r.allocatable for r in NodeResource.objects.filter(node=node) if r.allocatable > 0]
    return max(ratios, default=0.0)


def replaceable(node: Node) -> tuple[bool, str]:
    """Can every live lease on ``node`` be placed elsewhere now? (changes nothing; the budgets
    are the gate's: :func:`operations.disruption.disrupt`)"""
    for lease in Lease.objects.filter(node=node, state__in=LIVE_LEASE_STATES).select_related("pool"):
        outcome = simulate_placement(lease, exclude_node_ids=[node.pk])
        if not outcome["placeable"]:
            return False, f"lease {lease.pk} could not be placed elsewhere: {outcome['message']}"
    return True, ""


def scale_down(*, pool_id, actor: Actor, now) -> int:
    """Cordon and drain one idle machine of the pool (deleted once drained). Returns 1 or 0."""
    with transaction.atomic():
        ops = PoolOperations.objects.select_for_update(of=("self",)).select_related("pool").get(pool_id=pool_id)
        pool = ops.pool
        machines = list(
            ProviderMachine.objects.filter(pool=pool, state=MachineState.READY, node__isnull=False)
            .select_related("node", "decision")
            .order_by("requested_at")
        )
        # Surge nodes belong to their upgrade until it ends: scale-down leaves them alone meanwhile
        # (removing one mid-upgrade dropped the Ready ratio and paused the roll). Once it ended, they
        # go first, idle or not (their work moves under the budgets), so the pool returns to its size.
        running = {
            str(pk)
            for pk in Upgrade.objects.filter(pool=pool, state__in=ACTIVE_UPGRADE_STATES).values_list("pk", flat=True)
        }
        machines = [m for m in machines if _surge_of(m) not in running and not _replacing(m)]
        surplus = [m for m in machines if _surge_of(m) and m.node.lifecycle == Lifecycle.READY]
        underused = {}
        for machine in machines:
            node = machine.node
            if node.lifecycle == Lifecycle.READY and utilization(node) < ops.scale_down_utilization:
                underused[str(node.pk)] = (ops.underused_since or {}).get(str(node.pk), now.isoformat())
        if underused != (ops.underused_since or {}):
            ops.underused_since = underused
            ops.save(update_fields=["underused_since", "updated_at"])
        last_change = max(filter(None, [ops.last_scale_down_at, ops.last_scale_up_at]), default=None)
        if last_change and now < last_change + timedelta(seconds=ops.scale_down_cooldown):
            return 0
        removing = ProviderMachine.objects.filter(
            pool=pool, state__in=[MachineState.DRAINING, MachineState.DELETING]
        ).count()
        members = capacity.member_nodes(pool).count() - removing
        due = surplus + [
            m
            for m in machines
            if m not in surplus
            and str(m.node_id) in underused
            and now - _parse(underused[str(m.node_id)]) >= timedelta(seconds=ops.scale_down_after)
        ]
        if not due:
            return 0
        # Idle now, but not unneeded while lease requests wait that a node like these would hold
        # (cluster-autoscaler, likewise, removes no node that pending pods could use): a machine
        # that just became ready must not be drained before the queue pass places work on it, or
        # a loaded control plane churns machines up and down for the same demand.
        waiting = list(LeaseRequest.objects.filter(pool=pool, state=LeaseRequestState.PENDING))
        if not surplus and waiting and _bins_needed(pool, ops, waiting)[0]:
            _held_back(
                pool, ScaleDirection.DOWN,
                f"{len(due)} idle node(s); held back: {len(waiting)} lease request(s) pending", actor,
            )  # fmt: skip
            return 0
        if members - 1 < ops.min_nodes:
            _held_back(
                pool, ScaleDirection.DOWN, f"{len(due)} idle node(s); held back: at min_nodes {ops.min_nodes}", actor
            )
            return 0
        # Every candidate gets its own answer: one blocked node never stops the others.
        candidates: list[dict] = []
        for machine in due:
            node = machine.node
            ok, why = replaceable(node)
            if not ok:
                candidates.append({"node_id": str(node.pk), "node": str(node), "reason": why})
                continue
            try:
                with transaction.atomic():  # the machine's move and the node's drain, or neither
                    # A following pass (which takes no pool lock) may have moved the machine since
                    # it was read, when its node was lost or retired: then it is not ours to remove.
                    if not _moved(machine, "drain"):
                        candidates.append(
                            {"node_id": str(node.pk), "node": str(node), "reason": "machine moved on meanwhile"}
                        )
                        continue
                    disruption.disrupt(
                        node=node,
                        reason=DisruptionReason.SCALE_DOWN,
                        owner=outofservice.AUTOSCALER,
                        policy=ops.drain_policy,
                        why=f"scale-down: surge node of upgrade {_surge_of(machine)}, which ended"
                        if machine in surplus
                        else f"scale-down: below {ops.scale_down_utilization:.0%} for {ops.scale_down_after}s",
                        timeout=ops.drain_timeout,
                        now=now,
                    )
            except disruption.DisruptionBlocked as blocked:
                blocked.record()  # outside the rolled-back savepoint, so the node shows it
                candidates.append({"node_id": str(node.pk), "node": str(node), "reason": blocked.verdict.describe()})
                continue
            except Problem as exc:  # the node changed since it was read (an operator, a rule): not now
                candidates.append({"node_id": str(node.pk), "node": str(node), "reason": str(exc.detail)})
                continue
            ops.last_scale_down_at = now
            ops.underused_since = {k: v for k, v in underused.items() if k != str(node.pk)}
            ops.save(update_fields=["last_scale_down_at", "underused_since", "updated_at"])
            _decide(
                pool,
                ScaleDirection.DOWN,
                ScaleOutcome.REQUESTED,
                1,
                (
                    f"surge node {node} of upgrade {_surge_of(machine)}, which ended"
                    if machine in surplus
                    else f"node {node} below {ops.scale_down_utilization:.0%} utilization for {ops.scale_down_after}s"
                )
                + " and its leases can be placed elsewhere: cordon, drain, delete",
                actor,
                node_id=str(node.pk),
                machine=machine.name,
                candidates=candidates,
            )
            return 1
        _held_back(
            pool,
            ScaleDirection.DOWN,
            f"{len(due)} idle node(s); held back: "
            + "; ".join(f"{c['node']}: {c['reason']}" for c in candidates[:3])
            + (f"; and {len(candidates) - 3} more" if len(candidates) > 3 else ""),
            actor,
            candidates=candidates,
        )
    return 0


def _replacing(machine: ProviderMachine) -> bool:
    """A consolidation replacement whose old node is not taken out yet: idle on purpose, it waits
    for the work it was launched for (operations.consolidation), so scale-down leaves it alone."""
    data = (machine.decision.data or {}) if machine.decision_id else {}
    if data.get("consolidation") != "replace":
        return False
    return ProviderMachine.objects.filter(name=data.get("machine"), state=MachineState.READY).exists()


def _surge_of(machine: ProviderMachine) -> str | None:
    """The upgrade id a surge machine was asked for (``ScaleDecision.data.upgrade_id``), or None."""
    return ((machine.decision.data or {}) if machine.decision_id else {}).get("upgrade_id")


def _parse(value: str):

    return datetime.fromisoformat(value)
