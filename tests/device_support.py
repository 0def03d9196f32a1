"""Devices for tests: wire devices as an agent reports them, and GPU nodes ready for grants."""

from __future__ import annotations

from django.utils import timezone

from fleet import devices as fleet_devices
from fleet.events import Actor
from fleet.models import Node

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-40GB"


def gpu(index: int, *, node: str = "n", model: str = H100, memory: int = 80 * 2**30, group: str | None = None,
        numa: int | None = None, **extra) -> dict:  # fmt: skip
    """One GPU as DEVICES-WIRE.md describes it; its id is unique per ``node`` tag and index."""
    return {
        "id": f"GPU-{node}-{index:04d}",
        "type": "nvidia.com/gpu",
        "index": index,
        "model": model,
        "memory_bytes": memory,
        "pci_bus_id": f"00000000:{index + 16:02x}:00.0",
        "numa_node": numa if numa is not None else index // 4,
        "interconnect_group": group if group is not None else f"nvlink-{index // 4}",
        "driver_version": "550.54.15",
        "cuda_version": "12.4",
        **extra,
    }


def gpus(count: int = 8, **kwargs) -> list[dict]:
    return [gpu(i, **kwargs) for i in range(count)]


def report_devices(node: Node, devices: list[dict] | None, *, boot_id: str | None = None, now=None) -> dict:
    """Apply a device report to ``node`` through the service (what a status report does)."""
    parsed, refusals = fleet_devices.parse_devices(devices)
    fresh = Node.objects.select_related("pool").get(pk=node.pk)
    return fleet_devices.apply_report(
        node=fresh, devices=parsed, refusals=refusals, boot_id=boot_id, actor=Actor.for_node(fresh),
        now=now or timezone.now(), force=True,
    )  # fmt: skip


def make_gpu_node(pool=None, *, count: int = 8, tag: str = "n", verified: bool = True, **gpu_kwargs):
    """A schedulable node with ``count`` verified GPUs (rows and the count resource). Returns (node, secret)."""
    from tests.factories import make_schedulable_node

    node, secret = make_schedulable_node(pool, resources={"cpu": 64000, "memory": 2**38})
    report_devices(node, gpus(count, node=tag, **gpu_kwargs))
    if verified:
        fleet_devices.verify_node_devices(node=node, actor=Actor.system("test"))
        fleet_devices.sync_counts(Node.objects.select_related("pool").get(pk=node.pk))
    node.refresh_from_db()
    return node, secret


def claimed_disagreements() -> list[str]:
    """Devices whose ``claimed`` mirror disagrees with the live holds recomputed from scratch (a
    live LeaseDevice on the device, or on a MIG instance of it): ``["<device id>: stored X,
    recomputed Y"]``, empty when they agree."""
    from fleet.models import Device
    from leases.models import LeaseDevice

    live = LeaseDevice.objects.filter(live=True)
    held = set(live.values_list("device_id", flat=True))
    parents = set(live.exclude(device__parent_device_id="").values_list("device__node_id", "device__parent_device_id"))
    out = []
    for pk, node_id, device_id, claimed in Device.objects.filter(retired_at__isnull=True).values_list(
        "pk", "node_id", "device_id", "claimed"
    ):
        recomputed = pk in held or (node_id, device_id) in parents
        if claimed != recomputed:
            out.append(f"{device_id}: stored {claimed}, recomputed {recomputed}")
    return out
