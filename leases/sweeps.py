"""Periodic jobs: lease expiry, queued-request placement, capacity consistency.

Each is safe to run twice at once: expiry claims each lease by compare-and-swap
(:func:`leases.lifecycle.end_lease`), placement claims each request in the grant's own
transaction, and the consistency check confirms drift under row locks before reporting it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from datetime import timedelta

from django.core.cache import cache
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from fleet import clock
from fleet import taints as taint_times
from fleet.events import Actor, record_event
from fleet.models import NodeResource
from nodepool import fsm
from nodepool.api.problems import Problem

from . import event_types, placement
from .choices import LIVE_LEASE_STATES, LeaseRequestState, LeaseState
from .device_faults import evict_device_faults
from .grant import place
from .lifecycle import end_lease
from .models import ConsistencyReport, Lease, LeaseRequest
from .services import resolve_pool, resolve_shape
from .spec import parse_spec

logger = logging.getLogger(__name__)
EXPIRY_BATCH = 1000
QUEUE_BATCH = 200
# A queued request that still does not fit is explained again at most this often (seconds): the
# explanation reads the whole pool, and a queue pass may retry every pending request each second.
EXPLANATION_TTL = 30


def expire_leases(*, now=None, actor: Actor | None = None) -> int:
    """End every live lease past ``expires_at`` as ``expired`` and return its capacity. Returns how many."""

    now = now or timezone.now()
    actor = actor or Actor.system("leases.expire_leases")
    # A clock jump or outage since the last sweep is paused first (leases shifted), so it never
    # expires a lease (fleet.clock).
    clock.observe(now=now, actor=actor)
    due = Lease.objects.filter(state__in=LIVE_LEASE_STATES, expires_at__lte=now).order_by("expires_at")
    expired = 0
    for lease_id in list(due.values_list("pk", flat=True)[:EXPIRY_BATCH]):
        try:
            if end_lease(
                lease_id,
                to_state=LeaseState.EXPIRED,
                actor=actor,
                now=now,
                expiring=True,
                reason="the lease's TTL passed without renewal",
            ):
                expired += 1
        except Exception:  # one bad row must not stop the sweep (healthchecks' sendalerts habit)
            logger.exception("could not expire lease %s", lease_id)
    return expired


def place_pending_requests(*, now=None, actor: Actor | None = None) -> dict:
    """Try to place pending lease requests, highest priority first, then oldest first.

    Returns ``{"placed": n, "pending": m}``. A request that cannot be placed keeps waiting with
    its reasons refreshed; one whose spec no longer validates (a pool deleted…) is cancelled.
    """
    now = now or timezone.now()
    actor = actor or Actor.system("leases.place_pending_requests")
    placed = pending = 0
    queue = LeaseRequest.objects.filter(state=LeaseRequestState.PENDING).order_by("-priority", "created_at", "pk")
    for request in list(queue[:QUEUE_BATCH]):
        try:
            spec = parse_spec(request.spec)
            pool = resolve_pool(spec.pool)
            spec, shape = resolve_shape(spec)
        except Problem as exc:
            fsm.move(
                LeaseRequest.objects.filter(pk=request.pk),
                "cancel",
                message=str(exc.detail),
                version=F("version") + 1,
            )
            continue
        live = Lease.objects.filter(workload_id=spec.workload_id, state__in=LIVE_LEASE_STATES)
        if live.exists():
            pending += 1  # the workload still runs elsewhere; wait until that lease ends
            continue
        try:
            lease, census = place(
                pool=pool,
                spec=spec,
                shape=shape,
                client=request.client,
                idempotency_key="",
                request_hash=request.request_hash,
                data=request.spec,
                actor=actor,
                now=now,
                lease_request=request,
            )
        except IntegrityError as exc:
            pending += 1
            if live.exists():
                # A grant for the workload committed since the check above (a direct request, or
                # a pass placing another of its requests): wait for that lease, as above.
                logger.info("lease request %s: its workload got a live lease meanwhile; it waits", request.pk)
                continue
            # Anything else (a fencing sequence behind the workload's leases…) would fail every
            # pass the same way: say so where the client and the operator look, and go on.
            logger.exception("lease request %s could not be placed", request.pk)
            LeaseRequest.objects.filter(pk=request.pk, state=LeaseRequestState.PENDING).update(
                last_attempt_at=now, attempts=F("attempts") + 1, message=f"placement failed: {exc}"[:2000]
            )
            continue
        except DatabaseError:
            # A deadlock victim or a statement timeout under load: the grant's transaction rolled
            # back as a whole; this request waits for the next pass, and the rest go on.
            pending += 1
            logger.warning("lease request %s not placed this pass", request.pk, exc_info=True)
            continue
        if lease is not None:
            placed += 1
            continue
        pending += 1
        changes = {"last_attempt_at": now, "attempts": F("attempts") + 1}
        if cache.add(f"leases:explained:{request.pk}", 1, timeout=EXPLANATION_TTL) or not request.message:
            explanation = census or placement.diagnose(pool, dataclasses.replace(spec), now=now)
            changes.update(reasons=explanation["reasons"], message=explanation["message"])
        LeaseRequest.objects.filter(pk=request.pk, state=LeaseRequestState.PENDING).update(**changes)
    return {"placed": placed, "pending": pending}


def check_consistency(*, repair: bool = False, actor: Actor | None = None) -> ConsistencyReport:
    """Compare ``NodeResource.allocated`` with the sum of live leases, per node and resource.

    A first pass reads without locks; every apparent drift is then confirmed under a row lock on
    the node's resource rows (grants and releases update those rows, so they wait), which keeps a
    lease committed between the two reads from being reported as drift. With ``repair`` the
    counter is set to the sum. Drift is logged, stored in a :class:`ConsistencyReport` and written
    as an event on the node.
    """
    actor = actor or Actor.system("leases.check_consistency")
    leased: dict[tuple, int] = defaultdict(int)
    for node_id, resources in Lease.objects.filter(state__in=LIVE_LEASE_STATES).values_list("node_id", "resources"):
        for name, amount in (resources or {}).items():
            leased[(node_id, name)] += int(amount)
    # Counters that are not zero; a leased (node, resource) absent from them is at zero or has no
    # row at all. Two reads whatever the fleet's size (no IN list of every leased node, and no
    # query per leased resource: that made a check after a 10,000-node run never finish).
    allocated_now = {
        (node_id, name): allocated
        for node_id, name, allocated in NodeResource.objects.exclude(allocated=0).values_list(
            "node_id", "name", "allocated"
        )
    }
    suspects = {key[0] for key, allocated in allocated_now.items() if allocated != leased.get(key, 0)}
    suspects |= {key[0] for key, amount in leased.items() if amount and key not in allocated_now}
    drift = []
    for node_id in suspects:
        with transaction.atomic():
            locked = {r.name: r for r in NodeResource.objects.select_for_update().filter(node_id=node_id)}
            sums: dict[str, int] = defaultdict(int)
            for resources in Lease.objects.filter(node_id=node_id, state__in=LIVE_LEASE_STATES).values_list(
                "resources", flat=True
            ):
                for name, amount in (resources or {}).items():
                    sums[name] += int(amount)
            for name in set(locked) | set(sums):
                allocated = locked[name].allocated if name in locked else 0
                if allocated == sums.get(name, 0):
                    continue
                item = {"node_id": str(node_id), "resource": name, "allocated": allocated, "leased": sums.get(name, 0)}
                drift.append(item)
                logger.warning(
                    "capacity drift on node %s %s: allocated %s, live leases %s",
                    node_id,
                    name,
                    allocated,
                    sums.get(name, 0),
                )
                if repair and name in locked:
                    NodeResource.objects.filter(pk=locked[name].pk).update(allocated=sums.get(name, 0))
                record_event(
                    node_id,
                    event_types.LEASE,
                    actor,
                    reason="capacity drift" + (" repaired" if repair else ""),
                    data=item,
                )
    return ConsistencyReport.objects.create(
        nodes_checked=len({k[0] for k in leased} | {k[0] for k in allocated_now}),
        drift=drift,
        repaired=repair and bool(drift),
    )


def noexecute_deadline(lease: Lease, taints: list[dict], added: dict[str, str] | None = None, gaps=()):
    """When ``lease`` must end because of its node's ``NoExecute`` taints, or None if never.

    Kubernetes' taint manager (pkg/controller/tainteviction): a NoExecute taint the workload does
    not tolerate evicts it at once; one tolerated with ``tolerationSeconds`` evicts it that many
    seconds after the taint was added (or the lease granted, whichever is later); one tolerated
    without a limit never does. With several taints the earliest deadline wins.

    ``added`` is the node's ``taints_added_at`` map (:mod:`fleet.taints`): when each taint was put
    on the node. A taint with no recorded time counts from the grant. ``gaps`` are the clock gaps
    the control plane paused (:func:`fleet.clock.detected_gaps`): ``toleration_seconds`` count
    control-plane time, so a gap that began inside the toleration moves its end later.
    """
    tolerations = parse_spec(lease.spec).tolerations if lease.spec else ()
    deadline = None
    for taint in taints:
        if taint.get("effect") != "NoExecute":
            continue
        matching = [t for t in tolerations if t.tolerates(taint)]
        if not matching:
            return lease.granted_at
        if any(t.toleration_seconds is None for t in matching):
            continue
        since = max(filter(None, [lease.granted_at, taint_times.added_at(added, taint)]))
        until = since + timedelta(seconds=min(t.toleration_seconds for t in matching))
        until = clock.extend_past_gaps(since, until, gaps)
        deadline = until if deadline is None else min(deadline, until)
    return deadline


def evict_noexecute(*, now=None, actor: Actor | None = None) -> int:
    """Revoke live leases that their node's ``NoExecute`` taints no longer let run. Returns how many.

    Placement already keeps new leases off such nodes; this is the other half of the effect, for
    taints added while leases run. Safe to run twice at once: each revocation is a compare-and-swap
    (:func:`leases.lifecycle.end_lease`).
    """
    now = now or timezone.now()
    actor = actor or Actor.system("leases.evict_noexecute")
    # A gap since the last sweep is detected (and paused) before any toleration is judged.
    clock.observe(now=now, actor=actor)
    gaps = clock.detected_gaps()
    # A text match narrows the scan to nodes (or pools) that carry a NoExecute taint at all.
    tainted = Q(node__taints__icontains="NoExecute") | Q(pool__taints__icontains="NoExecute")
    evicted = 0
    leases = Lease.objects.filter(tainted, state__in=LIVE_LEASE_STATES).select_related("node", "pool")
    for lease in leases.iterator(chunk_size=500):
        try:
            taints = placement.node_taints(lease.node, lease.pool)
            deadline = noexecute_deadline(lease, taints, lease.node.taints_added_at, gaps)
        except Problem:  # a spec stored before today's validation: judge it without tolerations
            deadline = lease.granted_at
        if deadline is not None and deadline <= now:
            reason = "evicted: the node has a NoExecute taint this lease does not tolerate (any longer)"
            try:
                ended = end_lease(lease.pk, to_state=LeaseState.REVOKED, actor=actor, reason=reason, now=now)
            except Exception:  # one bad row must not stop the sweep, as in expire_leases
                logger.exception("could not evict lease %s", lease.pk)
                continue
            evicted += ended is not None
    # Device taints (KEP-5055's device taints): the same rules, per device the lease holds.
    return evicted + evict_device_faults(now=now, actor=actor)
