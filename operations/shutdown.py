"""Graceful node shutdown: a node's own agent drains its node before a planned shutdown.

Kubernetes' graceful node shutdown (the kubelet delays a shutdown to end its pods) and Nomad's
``drain_on_shutdown`` do this from the node; here the agent asks the control plane with its own
credential — a permission scoped to its node (``IsNodeSelf``): a node drains only itself. The
drain follows the pool's ``drain_policy``, ends by the agent's deadline (at most the pool's
``drain_timeout`` from now), and the node then goes to maintenance like any drained node; an
operator (or the upgrade that restarts it) returns it to service. The drain is requested by
``system:shutdown``, one of :data:`operations.outofservice.SYSTEM_OWNERS`, so the leases it
ends are requeued for their clients like those of an upgrade. Pool disruption budgets do not
apply (the shutdown happens whatever we decide, like a spot preemption); workload budgets do,
until the deadline.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from fleet.choices import Lifecycle
from fleet.events import Actor
from fleet.models import Node
from maintenance import drains
from maintenance.choices import DrainState
from maintenance.models import Drain
from nodepool.api.errors import TRANSITION_NOT_ALLOWED
from nodepool.api.problems import Conflict, Unprocessable

from .errors import INVALID_DEADLINE_RANGE
from .outofservice import SHUTDOWN
from .upgrade_plan import pool_operations


def shutdown_drain(*, node: Node, deadline: datetime | None, reason: str, now=None) -> tuple[Drain, bool]:
    """Drain ``node`` (its own agent asks) before a planned shutdown. Idempotent: a node already
    draining returns its active drain (its deadline moved earlier if this one is sooner).

    ``deadline``: when the machine goes down (default and cap: now + the pool's ``drain_timeout``).
    Returns ``(drain, created)``. Raises: Unprocessable (422 ``invalid_deadline``: not in the
    future), Conflict (409 ``transition_not_allowed``: the node is neither ready nor draining).
    """
    now = now or timezone.now()
    ops = pool_operations(node.pool)
    latest = now + timedelta(seconds=ops.drain_timeout)
    if deadline is not None and deadline <= now:
        raise Unprocessable("deadline must be in the future.", INVALID_DEADLINE_RANGE)
    deadline = min(deadline or latest, latest)
    actor = Actor.system(SHUTDOWN)
    with transaction.atomic():
        locked = Node.objects.select_for_update(no_key=True, of=("self",)).get(pk=node.pk)
        active = Drain.objects.filter(node=locked, state=DrainState.ACTIVE).first()
        if active is not None:
            if active.deadline > deadline:
                active = drains.change_drain_deadline(
                    drain_id=active.pk,
                    expected_version=active.version,
                    deadline=deadline,
                    reason="graceful shutdown: the node goes down sooner",
                    actor=actor,
                )
            return active, False
        if locked.lifecycle != Lifecycle.READY:
            raise Conflict(
                f"The node is {locked.lifecycle}: only a ready node drains for a shutdown.",
                TRANSITION_NOT_ALLOWED,
                lifecycle=locked.lifecycle,
            )
        drain = drains.start_drain(
            node_id=locked.pk,
            expected_version=locked.version,
            policy=ops.drain_policy,
            deadline=deadline,
            reason=f"{SHUTDOWN}: graceful shutdown: {reason or 'planned by the node'}",
            actor=actor,
            now=now,
        )
    return drain, True
