"""A small, realistic fleet for the console's browser tests and screenshots (issue 33 items 2, 5, 6).

Two pools and eight nodes with long, real-looking hostnames, so that a row of the node list is as
wide as it will be in production: GPU nodes with devices of two models and leases on them, a
cordoned node with a long reason, a quarantined one, an unreachable one and a lost one (their
readiness and health must read ``unknown``), a draining one and a node that never reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.utils import timezone

from fleet.choices import Liveness
from fleet.events import Actor
from fleet.models import Device, Node
from maintenance import drains
from maintenance import services as maintenance
from tests.device_support import A100, make_gpu_node
from tests.factories import PoolFactory, make_schedulable_node, place_test_hold
from tests.maintenance_support import make_lease

OPS = Actor.system("ops")


@dataclass
class World:
    gpu_busy: Node  # 8 GPUs, 3 leased: free "5×H100" beside its cpu and memory
    gpu_cordoned: Node
    gpu_unreachable: Node
    general_lost: Node
    general_quarantined: Node
    general_draining: Node
    general_idle: Node
    general_silent: Node  # never heard from

    @property
    def nodes(self) -> list[Node]:
        return list(vars(self).values())


def _silence(node: Node, liveness: str, seconds_ago: int) -> Node:
    """``node`` last heard from ``seconds_ago`` and judged ``liveness`` (what the sweep writes)."""
    Node.objects.filter(pk=node.pk).update(
        liveness=liveness, last_heartbeat_at=timezone.now() - timedelta(seconds=seconds_ago)
    )
    node.refresh_from_db()
    return node


def _gpu_node(pool, tag: str) -> Node:
    """A schedulable node with 8 verified H100s (tests.device_support), named like its rack."""
    node, _ = make_gpu_node(pool, tag=tag)
    Node.objects.filter(pk=node.pk).update(hostname=f"rack12-gpu-{tag}.fra1.example.net")
    node.refresh_from_db()
    return node


def small_fleet() -> World:
    gpu = PoolFactory(name="gpu-h100", description="training: 8-GPU nodes")
    general = PoolFactory(name="general", description="batch and services")

    busy = _gpu_node(gpu, "a1")
    Device.objects.filter(node=busy, index__gte=6).update(model=A100)
    for workload in ("train-llm-7b", "eval-nightly", "render-42"):
        make_lease(busy, workload, resources={"cpu": 8000, "memory": 64 * 2**30, "nvidia.com/gpu": 1})

    cordoned = _gpu_node(gpu, "a2")
    place_test_hold(cordoned, "user:olivia-operator", "BMC firmware update booked with the vendor for Thursday")

    unreachable = _gpu_node(gpu, "a3")
    _silence(unreachable, Liveness.UNREACHABLE, 95)

    lost, _ = make_schedulable_node(general, hostname="rack07-cpu-b1.fra1.example.net")
    _silence(lost, Liveness.LOST, 3 * 3600)

    quarantined, _ = make_schedulable_node(general, hostname="rack07-cpu-b2.fra1.example.net")
    maintenance.quarantine_node(
        node_id=quarantined.pk, reason="checksum of the agent binary changed", actor=OPS, evidence={"sha256": "9f2c"}
    )

    draining, _ = make_schedulable_node(general, hostname="rack07-cpu-b3.fra1.example.net")
    make_lease(draining, "etl-orders", resources={"cpu": 2000, "memory": 4 * 2**30})
    draining.refresh_from_db()
    drains.start_drain(
        node_id=draining.pk,
        expected_version=draining.version,
        policy="wait",
        deadline=timezone.now() + timedelta(hours=2),
        reason="kernel 6.8 rollout",
        actor=OPS,
    )

    idle, _ = make_schedulable_node(general, hostname="rack07-cpu-b4.fra1.example.net",
                                    resources={"cpu": 32000, "memory": 128 * 2**30})  # fmt: skip
    silent, _ = make_schedulable_node(general, hostname="rack07-cpu-b5.fra1.example.net")
    Node.objects.filter(pk=silent.pk).update(liveness=Liveness.UNKNOWN, last_heartbeat_at=None)

    return World(*(Node.objects.get(pk=n.pk) for n in (busy, cordoned, unreachable, lost, quarantined, draining,
                                                       idle, silent)))  # fmt: skip
