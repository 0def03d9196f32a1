"""Kubernetes import (issue 27, item 10): count-only extended resources become devices with
synthetic ids, unverified until an operator verifies them or an agent takes the node over."""

from __future__ import annotations

import pytest

from fleet import devices as fleet_devices
from fleet.events import Actor
from fleet.k8s_import import import_nodes, map_node, synthetic_devices
from fleet.models import Device, Node
from tests.factories import PoolFactory
from tests.fleet.test_k8s_import import FIXTURES, _source

pytestmark = pytest.mark.django_db
K3S_8_GPUS = "gpu-node-8x-nvidia-k3s.json"
A16 = "gpu-node-a16-vgpu-rke2.json"
OPERATOR = Actor.system("test:operator")


@pytest.fixture
def pool(db):
    return PoolFactory(name="imported")


def _import(name, pool):
    return import_nodes(text=(FIXTURES / name).read_text(), pool=pool, actor=Actor.system("test"))


def _node(name) -> Node:
    return Node.objects.get(external_id=f"k8s:{_source(name)[0]['metadata']['uid']}")


def test_an_8_gpu_node_becomes_eight_unverified_devices_with_synthetic_ids(pool):
    _import(K3S_8_GPUS, pool)
    node = _node(K3S_8_GPUS)
    uid = _source(K3S_8_GPUS)[0]["metadata"]["uid"]

    rows = list(Device.objects.filter(node=node).order_by("index"))
    assert [r.device_id for r in rows] == [f"k8s-{uid}/nvidia.com/gpu/{i}" for i in range(8)]
    assert {r.type for r in rows} == {"nvidia.com/gpu"}
    assert all(r.verified_at is None and not r.allocatable for r in rows)
    assert all(r.declared["synthetic"] and r.declared["source"] == "kubernetes" for r in rows)
    assert {r.model for r in rows} == {""}, "this dump has no GPU feature discovery labels"


def test_feature_discovery_labels_give_the_model_and_memory(pool):
    _import(A16, pool)
    (row,) = Device.objects.filter(node=_node(A16))
    assert (row.model, row.memory_bytes) == ("NVIDIA-A16-4Q", 4096 * 2**20)


def test_nodes_without_device_resources_get_no_devices(pool):
    _import("nodelist-3-workers-aks.json", pool)
    assert not Device.objects.exists()


def test_mig_resources_are_mig_devices_with_their_profile():
    obj = _source(K3S_8_GPUS)[0]
    obj = {**obj, "status": {**obj["status"], "capacity": {"cpu": "8", "nvidia.com/mig-3g.20gb": "2"}}}
    devices = synthetic_devices(map_node(obj))
    assert [(d["type"], d["mig_profile"], d["index"]) for d in devices] == [
        ("nvidia.com/mig", "3g.20gb", 0),
        ("nvidia.com/mig", "3g.20gb", 1),
    ]


def test_importing_again_keeps_the_same_devices(pool):
    _import(K3S_8_GPUS, pool)
    first = set(Device.objects.values_list("pk", flat=True))
    _import(K3S_8_GPUS, pool)
    assert set(Device.objects.values_list("pk", flat=True)) == first


def test_admission_does_not_verify_them_an_operator_does(pool):
    _import(K3S_8_GPUS, pool)
    node = _node(K3S_8_GPUS)

    assert fleet_devices.verify_node_devices(node=node, actor=OPERATOR) == 0
    row = Device.objects.filter(node=node).first()
    fleet_devices.device_verify(node_id=node.pk, device_id=row.device_id, actor=OPERATOR, reason="checked the rack")
    assert Device.objects.get(pk=row.pk).verified_at is not None


def test_an_agent_taking_the_node_over_replaces_them_and_a_reimport_does_not_bring_them_back(pool):
    from tests.device_support import gpus, report_devices

    _import(K3S_8_GPUS, pool)
    node = _node(K3S_8_GPUS)
    report_devices(node, gpus(8, node="k3s"))  # the agent's first report: real UUIDs at indexes 0-7

    live = Device.objects.filter(node=node, retired_at__isnull=True)
    assert sorted(live.values_list("device_id", flat=True)) == [f"GPU-k3s-{i:04d}" for i in range(8)]
    retired = Device.objects.filter(node=node, retired_at__isnull=False)
    assert retired.count() == 8 and all(r.device_id.startswith("k8s-") for r in retired)
    assert {r.retired_reason for r in retired} == {"an agent took the imported node over"}

    _import(K3S_8_GPUS, pool)
    assert not Device.objects.filter(node=node, retired_at__isnull=True, device_id__startswith="k8s-").exists()
