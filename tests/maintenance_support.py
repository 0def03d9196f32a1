"""Helpers for the maintenance tests: leases placed by hand and heartbeats simulated at the row level.

The lease and heartbeat services are built on other branches; these helpers write the same rows
they would (a lease adds its resources to ``NodeResource.allocated``; a status report stamps
``Node.last_heartbeat_at``, ``Node.last_status_report_at`` and ``Lease.last_reported_at`` of the
leases it lists).
"""

from __future__ import annotations

from datetime import timedelta

from django.db.models import F
from django.utils import timezone

from fleet.models import Node, NodeResource
from leases.models import FencingSequence, Lease


def make_lease(
    node: Node,
    workload_id: str,
    *,
    group: str = "",
    resources: dict[str, int] | None = None,
    ttl: int = 600,
    state: str = "active",
    priority: int = 0,
) -> Lease:
    resources = resources if resources is not None else {"cpu": 1000, "memory": 2**30}
    FencingSequence.objects.get_or_create(workload_id=workload_id)
    FencingSequence.objects.filter(workload_id=workload_id).update(last_token=F("last_token") + 1)
    token = FencingSequence.objects.get(workload_id=workload_id).last_token
    now = timezone.now()
    lease = Lease.objects.create(
        workload_id=workload_id,
        fencing_token=token,
        node=node,
        node_incarnation=node.incarnation,
        pool=node.pool,
        state=state,
        resources=resources,
        group=group,
        priority=priority,
        ttl_seconds=ttl,
        expires_at=now + timedelta(seconds=ttl),
        granted_at=now,
    )
    for name, amount in resources.items():
        NodeResource.objects.filter(node=node, name=name).update(allocated=F("allocated") + amount)
    return lease


def heartbeat(node: Node, *leases: Lease, at=None) -> None:
    """A heartbeat received ``at`` that lists exactly ``leases``."""
    at = at or timezone.now()
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=at, last_status_report_at=at)
    Lease.objects.filter(pk__in=[lease.pk for lease in leases]).update(last_reported_at=at)
    node.refresh_from_db()


def allocated(node: Node, name: str = "cpu") -> int:
    return NodeResource.objects.get(node=node, name=name).allocated


def act(api, node: Node, action: str, body: dict | None = None, *, version: int | None = None, query: str = ""):
    """POST an operator action with If-Match set to ``version`` (default: the node's current version)."""
    if version is None:
        node.refresh_from_db()
        version = node.version
    headers = {"HTTP_IF_MATCH": f'"{version}"'}
    return api.post(f"/api/v1/nodes/{node.pk}/{action}{query}", body or {"reason": "test"}, format="json", **headers)


def run_for(traveller, seconds: float, *, step: float = 30) -> None:
    """Move ``traveller`` (a time_machine traveller) ``seconds`` ahead with the control plane
    running meanwhile: its clock is observed every ``step`` seconds, as the periodic sweeps do.
    A bare jump of more than ``NODEPOOL["CLOCK_JUMP_THRESHOLD"]`` would be a detected gap
    (fleet.clock), during which deadlines stand still."""
    from fleet import clock

    remaining = seconds
    while remaining > 0:
        move = min(step, remaining)
        traveller.shift(move)
        remaining -= move
        clock.observe()
