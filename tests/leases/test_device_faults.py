"""An XID that taints one GPU of a busy node: that GPU's lease is revoked and requeued by the
toleration rules, the other leases keep running, the node stays schedulable for smaller work."""

from __future__ import annotations

import pytest

from fleet.models import Device, Node, NodeEvent
from leases.models import Lease, LeaseRequest
from tests.device_support import gpu, make_gpu_node, report_devices
from tests.factories import PoolFactory
from tests.support import grant, grant_status

pytestmark = pytest.mark.django_db
FATAL = {"xid_events": [{"xid": 79, "at": "2026-12-02T10:00:00Z", "message": "GPU has fallen off the bus"}]}


def test_a_fatal_xid_revokes_and_requeues_that_gpus_lease_only(client_user):
    node, _ = make_gpu_node(PoolFactory(name="gpu"))
    first = grant(client_user, "a", pool="gpu", resources={"nvidia.com/gpu": 4})
    second = grant(client_user, "b", pool="gpu", resources={"nvidia.com/gpu": 4})
    bad = second.devices[0]["id"]
    report_devices(node, [gpu(i, health=FATAL) if f"GPU-n-{i:04d}" == bad else gpu(i) for i in range(8)])
    assert Lease.objects.get(pk=second.pk).state == "revoked"
    assert Lease.objects.get(pk=first.pk).state == "granted"
    assert LeaseRequest.objects.filter(requeued_from=second).exists()
    assert Node.objects.get(pk=node.pk).health == "healthy"
    evidence = NodeEvent.objects.get(type="device", to_state="lease_device_fault", lease_id=second.pk)
    assert evidence.data["devices"][0]["id"] == bad and evidence.data["devices"][0]["health"] == "unhealthy"
    # the node still takes work that does not need the bad GPU: 3 healthy GPUs are free
    assert grant_status(client_user, "small", pool="gpu", cpu="1", resources={"nvidia.com/gpu": 3}) == 201


def test_a_lease_tolerating_every_taint_rides_out_the_fault(client_user):
    node, _ = make_gpu_node(PoolFactory(name="gpu"), count=1)
    lease = grant(client_user, "a", pool="gpu", resources={"nvidia.com/gpu": 1}, tolerations=[{"operator": "Exists"}])
    report_devices(node, [gpu(0, health=FATAL)])
    assert Lease.objects.get(pk=lease.pk).state == "granted"


def test_a_warning_level_xid_evicts_nothing(client_user):
    node, _ = make_gpu_node(PoolFactory(name="gpu"), count=1)
    lease = grant(client_user, "a", pool="gpu", resources={"nvidia.com/gpu": 1})
    report_devices(node, [gpu(0, health={"xid_events": [{"xid": 92, "at": "t"}]})])
    assert Lease.objects.get(pk=lease.pk).state == "granted"


def test_the_gpu_returns_after_it_is_healthy_again(client_user):
    node, _ = make_gpu_node(PoolFactory(name="gpu"), count=1)
    report_devices(node, [gpu(0, health=FATAL)], boot_id="b1")
    assert grant_status(client_user, "x", pool="gpu", cpu="1", resources={"nvidia.com/gpu": 1}) == 409
    report_devices(node, [gpu(0)], boot_id="b2")  # the host rebooted: the GPU is back
    assert Device.objects.get(device_id="GPU-n-0000").allocatable
    assert grant_status(client_user, "y", pool="gpu", cpu="1", resources={"nvidia.com/gpu": 1}) == 201
