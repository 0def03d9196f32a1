"""Taking a node out of service for a pool operation, and bringing it back.

The one place where upgrades, scale-down and preemption cordon and drain a node. The cordon is a
hold (:mod:`maintenance.holds`) owned by a system actor (``system:upgrade``,
``system:autoscaler``, ``system:preemption``): an operator's own cordon and uncordon never lift
it, and it stays until the operation brings the node back (:func:`return_to_service`). The
drain's ``requested_by_name`` and every event carry the same name, which is how the requeue hook
(:mod:`operations.preemption`) knows whose drain ended a lease.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from fleet import services as fleet_services
from fleet.events import Actor
from fleet.models import Node
from maintenance import drains, holds
from maintenance import services as maintenance_services
from maintenance.models import Drain

UPGRADE = "system:upgrade"
AUTOSCALER = "system:autoscaler"
PREEMPTION = "system:preemption"
DRIFT = "system:drift"
EXPIRY = "system:expiry"
REPAIR = "system:repair"
CONSOLIDATION = "system:consolidation"
SHUTDOWN = "system:shutdown"
# Every automated owner: its drains' evicted leases are requeued (operations.preemption), and its
# holds count as disrupting against the pool disruption budgets (operations.disruption).
SYSTEM_OWNERS = (UPGRADE, AUTOSCALER, PREEMPTION, DRIFT, EXPIRY, REPAIR, CONSOLIDATION, SHUTDOWN)


def take_out_of_service(
    *, node: Node, owner: str, reason: str, policy: str, deadline=None, timeout: int = 600, now=None
) -> Drain:
    """Cordon ``node`` on behalf of ``owner`` and drain it under ``policy`` by ``deadline``.

    ``deadline`` defaults to ``now + timeout`` seconds. The node's current version is the
    expected one: a change racing with the caller gets 412, and the caller tries again later.

    Raises: the errors of :func:`maintenance.drains.start_drain` (404, 409, 412, 422).
    """
    now = now or timezone.now()
    deadline = deadline or now + timedelta(seconds=timeout)
    actor = Actor.system(owner)
    with transaction.atomic():
        holds.place_hold(node, owner, reason, actor=actor, expected_version=node.version, now=now)
        version = Node.objects.filter(pk=node.pk).values_list("version", flat=True).get()
        return drains.start_drain(
            node_id=node.pk,
            expected_version=version,
            policy=policy,
            deadline=deadline,
            reason=f"{owner}: {reason}",
            actor=actor,
            now=now,
        )


def return_to_service(*, node: Node, owner: str, reason: str) -> Node:
    """Bring a node parked by ``owner`` back through admission (maintenance → admitting,
    rejected → pending → admitting, pending → admitting) and lift ``owner``'s hold; other
    actors' holds stay. Raises 409/412 as the services do."""
    actor = Actor.system(owner)
    with transaction.atomic():
        if node.lifecycle == "maintenance":
            node = maintenance_services.return_node_to_service(
                node_id=node.pk, expected_version=node.version, reason=f"{owner}: {reason}", actor=actor
            )
        else:
            if node.lifecycle == "rejected":
                node, _ = maintenance_services.release_node(
                    node_id=node.pk, expected_version=node.version, reason=f"{owner}: {reason}", actor=actor
                )
            node = fleet_services.node_admit(
                node_id=node.pk, expected_version=node.version, actor=actor, reason=f"{owner}: {reason}"
            )
        locked = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
        holds.remove_holds_where(locked, owner=owner, actor=actor, reason=reason, bump_version=True)
    return Node.objects.get(pk=node.pk)


def release_for_retry(*, node: Node, owner: str, reason: str) -> Node:
    """rejected → pending (a rolled-back node runs its previous version, then is admitted again)."""
    node, _ = maintenance_services.release_node(
        node_id=node.pk, expected_version=node.version, reason=f"{owner}: {reason}", actor=Actor.system(owner)
    )
    return node


def retire(*, node: Node, owner: str, reason: str) -> Node:
    """Retire a node whose machine is gone (scale-down, preemption); live leases are revoked."""
    return maintenance_services.retire_node(
        node_id=node.pk,
        expected_version=node.version,
        reason=f"{owner}: {reason}",
        actor=Actor.system(owner),
        force=True,
    )
