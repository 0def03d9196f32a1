"""Virtual GPU nodes (issue 27, item 10): devices with ids, models and NVLink islands, injectable
XIDs and health, reboots with a new boot id, and the devices each lease was given."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from simulator import FleetThread, PoolSpec
from simulator.node import VirtualNode
from simulator.shapes import generate
from tests.control_plane import ControlPlane

pytestmark = pytest.mark.usefixtures("no_flood_guard")
GPU_POOL = [PoolSpec("gpu", "token", gpu=True)]


def _spec(shape: str, *, seed: int = 1):
    for spec in generate(200, seed=seed, pools=GPU_POOL, zones=["a"]):
        if spec.shape == shape:
            return spec
    raise AssertionError(f"no {shape} in the first 200 nodes")


def test_an_8_gpu_node_has_eight_devices_in_two_nvlink_islands():
    devices = _spec("gpu-h100x8").devices()

    assert [d["index"] for d in devices] == list(range(8))
    assert len({d["id"] for d in devices}) == 8 and all(d["id"].startswith("GPU-") for d in devices)
    assert {d["model"] for d in devices} == {"NVIDIA H100 80GB HBM3"}
    assert {d["memory_bytes"] for d in devices} == {80 * 2**30}
    assert [d["interconnect_group"] for d in devices] == ["nvlink-0"] * 4 + ["nvlink-1"] * 4
    assert [d["numa_node"] for d in devices] == [0] * 4 + [1] * 4
    assert {d["type"] for d in devices} == {"nvidia.com/gpu"}


def test_smaller_shapes_have_their_own_interconnects():
    assert {d["interconnect_group"] for d in _spec("gpu-a100x4").devices()} == {"nvlink-0"}
    assert {d["interconnect_group"] for d in _spec("gpu-l4x2").devices()} == {"pcie-0"}
    assert [d["interconnect_group"] for d in _spec("gpu-a16").devices()] == [None]


def test_device_ids_are_stable_for_a_seed_and_never_shared_between_nodes():
    first = generate(100, seed=3, pools=GPU_POOL, zones=["a"])
    again = generate(100, seed=3, pools=GPU_POOL, zones=["a"])
    ids = [d["id"] for spec in first for d in spec.devices()]
    assert ids == [d["id"] for spec in again for d in spec.devices()]
    assert len(ids) == len(set(ids))


def test_health_and_xids_are_injected_by_index_or_id():
    node = VirtualNode(_spec("gpu-h100x8"))
    device_id = node.inject_xid(3, 79, "fell off the bus")
    assert node.device_id(device_id) == device_id
    node.set_device_health(device_id, ecc_uncorrectable=2)

    body = node.devices_body()
    assert body[3]["health"]["xid_events"][0]["xid"] == 79
    assert body[3]["health"]["ecc_uncorrectable"] == 2
    assert all(not d["health"]["xid_events"] for i, d in enumerate(body) if i != 3)
    with pytest.raises(KeyError):
        node.inject_xid(8, 79)
    with pytest.raises(ValueError, match="unknown health"):
        node.set_device_health(0, melted=True)


def test_a_cpu_node_sends_a_boot_id_and_no_devices():
    node = VirtualNode(generate(1, seed=1, pools=[PoolSpec("general", "t")], zones=["a"])[0])
    body = node.heartbeat_body()
    assert "devices" not in body and len(body["boot_id"]) == 36


def test_leases_record_their_devices_and_a_device_given_twice_is_counted():
    node = VirtualNode(_spec("gpu-h100x8"))
    node.node_id = "n1"
    ids = [d["id"] for d in node.devices]

    def answer(request):
        return httpx.Response(200, json={"state": json.loads(request.content)["state"]})

    async def run():
        async with httpx.AsyncClient(base_url="http://cp/api/v1", transport=httpx.MockTransport(answer)) as client:
            gpus = lambda picked: [{"id": ids[i], "type": "nvidia.com/gpu", "index": i} for i in picked]  # noqa: E731
            await node._reconcile(
                client,
                [
                    {"lease_id": "a", "fencing_token": 1, "command": ["serve"], "devices": gpus([0, 1, 2, 3])},
                    {"lease_id": "b", "fencing_token": 1, "command": ["serve"], "devices": gpus([4, 5, 6, 7])},
                ],
            )
            assert node.counters["device_double_assigned"] == 0
            await node._reconcile(
                client,
                [
                    {"lease_id": "a", "fencing_token": 1, "command": ["serve"]},
                    {"lease_id": "b", "fencing_token": 1, "command": ["serve"]},
                    {"lease_id": "c", "fencing_token": 1, "command": ["serve"], "devices": gpus([3])},
                ],
            )

    asyncio.run(run())
    assert node.leases["a"].devices == tuple(ids[:4])
    assert node.leases["a"].env["CUDA_VISIBLE_DEVICES"] == ",".join(ids[:4])
    assert node.leases["b"].env["NVIDIA_VISIBLE_DEVICES"] == ",".join(ids[4:])
    assert node.counters["device_double_assigned"] == 1
    assert node.summary()["lease_devices"]["c"] == [ids[3]]


@pytest.mark.django_db(transaction=True)
def test_a_gpu_node_reports_its_devices_and_an_injected_xid_at_once_then_a_reboot():
    cp = ControlPlane({"gpu": {}}, heartbeat_interval=10)
    sim = cp.make_simulator(pools=[PoolSpec("gpu", cp.tokens["gpu"], gpu=True)], renewals=True)
    try:
        with FleetThread(sim) as fleet:
            (name,) = fleet.enroll(1)
            fleet.beat_all()  # a status report first
            fleet.beat_all()  # a renewal: nothing changed
            device_id = fleet.inject_xid(name, 0, 94, "contained")
            fleet.beat_all()  # the XID: a status report at once
            fleet.beat_all()  # reported: renewals again
            boot = fleet.node(name)["boot_id"]
            fleet.reboot(name)
            fleet.beat_all()
            node_id = cp.node_by_hostname(name).pk
            reports = [e.request for e in cp.exchanges if e.node_id == str(node_id) and e.endpoint == "heartbeats"]
            renewals = [e for e in cp.exchanges if e.node_id == str(node_id) and e.endpoint == "renewals"]
            devices = sim.node(name).devices
    finally:
        cp.close()

    assert len(reports) == 3 and len(renewals) == 2
    assert [d["id"] for d in reports[0]["devices"]] == [d["id"] for d in devices]
    assert reports[0]["boot_id"] == reports[1]["boot_id"] == boot != reports[2]["boot_id"]
    (carrying,) = [d for d in reports[1]["devices"] if d["health"]["xid_events"]]
    assert carrying["id"] == device_id and carrying["health"]["xid_events"][0]["xid"] == 94
    assert all(not d["health"]["xid_events"] for d in reports[2]["devices"])


def test_a_provider_machine_from_a_gpu_template_reports_its_gpus(monkeypatch, tmp_path):
    from operations.providers import MachineRequest, SimulatedProvider
    from simulator import machine
    from simulator.shapes import NodeSpec

    started = []
    monkeypatch.setattr("operations.providers.subprocess.Popen", lambda args, **kw: started.append(args) or _Pid())
    template = {"resources": {"cpu": 8000, "memory": 2**34, "nvidia.com/gpu": 8}}
    request = MachineRequest(name="m-1", bootstrap_token="npb_x", template=template, version="")
    SimulatedProvider(url="http://cp", log_dir=tmp_path)._start(request)
    args = machine.build_parser().parse_args(started[0][3:])

    assert args.gpus == 8
    spec = NodeSpec(
        name="m-1", pool="", bootstrap_token="", zone="a", shape="template", cpu=8, memory=2**34, disk=2**35,
        arch="amd64", kernel="6.1", network_class="10g", gpu_count=args.gpus, gpu_model=args.gpu_model,
        gpu_memory=args.gpu_memory_bytes,
    )  # fmt: skip
    assert [d["interconnect_group"] for d in spec.devices()] == ["nvlink-0"] * 4 + ["nvlink-1"] * 4


class _Pid:
    pid = 4242


@pytest.mark.django_db(transaction=True)
def test_a_gpu_node_enrolls_with_its_devices_so_admission_verifies_them():
    from fleet.models import Device, Node, NodeResource

    cp = ControlPlane({"gpu": {}}, heartbeat_interval=10)
    sim = cp.make_simulator(pools=[PoolSpec("gpu", cp.tokens["gpu"], gpu=True)], renewals=False)
    try:
        with FleetThread(sim) as fleet:
            (name,) = fleet.enroll(1)
            node = cp.node_by_hostname(name)
            enrolled = sorted(Device.objects.filter(node=node).values_list("device_id", flat=True))
            fleet.beat_all()
            cp.admit(node.pk)
            for _ in range(20):  # the benchmark's answer, if the pool asks for one
                fleet.beat_all()
                if Node.objects.get(pk=node.pk).lifecycle == "ready":
                    break
            count = len(sim.node(name).devices)
    finally:
        cp.close()
    assert enrolled == sorted(d["id"] for d in sim.node(name).devices)
    assert Device.objects.filter(node=node, verified_at__isnull=False).count() == count
    assert NodeResource.objects.get(node=node, name="nvidia.com/gpu").allocatable == count
