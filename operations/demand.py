"""Scale-up from pending demand (operations.autoscaler's scale-up step): which waiting lease requests
an empty node of the pool's template would hold, how many such nodes they need (first-fit
packing), the pool's limits (max_nodes, launches in flight, cool-down, back-off) and, while the
pool backs off, its fallback pools in order.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.db.models import F

from fleet.events import Actor, record_event
from fleet.models import Pool
from leases import event_types as lease_events
from leases.choices import LIVE_LEASE_STATES, LeaseRequestState
from leases.models import Lease, LeaseRequest
from leases.spec import parse_spec
from nodepool.api.problems import Problem

from . import capacity
from .choices import (
    MachineState,
    ProviderKind,
    ScaleDirection,
    ScaleOutcome,
)
from .launches import _call_provider, _decide, _held_back, _new_machines
from .models import PoolOperations, ProviderMachine

FRESH_SECONDS = 30


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
