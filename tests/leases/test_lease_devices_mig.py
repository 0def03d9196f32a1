"""A GPU and its MIG instances exclude each other (issue 27 item 2): allocating one makes the others
unallocatable, in every count a person or placement reads (the node's count resources, pool
capacity, the node list's free devices, /metrics rows) and in the database (the partial unique
index on live LeaseDevice rows refuses the claim that would share a GPU with its slices)."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from fleet.devices import device_metric_rows, device_summary, sync_counts
from fleet.events import Actor
from fleet.models import Device, Node, NodeResource
from fleet.selectors import pool_capacity
from leases.lifecycle import end_lease
from leases.models import Lease, LeaseDevice
from leases.services import lease_create
from leases.sql import devices as device_sql
from tests.device_support import gpu, make_gpu_node, report_devices
from tests.factories import PoolFactory
from tests.support import grant_status

pytestmark = pytest.mark.django_db

PROFILE = [{"attribute": "mig_profile", "operator": "=", "value": "3g.40gb"}]


def grant(user, workload_id, **body):
    lease, status = lease_create(
        data={"workload_id": workload_id, "pool": "gpu", **body}, client=user, actor=Actor.system("test")
    )
    assert status == 201
    return lease


def end(lease):
    end_lease(lease.pk, to_state="released", reason="done", now=timezone.now(), actor=Actor.system("test"))


def mig_node():
    """One verified GPU with two verified MIG instances of it."""
    node, _ = make_gpu_node(PoolFactory(name="gpu"), count=1)
    parent = Device.objects.get(node=node)
    migs = [
        {"id": f"MIG-{i}", "type": "nvidia.com/mig", "index": i, "mig_profile": "3g.40gb", "parent": parent.device_id,
         "model": parent.model, "memory_bytes": 40 * 2**30}
        for i in range(2)
    ]  # fmt: skip
    report_devices(node, [gpu(0), *migs])
    Device.objects.filter(node=node).update(verified_at=parent.verified_at)
    sync_counts(Node.objects.select_related("pool").get(pk=node.pk))
    return node


def free(node) -> dict:
    return {r.name: r.allocatable - r.allocated for r in NodeResource.objects.filter(node=node, name__contains="/")}


def seen(node) -> dict:
    """What each reader says is free (or allocatable) of each type, side by side."""
    capacity = pool_capacity(node.pool)
    summary = device_summary([node.pk]).get(node.pk, {})
    metrics: dict = {}
    for _pool, kind, _model, _health, allocatable, n in device_metric_rows():
        metrics[kind] = metrics.get(kind, 0) + (n if allocatable else 0)
    out = {}
    for kind in ("nvidia.com/gpu", "nvidia.com/mig"):
        out[kind] = {
            "resource_free": free(node)[kind],
            "pool_resource_free": capacity["resources"][kind]["free"],
            "pool_devices_free": sum(m["free"] for m in capacity["devices"][kind].values()),
            "summary_free": sum(summary[kind]["free_models"].values()),
        }
        # Allocatable (free or held by a lease that counts it), which the metrics and counts agree on.
        out[kind]["allocatable"] = {
            "resource": NodeResource.objects.get(node=node, name=kind).allocatable,
            "pool_devices": sum(m["allocatable"] for m in capacity["devices"][kind].values()),
            "summary": summary[kind]["allocatable"],
            "metrics": metrics[kind],
        }
    return out


def expect(gpu_free, gpu_allocatable, mig_free, mig_allocatable):
    def readers(n_free, n_allocatable):
        return {
            "resource_free": n_free,
            "pool_resource_free": n_free,
            "pool_devices_free": n_free,
            "summary_free": n_free,
            "allocatable": dict.fromkeys(("resource", "pool_devices", "summary", "metrics"), n_allocatable),
        }

    return {"nvidia.com/gpu": readers(gpu_free, gpu_allocatable), "nvidia.com/mig": readers(mig_free, mig_allocatable)}


def test_counts_before_any_grant(client_user):
    node = mig_node()
    assert seen(node) == expect(1, 1, 2, 2)


def test_a_whole_gpu_lease_takes_its_mig_instances_out_of_every_count(client_user):
    node = mig_node()
    whole = grant(client_user, "whole", resources={"nvidia.com/gpu": 1})
    # The GPU is allocatable and allocated (free 0); its slices are neither free nor allocatable.
    assert seen(node) == expect(0, 1, 0, 0)
    assert grant_status(client_user, "slice", pool="gpu", resources={"nvidia.com/mig": 1}) == 409
    end(whole)
    assert seen(node) == expect(1, 1, 2, 2)


def test_a_mig_lease_takes_its_gpu_out_of_every_count(client_user):
    node = mig_node()
    sliced = grant(client_user, "slice", devices=[{"type": "nvidia.com/mig", "count": 1, "constraints": PROFILE}])
    # One slice allocated, its sibling still free; the whole GPU is neither free nor allocatable.
    assert seen(node) == expect(0, 0, 1, 2)
    assert grant_status(client_user, "whole", pool="gpu", resources={"nvidia.com/gpu": 1}) == 409
    other = grant(client_user, "slice-2", resources={"nvidia.com/mig": 1})
    assert seen(node) == expect(0, 0, 0, 2)
    end(sliced)
    assert seen(node) == expect(0, 0, 1, 2)
    end(other)
    assert seen(node) == expect(1, 1, 2, 2)


def test_the_database_refuses_a_gpu_and_its_slice_to_two_leases(client_user):
    node = mig_node()
    whole = grant(client_user, "whole", resources={"nvidia.com/gpu": 1})
    other = grant(client_user, "cpu-only", resources={"cpu": "1"})
    with pytest.raises(IntegrityError), transaction.atomic():
        LeaseDevice.objects.create(lease=other, device=Device.objects.get(device_id="MIG-1"))
    end(whole)
    sliced = grant(client_user, "slice", resources={"nvidia.com/mig": 1})
    # The whole GPU's claim writes its instances' rows too (implied), which the index refuses.
    gpu_row = Device.objects.get(node=node, type="nvidia.com/gpu")
    rows = [LeaseDevice(lease=other, device_id=gpu_row.pk, position=0)] + [
        LeaseDevice(lease=other, device_id=d.pk, implied=True, position=i + 1)
        for i, d in enumerate(Device.objects.filter(node=node, type="nvidia.com/mig"))
    ]
    with pytest.raises(IntegrityError), transaction.atomic():
        device_sql.insert_claims(rows)
    assert Lease.objects.get(pk=sliced.pk).devices[0]["id"] in {"MIG-0", "MIG-1"}
