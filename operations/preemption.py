"""Spot preemption: a notice with a deadline drains the node at once, its work requeued elsewhere.

A notice comes from the node's agent (``POST /nodes/{id}/preemption-notice``), from the provider
(a signed ``POST /pools/{name}/preemption-notices``) or from an operator. The node is cordoned
by ``system:preemption`` and drained with the ``checkpoint`` policy by a margin before the
notice's deadline (:func:`drain_deadline`), and a replacement node is asked of the provider at
once (:func:`operations.launches.request_replacement`):
workloads that can checkpoint do so and move early, the rest are revoked at the deadline. Every
lease a system drain ends is requeued for its client (:func:`requeue_evicted_lease`), for a
preemption in the pool's fallback pool when one is configured.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.db.models import Count, F
from django.db.models.functions import TruncDate
from django.utils import timezone

from fleet.choices import Lifecycle
from fleet.errors import NODE_NOT_FOUND
from fleet.events import Actor, record_event
from fleet.models import Node, Pool
from leases.choices import LeaseState
from leases.requeue import requeue_lease
from maintenance import drains
from maintenance.choices import DrainState, EvictionPolicy
from maintenance.models import Drain
from nodepool import fsm
from nodepool.api.problems import Conflict, NotFound, Unprocessable
from nodepool.celery import app as celery_app

from . import conf, event_types, machines, outofservice
from .choices import PreemptionState
from .errors import INVALID_DEADLINE_RANGE, POOL_NOT_SPOT
from .models import Preemption
from .upgrade_plan import pool_operations

logger = logging.getLogger(__name__)
MAX_NOTICE = timedelta(hours=24)
# A drain that finished this long ago no longer claims the leases that end on its node.
RECENT_DRAIN = timedelta(seconds=30)


def preemption_notice(*, node_id, deadline: datetime, source: str, actor: Actor, now=None) -> tuple[Preemption, bool]:
    """Record a preemption notice for a spot node and drain it at once with that deadline.

    Idempotent per node: a second notice while the first is open returns it (``created`` False),
    moving the drain's deadline earlier if the new one is sooner.

    Returns ``(preemption, created)``. Raises: NotFound (404 ``node_not_found``), Conflict (409
    ``pool_not_spot``, ``transition_not_allowed`` for a node that cannot drain), Unprocessable (422
    ``deadline_out_of_range``, deprecated_code ``invalid_deadline``: not in the future, or more
    than 24 h ahead).
    """
    now = now or timezone.now()
    if deadline <= now or deadline - now > MAX_NOTICE:
        raise Unprocessable("deadline must be in the future and at most 24 hours ahead.", INVALID_DEADLINE_RANGE)
    node = Node.objects.select_related("pool").filter(pk=node_id).first()
    if node is None:
        raise NotFound(f"No node {node_id}.", NODE_NOT_FOUND)
    ops = pool_operations(node.pool)
    if not ops.spot:
        raise Conflict(f"Pool {node.pool.name!r} is not a spot pool.", POOL_NOT_SPOT)
    existing = Preemption.objects.filter(node=node, state=PreemptionState.DRAINING).first()
    if existing is not None:
        if deadline < existing.deadline:
            _move_deadline_earlier(existing, deadline, actor, now)
        return existing, False
    try:
        with transaction.atomic():
            # Notices for one node take turns on its row, and each judges the node as it is now:
            # a concurrent notice may have drained it already (its drain can even have finished,
            # with nothing to wait for), which the node read above cannot know. The node row alone
            # (of=self): its pool is only named, and a joined pool row locked too would serialise
            # the pool's node actions and deadlock with pool_update (pool, then its nodes).
            node = Node.objects.select_for_update(no_key=True, of=("self",)).select_related("pool").get(pk=node.pk)
            earlier = Preemption.objects.filter(node=node).order_by("-received_at", "-pk").first()
            if earlier is not None and (
                earlier.state == PreemptionState.DRAINING
                or (node.lifecycle != Lifecycle.READY and now - earlier.received_at < MAX_NOTICE)
            ):
                return earlier, False  # the same machine's notice, already acted on
            preemption = Preemption.objects.create(
                node=node,
                pool=node.pool,
                source=source,
                deadline=deadline,
                received_at=now,
                fallback_pool=ops.fallback_pool,
            )
            record_event(
                node,
                event_types.PREEMPTION,
                actor,
                to_state=PreemptionState.DRAINING,
                reason=f"preemption notice from the {source}; deadline {deadline.isoformat()}, "
                f"drain deadline {drain_deadline(deadline, now).isoformat()}",
                data={
                    "preemption_id": preemption.pk,
                    "deadline": deadline.isoformat(),
                    "drain_deadline": drain_deadline(deadline, now).isoformat(),
                    "source": source,
                    "fallback_pool": ops.fallback_pool.name if ops.fallback_pool_id else None,
                },
            )
            drain = _drain_now(node, drain_deadline(deadline, now), now)
            if drain is not None:
                Preemption.objects.filter(pk=preemption.pk).update(drain_id=drain.pk)
                preemption.drain_id = drain.pk
            # Tasks by name: operations.tasks runs this module (no import cycle).
            follow = celery_app.signature("operations.follow_preemption", args=[preemption.pk])
            transaction.on_commit(lambda: follow.apply_async(), robust=True)
            # Replacement capacity now, not once the evicted work comes back as pending requests.
            replace = celery_app.signature(
                "operations.request_replacement", args=[node.pool_id, preemption.pk, str(node.pk)]
            )
            transaction.on_commit(lambda: replace.apply_async(), robust=True)
    except IntegrityError:  # a concurrent notice for the same node won
        return Preemption.objects.get(node=node, state=PreemptionState.DRAINING), False
    return preemption, True


def drain_deadline(deadline: datetime, now: datetime) -> datetime:
    """The drain's deadline for a notice ending at ``deadline``: a margin before it, the larger of
    ``PREEMPTION_MARGIN_FRACTION`` of the notice (default 10 %) and ``PREEMPTION_MARGIN_MIN``
    seconds (default 10), never before ``now`` — so work revoked at the drain's deadline is gone,
    and requeued, before the machine is."""
    notice = (deadline - now).total_seconds()
    margin = max(float(conf.get("PREEMPTION_MARGIN_MIN")), notice * float(conf.get("PREEMPTION_MARGIN_FRACTION")))
    return max(now, deadline - timedelta(seconds=margin))


def _drain_now(node: Node, deadline, now) -> Drain | None:
    if node.lifecycle == Lifecycle.READY:
        return outofservice.take_out_of_service(
            node=node,
            owner=outofservice.PREEMPTION,
            reason="spot preemption notice",
            policy=EvictionPolicy.CHECKPOINT,
            deadline=deadline,
            now=now,
        )
    active = Drain.objects.filter(node=node, state=DrainState.ACTIVE).first()
    if active is not None and active.deadline > deadline:
        return drains.change_drain_deadline(
            drain_id=active.pk,
            expected_version=active.version,
            deadline=deadline,
            reason="spot preemption notice: the machine goes away sooner",
            actor=Actor.system(outofservice.PREEMPTION),
        )
    return active


def _move_deadline_earlier(preemption: Preemption, deadline, actor, now) -> None:
    with transaction.atomic():
        # The node first, as a drain does before a lease it ends updates this notice (requeue).
        node = Node.objects.select_for_update(no_key=True).get(pk=preemption.node_id)
        Preemption.objects.filter(pk=preemption.pk).update(deadline=deadline)
        preemption.deadline = deadline
        _drain_now(node, drain_deadline(deadline, now), now)
        record_event(
            node,
            event_types.PREEMPTION,
            actor,
            reason=f"deadline moved earlier to {deadline.isoformat()}",
            data={"preemption_id": preemption.pk},
        )


def requeue_evicted_lease(sender, *, lease, actor, now, to_state=None, **kwargs) -> None:
    """``lease_ended`` receiver: requeue the work of a lease a system drain ended.

    Only leases the control plane ended (``revoked`` or ``lost``) on a node whose latest drain was
    requested by ``system:upgrade``, ``system:autoscaler`` or ``system:preemption``; a lease its
    client released or let expire is the client's business. For a preemption the request goes to
    the pool's fallback pool when one is set.
    """
    if (to_state or lease.state) not in (LeaseState.REVOKED, LeaseState.LOST):
        return
    drain = (
        Drain.objects.filter(node_id=lease.node_id, requested_by_name__in=outofservice.SYSTEM_OWNERS)
        .order_by("-created_at")
        .first()
    )
    if drain is None or (drain.finished_at is not None and drain.finished_at < now - RECENT_DRAIN):
        return
    pool = lease.pool
    preemption = None
    if drain.requested_by_name == outofservice.PREEMPTION:
        preemption = Preemption.objects.filter(node_id=lease.node_id).order_by("-received_at").first()
        if preemption is not None and preemption.fallback_pool_id:
            pool = Pool.objects.get(pk=preemption.fallback_pool_id)
    request = requeue_lease(
        lease,
        pool=pool,
        actor=Actor.system(drain.requested_by_name),
        now=now,
        reason=f"{drain.requested_by_name} drained node {lease.node_id}",
    )
    if request is not None and preemption is not None:
        Preemption.objects.filter(pk=preemption.pk).update(leases_requeued=F("leases_requeued") + 1)


def sweep(*, actor: Actor, now=None) -> int:
    """Advance every open preemption (:func:`follow`). Returns how many were closed.

    One that fails (a lock timeout, a deadlock victim) is logged and tried again next sweep; the
    others are still followed.
    """
    closed = 0
    for pk in Preemption.objects.filter(state=PreemptionState.DRAINING).values_list("pk", flat=True):
        try:
            closed += follow(preemption_id=pk, actor=actor, now=now)
        except Exception:
            logger.exception("preemption %s could not be followed; the next sweep tries again", pk)
    return closed


def follow(*, preemption_id, actor: Actor, now=None) -> bool:
    """Evaluate an open preemption's drain now (checkpointed work leaves at once instead of at the
    maintenance sweep's next run), and close the preemption once its node is drained; a machine
    the provider made is then deleted. Returns True when this call closed it."""

    now = now or timezone.now()
    closed = 0
    for preemption in Preemption.objects.filter(pk=preemption_id, state=PreemptionState.DRAINING).select_related(
        "node"
    ):
        if preemption.drain_id and preemption.node.lifecycle == Lifecycle.DRAINING:
            drains.evaluate_drain(drain_id=preemption.drain_id, actor=actor, now=now)
        node = Node.objects.get(pk=preemption.node_id)
        if node.lifecycle not in (Lifecycle.MAINTENANCE, Lifecycle.RETIRED, Lifecycle.QUARANTINED):
            continue
        if not fsm.move(Preemption.objects.filter(pk=preemption.pk), "close", finished_at=now):
            continue
        record_event(
            node,
            event_types.PREEMPTION,
            actor,
            from_state=PreemptionState.DRAINING,
            to_state=PreemptionState.DRAINED,
            reason="preempted node drained",
            data={"preemption_id": preemption.pk, "leases_requeued": preemption.leases_requeued},
        )
        try:
            machines.remove_machine_of(node, actor=actor, reason="spot machine preempted")
        except Exception:
            logger.exception("preemption %s: the machine could not be removed", preemption.pk)
        closed += 1
    return bool(closed)


def preemptions_per_day(pool: Pool, *, days: int = 7, now=None) -> list[dict]:
    """``[{"date": "YYYY-MM-DD", "preemptions": n}]`` for the last ``days`` days (UTC), oldest first."""
    now = now or timezone.now()
    since = (now - timedelta(days=days - 1)).replace(hour=0, minute=0, second=0, microsecond=0)
    rows = (
        Preemption.objects.filter(pool=pool, received_at__gte=since)
        .annotate(day=TruncDate("received_at"))
        .values("day")
        .annotate(n=Count("pk"))
        .order_by("day")
    )
    return [{"date": row["day"].isoformat(), "preemptions": row["n"]} for row in rows]
