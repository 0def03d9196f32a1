"""Item 6 of the devices issue: pool capacity and placement previews count devices by type and
model, and a device failing while allocated never makes free capacity negative."""

from __future__ import annotations

import pytest
from django.utils import timezone

from fleet.events import Actor
from fleet.models import Device, NodeResource
from fleet.selectors import pool_capacity
from leases.lifecycle import end_lease
from leases.preview import placement_preview
from tests.device_support import A100, gpu, make_gpu_node, report_devices
from tests.factories import PoolFactory
from tests.support import grant, grant_status

pytestmark = pytest.mark.django_db
FATAL = {"xid_events": [{"xid": 79, "at": "2026-12-02T10:00:00Z", "message": "GPU has fallen off the bus"}]}
H100_GLOB = {"attribute": "model", "operator": "glob", "value": "*H100*"}


def test_pool_capacity_counts_devices_by_type_and_model_and_a_fault_while_allocated_is_never_negative(
    client_user, operator_api
):
    pool = PoolFactory(name="gpu")
    node, _ = make_gpu_node(pool, count=8)
    make_gpu_node(pool, tag="a", count=2, model=A100, memory=40 * 2**30)
    lease = grant(client_user, "all", pool="gpu", resources={"nvidia.com/gpu": 8}, tolerations=[{"operator": "Exists"}])
    assert len(lease.devices) == 8 and all(d["id"].startswith("GPU-n-") for d in lease.devices)
    # two of the allocated GPUs fall off the bus; the lease tolerates it and keeps them
    report_devices(node, [gpu(i, health=FATAL) if i < 2 else gpu(i) for i in range(8)])
    gpus = NodeResource.objects.get(node=node, name="nvidia.com/gpu")
    # the held failed GPUs stay counted while the lease that holds them lives
    assert (gpus.allocatable, gpus.allocated, gpus.free) == (8, 8, 0)

    capacity = pool_capacity(pool)
    assert capacity["resources"]["nvidia.com/gpu"]["free"] == 2  # the A100 node's two, never -2 + 2
    assert capacity["devices"] == {
        "nvidia.com/gpu": {
            "H100": {"total": 8, "allocatable": 6, "allocated": 8, "free": 0, "health": {"healthy": 6, "unhealthy": 2}},
            "A100": {"total": 2, "allocatable": 2, "allocated": 0, "free": 2, "health": {"healthy": 2}},
        }
    }
    answer = operator_api.get("/api/v1/pools/gpu/capacity").json()
    assert answer["devices"]["nvidia.com/gpu"]["H100"]["free"] == 0


def test_a_gpu_that_fails_while_held_is_not_subtracted_twice_from_the_free_count(client_user):
    """One GPU of eight, held by a tolerating lease, falls off the bus: seven GPUs are free, not
    six; once the lease ends, the failed GPU leaves the count and the seven stay free."""
    pool = PoolFactory(name="gpu")
    node, _ = make_gpu_node(pool, count=8)
    lease = grant(client_user, "one", pool="gpu", resources={"nvidia.com/gpu": 1}, tolerations=[{"operator": "Exists"}])
    held = lease.devices[0]["index"]
    report_devices(node, [gpu(i, health=FATAL) if i == held else gpu(i) for i in range(8)])
    gpus = NodeResource.objects.get(node=node, name="nvidia.com/gpu")
    assert (gpus.allocatable, gpus.allocated, gpus.free) == (8, 1, 7)
    assert grant_status(client_user, "seven", pool="gpu", resources={"nvidia.com/gpu": 7}) == 201

    assert end_lease(lease.pk, to_state="released", reason="done", now=timezone.now(), actor=Actor.system("t"))
    gpus.refresh_from_db()
    assert (gpus.allocatable, gpus.allocated, gpus.free) == (7, 7, 0)
    assert grant_status(client_user, "more", pool="gpu", resources={"nvidia.com/gpu": 1}) == 409


def test_an_unknown_self_reported_model_is_counted_as_other():
    pool = PoolFactory(name="gpu")
    make_gpu_node(pool, count=1, model="Totally Real GPU 9000")
    assert pool_capacity(pool)["devices"]["nvidia.com/gpu"] == {
        "other": {"total": 1, "allocatable": 1, "allocated": 0, "free": 1, "health": {"healthy": 1}}
    }


def test_a_preview_of_a_device_constrained_request_counts_matching_devices_not_the_count(client_user):
    pool = PoolFactory(name="gpu")
    node, _ = make_gpu_node(pool, count=8)
    Device.objects.filter(node=node, index__gte=4).update(model=A100)  # 4 H100 and 4 A100 on one node
    make_gpu_node(pool, tag="a", count=8, model=A100, memory=40 * 2**30)
    h100s = {"type": "nvidia.com/gpu", "count": 2, "constraints": [H100_GLOB]}
    answer = placement_preview(data={"pool": "gpu", "devices": [h100s], "count": 5})
    (only,) = answer["pools"]
    # 16 GPUs by count, but only the first node's four H100s match: two leases of two
    assert (only["fits"], only["placeable"]) == (2, False)
    assert only["placements"] == [{"node_id": str(node.pk), "hostname": node.hostname, "leases": 2}]
    grant(client_user, "h", pool="gpu", devices=[h100s])
    assert placement_preview(data={"pool": "gpu", "devices": [h100s]})["fits"] == 1
    # a count-only request still counts by the count resource: 16 − 2 held
    assert placement_preview(data={"pool": "gpu", "resources": {"nvidia.com/gpu": 1}})["fits"] == 14


def test_a_request_class_of_a_shape_with_device_requests_counts_what_the_devices_give():
    from fleet.events import Actor
    from leases.preview import request_class_fits
    from leases.services import shape_create

    pool = PoolFactory(name="gpu", request_classes=[{"name": "two-h100", "shape": "two-h100"}])
    node, _ = make_gpu_node(pool, count=8)
    Device.objects.filter(node=node, index__gte=4).update(model=A100)  # 4 H100 and 4 A100
    shape_create(
        name="two-h100", resources={"cpu": "1"}, actor=Actor.system("test"),
        devices=[{"type": "nvidia.com/gpu", "count": 2, "constraints": [H100_GLOB]}],
    )  # fmt: skip
    assert request_class_fits(pool) == [{"name": "two-h100", "fits": 2}]  # not 8 // 2
