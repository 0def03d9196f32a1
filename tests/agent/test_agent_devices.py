"""Devices on the agent (issue 27, items 1, 4, 5): inventory from a fake nvidia-smi, health, XID
events from NVML or the kernel log, status reports, and workloads confined to their lease's GPUs.

No GPU here or in CI: the fake nvidia-smi (tests/gpu_support.py) answers in NVIDIA's documented
formats; NVML is a fake module with pynvml's functions."""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

import pytest

from agent import nvidia
from agent.devices import DeviceTracker, boot_id, count_resources, lease_environment, pci_key
from agent.nvidia import NvidiaProvider, parse_topology
from agent.workloads import Supervisor
from agent.xid import KernelLogXids, NvmlXidListener, XidSource, open_xid_source, parse_xid_line
from tests.gpu_support import write_fake_nvidia_smi


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """An 8-GPU H100 host in two NVLink islands of four."""
    fake = write_fake_nvidia_smi(tmp_path / "bin", 8, nvlink_groups=2)
    monkeypatch.setenv("PATH", fake.path())
    return fake


class FakeXids(XidSource):
    name = "fake"

    def __init__(self):
        self.queue: list[dict] = []

    def drain(self):
        out, self.queue = self.queue, []
        return out


# -- inventory --------------------------------------------------------------------------------
def test_every_gpu_is_reported_with_its_identity_and_attributes(fake_smi):
    devices = NvidiaProvider().inventory()

    assert [d["id"] for d in devices] == fake_smi.uuids
    first = devices[0]
    assert first["type"] == "nvidia.com/gpu" and first["index"] == 0
    assert first["model"] == "NVIDIA H100 80GB HBM3"
    assert first["memory_bytes"] == 81559 * 2**20
    assert first["pci_bus_id"] == "00000000:17:00.0"
    assert first["serial"] == fake_smi.gpus[0]["serial"]
    assert (first["driver_version"], first["cuda_version"]) == ("550.54.15", "12.4")
    assert first["mig_profile"] is None and first["parent"] is None
    assert [d["interconnect_group"] for d in devices] == ["nvlink-0"] * 4 + ["nvlink-1"] * 4
    assert [d["numa_node"] for d in devices] == [0] * 4 + [1] * 4
    assert first["health"] == {
        "ecc_uncorrectable": 0,
        "retired_pages_pending": False,
        "remapped_rows_failure": False,
        "thermal_throttle": False,
        "power_throttle": False,
    }
    assert {"--query-gpu=index,uuid,name,memory.total,pci.bus_id,serial,driver_version", "-q -x", "topo -m"} <= {
        c.split(" --format")[0] for c in fake_smi.calls()
    }


def test_health_follows_what_the_gpu_reports(fake_smi):
    fake_smi.update_gpu(3, ecc_uncorrectable=2, retired_pages_pending=True, thermal_throttle=True)
    fake_smi.update_gpu(5, remapped_rows_failure=True, power_throttle=True)

    health = {d["index"]: d["health"] for d in NvidiaProvider().inventory()}

    assert health[3]["ecc_uncorrectable"] == 2 and health[3]["retired_pages_pending"] is True
    assert health[3]["thermal_throttle"] is True and health[3]["power_throttle"] is False
    assert health[5]["remapped_rows_failure"] is True and health[5]["power_throttle"] is True
    assert health[0]["ecc_uncorrectable"] == 0


def test_pre_535_xml_names_are_read_too(tmp_path, monkeypatch):
    fake = write_fake_nvidia_smi(tmp_path, 2, legacy_xml=True)
    fake.update_gpu(1, ecc_uncorrectable=1, thermal_throttle=True)
    monkeypatch.setenv("PATH", fake.path())

    health = [d["health"] for d in NvidiaProvider().inventory()]

    assert health[1]["ecc_uncorrectable"] == 1 and health[1]["thermal_throttle"] is True
    assert health[0]["ecc_uncorrectable"] == 0


@pytest.mark.parametrize("uuid_in_xml", [False, True])
def test_mig_instances_are_devices_of_their_own_with_a_parent(tmp_path, monkeypatch, uuid_in_xml):
    fake = write_fake_nvidia_smi(tmp_path, 2, mig={1: ["3g.40gb", "2g.20gb"]}, mig_uuid_in_xml=uuid_in_xml)
    monkeypatch.setenv("PATH", fake.path())

    devices = NvidiaProvider().inventory()

    migs = [d for d in devices if d["type"] == "nvidia.com/mig"]
    assert [m["id"] for m in migs] == [m["uuid"] for m in fake.gpus[1]["mig"]]
    assert [m["mig_profile"] for m in migs] == ["3g.40gb", "2g.20gb"]
    assert {m["parent"] for m in migs} == {fake.uuids[1]}
    assert [m["index"] for m in migs] == [0, 1]
    assert migs[0]["memory_bytes"] == (40 * 1024 - 512) * 2**20
    assert count_resources(devices) == {"nvidia.com/gpu": "2", "nvidia.com/mig": "2"}


def test_a_host_without_nvidia_smi_has_no_devices(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert NvidiaProvider().inventory() == []


def test_a_failing_driver_gives_no_devices_and_no_exception(fake_smi):
    fake_smi.spec["fail"] = True
    fake_smi.save()
    assert NvidiaProvider().inventory() == []


def test_the_old_count_resource_still_comes_from_nvidia_smi(fake_smi, tmp_path):
    from agent import inventory

    facts = inventory.collect(disk_path=str(tmp_path))
    assert facts["capability"]["resources"]["nvidia.com/gpu"] == "8"


def test_topology_groups_nvlink_islands_then_pcie_switches():
    topo = (
        "\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tNV12\tSYS\tSYS\tPIX\t0-23\t0\t\tN/A\n"
        "GPU1\tNV12\t X \tSYS\tSYS\tSYS\t0-23\t0\t\tN/A\n"
        "GPU2\tSYS\tSYS\t X \tPXB\tSYS\t24-47\t1\t\tN/A\n"
        "GPU3\tSYS\tSYS\tPXB\t X \tSYS\t24-47\t1\t\tN/A\n"
        "NIC0\tPIX\tSYS\tSYS\tSYS\t X \n\nLegend:\n\n  X    = Self\n"
    )
    assert parse_topology(topo) == {
        0: {"interconnect_group": "nvlink-0", "numa_node": 0},
        1: {"interconnect_group": "nvlink-0", "numa_node": 0},
        2: {"interconnect_group": "pcie-0", "numa_node": 1},
        3: {"interconnect_group": "pcie-0", "numa_node": 1},
    }


def test_a_gpu_with_no_peer_has_no_group_and_numa_falls_back_to_sysfs(tmp_path):
    assert parse_topology("\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t0-7\tN/A\n") == {
        0: {"interconnect_group": None, "numa_node": None}
    }
    (tmp_path / "0000:17:00.0").mkdir()
    (tmp_path / "0000:17:00.0" / "numa_node").write_text("1\n")
    assert nvidia.sysfs_numa_node("00000000:17:00.0", tmp_path) == 1
    assert nvidia.sysfs_numa_node("00000000:18:00.0", tmp_path) is None


def test_pci_keys_of_nvidia_smi_and_of_the_kernel_log_agree():
    assert pci_key("00000000:17:00.0") == pci_key("PCI:0000:17:00") == "0000:17:00"


def test_boot_id_is_read_from_the_kernel(tmp_path):
    (tmp_path / "boot_id").write_text("4b1c8a5e-0000-4000-8000-000000000001\n")
    assert boot_id(tmp_path / "boot_id") == "4b1c8a5e-0000-4000-8000-000000000001"
    assert boot_id(tmp_path / "absent") == ""
    assert len(boot_id()) in (0, 36)


# -- XID sources ------------------------------------------------------------------------------
def test_kernel_xid_lines_are_parsed():
    line = "NVRM: Xid (PCI:0000:17:00): 79, pid=1234, name=python, GPU has fallen off the bus."
    assert parse_xid_line(line) == {
        "xid": 79,
        "pci_bus_id": "0000:17:00",
        "message": "pid=1234, name=python, GPU has fallen off the bus.",
    }
    assert parse_xid_line("usb 1-1: new device") is None


def test_the_kernel_log_source_reads_new_xid_records(tmp_path):
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    source = KernelLogXids(str(fifo), boot_time=1_700_000_000.0)
    writer = os.open(fifo, os.O_WRONLY)
    try:
        os.write(writer, b"6,100,5000000,-;usb 1-1: new device\n")
        os.write(writer, b"4,101,7000000,-;NVRM: Xid (PCI:0000:27:00): 94, pid=9, Contained: SM (0x1).\n")
        os.write(writer, b" SUBSYSTEM=pci\n")
        events = source.drain()
    finally:
        os.close(writer)
        source.close()
    assert [(e["xid"], e["pci_bus_id"]) for e in events] == [(94, "0000:27:00")]
    assert events[0]["at"].startswith("2023-11-14T22:13:27")


def fake_nvml(events):
    """A stand-in for pynvml: two GPUs, ``events`` delivered one per wait, then timeouts."""

    class NVMLError(Exception):
        def __init__(self, value):
            self.value = value

    handles = ["h0", "h1"]
    registered = []
    pending = list(events)

    def wait(event_set, ms):
        if not pending:
            time.sleep(ms / 1000)
            raise NVMLError(10)
        handle, xid = pending.pop(0)
        return SimpleNamespace(eventType=8, eventData=xid, device=handle)

    return SimpleNamespace(
        NVMLError=NVMLError,
        NVML_ERROR_TIMEOUT=10,
        nvmlEventTypeXidCriticalError=8,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlEventSetCreate=lambda: "set",
        nvmlEventSetFree=lambda s: None,
        nvmlDeviceGetCount=lambda: len(handles),
        nvmlDeviceGetHandleByIndex=lambda i: handles[i],
        nvmlDeviceRegisterEvents=lambda h, mask, s: registered.append((h, mask)),
        nvmlEventSetWait_v2=wait,
        nvmlDeviceGetUUID=lambda h: {"h0": b"GPU-aaaa", "h1": "GPU-bbbb"}[h],
        registered=registered,
    )


def test_nvml_xid_events_name_the_gpu_by_uuid():
    nvml = fake_nvml([("h1", 79), ("h0", 13)])
    listener = NvmlXidListener(nvml, wait_ms=20)
    try:
        deadline = time.monotonic() + 5
        events = []
        while len(events) < 2 and time.monotonic() < deadline:
            events += listener.drain()
            time.sleep(0.01)
    finally:
        listener.close()
    assert nvml.registered == [("h0", 8), ("h1", 8)]
    assert [(e["xid"], e["device_id"]) for e in events] == [(79, "GPU-bbbb"), (13, "GPU-aaaa")]
    assert not listener.thread.is_alive()


def test_an_unavailable_xid_source_degrades_to_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    source = open_xid_source("nvml")
    assert type(source) is XidSource and source.drain() == []


# -- the tracker --------------------------------------------------------------------------------
def test_xid_events_reach_their_device_until_a_report_carries_them(fake_smi):
    xids = FakeXids()
    tracker = DeviceTracker([NvidiaProvider(xid_source=xids)])
    tracker.inventory()
    xids.queue += [
        {"xid": 79, "pci_bus_id": "0000:27:00", "at": "2026-12-02T10:00:00Z", "message": "fell off"},
        {"xid": 94, "device_id": fake_smi.uuids[5], "at": "2026-12-02T10:00:01Z", "message": "contained"},
        {"xid": 31, "pci_bus_id": "0000:99:00", "at": "2026-12-02T10:00:02Z", "message": "nobody's"},
    ]

    first = tracker.report()
    by_index = {d["index"]: d["health"]["xid_events"] for d in first}
    assert by_index[1] == [{"xid": 79, "at": "2026-12-02T10:00:00Z", "message": "fell off"}]
    assert [e["xid"] for e in by_index[5]] == [94]
    assert tracker.unmatched == 1
    assert tracker.report() == first, "unanswered: the events are sent again"

    tracker.reported(first)
    assert all(not d["health"]["xid_events"] for d in tracker.report())


def test_at_most_32_xid_events_per_device_are_kept(fake_smi):
    xids = FakeXids()
    tracker = DeviceTracker([NvidiaProvider(xid_source=xids)])
    tracker.inventory()
    xids.queue += [{"xid": 13, "device_id": fake_smi.uuids[0], "at": f"t{n}"} for n in range(40)]
    events = tracker.report()[0]["health"]["xid_events"]
    assert len(events) == 32 and events[-1]["at"] == "t39"


def test_the_inventory_is_reused_between_refreshes(fake_smi):
    now = [0.0]
    tracker = DeviceTracker([NvidiaProvider()], refresh=30, clock=lambda: now[0])
    tracker.report()
    tracker.report()
    now[0] = 31
    tracker.report()
    queries = [c for c in fake_smi.calls() if c.startswith("--query-gpu=index")]
    assert len(queries) == 2


def test_a_provider_that_raises_costs_its_devices_not_the_report():
    class Broken:
        name = "broken"

        def inventory(self):
            raise RuntimeError("vendor tool crashed")

        def xid_events(self):
            raise RuntimeError("also")

    class One:
        name = "one"

        def inventory(self):
            return [{"id": "acme-0", "type": "acme.com/npu", "index": 0}]

        def xid_events(self):
            return []

    assert [d["id"] for d in DeviceTracker([Broken(), One()]).report()] == ["acme-0"]


def test_a_new_xid_or_a_changed_health_flag_warrants_a_report(fake_smi):
    xids = FakeXids()
    tracker = DeviceTracker([NvidiaProvider(xid_source=xids)], refresh=0)
    before = DeviceTracker.fingerprint(tracker.report())
    assert DeviceTracker.fingerprint(tracker.report()) == before
    assert not DeviceTracker.has_unreported_events(tracker.report())
    xids.queue.append({"xid": 63, "device_id": fake_smi.uuids[2], "at": "t"})
    assert DeviceTracker.has_unreported_events(tracker.report())
    tracker.pending.clear()
    fake_smi.update_gpu(2, ecc_uncorrectable=1)
    assert DeviceTracker.fingerprint(tracker.report()) != before


# -- isolation --------------------------------------------------------------------------------
def test_the_lease_environment_names_exactly_the_leases_gpus():
    devices = [
        {"id": "GPU-b", "type": "nvidia.com/gpu", "index": 1},
        {"id": "MIG-c", "type": "nvidia.com/mig", "index": 0},
        {"id": "fpga-0", "type": "xilinx.com/fpga", "index": 0},
    ]
    assert lease_environment(devices) == {
        "CUDA_VISIBLE_DEVICES": "GPU-b,MIG-c",
        "NVIDIA_VISIBLE_DEVICES": "GPU-b,MIG-c",
        "NODEPOOL_DEVICES": "GPU-b,MIG-c,fpga-0",
    }


@pytest.mark.parametrize("devices", [None, [], [{"id": "fpga-0", "type": "xilinx.com/fpga", "index": 0}]])
def test_a_lease_without_gpus_sees_none(devices):
    env = lease_environment(devices)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"


def _env_of(supervisor, lease_id, devices, tmp_path):
    out = tmp_path / f"{lease_id}.json"
    command = [sys.executable, "-c", f"import json, os; open({str(out)!r}, 'w').write(json.dumps(dict(os.environ)))"]
    assert supervisor.start(lease_id, 1, command, devices=devices).state == "running"
    deadline = time.monotonic() + 10
    while supervisor.workloads and time.monotonic() < deadline:
        supervisor.poll()
        time.sleep(0.02)
    return json.loads(out.read_text())


def test_a_workload_sees_its_leases_gpus_and_never_the_agents_all(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    supervisor = Supervisor(work_dir=tmp_path / "work")
    gpus = [{"id": f"GPU-{n}", "type": "nvidia.com/gpu", "index": n} for n in (4, 6)]

    with_gpus = _env_of(supervisor, "lease-a", gpus, tmp_path)
    without = _env_of(supervisor, "lease-b", [], tmp_path)

    assert with_gpus["CUDA_VISIBLE_DEVICES"] == "GPU-4,GPU-6" == with_gpus["NVIDIA_VISIBLE_DEVICES"]
    assert with_gpus["NODEPOOL_DEVICES"] == "GPU-4,GPU-6"
    assert without["CUDA_VISIBLE_DEVICES"] == "" and without["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert without["NODEPOOL_DEVICES"] == ""


# -- status reports against the real control plane ---------------------------------------------
@pytest.mark.django_db
@pytest.mark.usefixtures("no_flood_guard")
def test_status_reports_carry_boot_id_and_devices_and_a_new_xid_is_reported_at_once(fake_smi, tmp_path):
    from tests.control_plane import ControlPlane

    cp = ControlPlane(heartbeat_interval=10)
    agent = cp.make_agent(tmp_path)
    xids = FakeXids()
    agent.devices = DeviceTracker([NvidiaProvider(xid_source=xids)])
    agent.start()
    try:
        agent.step()  # the first message of an incarnation: a status report
        agent.step()  # nothing changed: a renewal
        xids.queue.append({"xid": 79, "device_id": fake_smi.uuids[2], "at": "2026-12-02T10:00:00Z", "message": "x"})
        agent.step()  # a new XID: a status report at once
        agent.step()  # reported: renewals again
        beats = cp.heartbeats(agent.state.node_id)
    finally:
        agent.shutdown()

    assert len(beats) == 2 and agent.renewals_applied == 2
    assert all(b["boot_id"] == boot_id() for b in beats)
    assert [d["id"] for d in beats[0]["devices"]] == fake_smi.uuids
    assert all(not d["health"]["xid_events"] for d in beats[0]["devices"])
    assert beats[1]["devices"][2]["health"]["xid_events"] == [{"xid": 79, "at": "2026-12-02T10:00:00Z", "message": "x"}]
    assert not agent.devices.pending, "answered: the event is not sent again"


def test_a_host_that_never_had_a_device_sends_no_devices_but_one_that_lost_them_sends_none(fake_smi):
    tracker = DeviceTracker([NvidiaProvider()], refresh=0)
    assert tracker.report() and tracker.ever_found
    fake_smi.spec["fail"] = True  # the driver died: the GPUs are gone, which is news
    fake_smi.save()
    assert tracker.report() == [] and tracker.ever_found

    assert not DeviceTracker([], refresh=0).ever_found


@pytest.mark.django_db
def test_enrollment_carries_the_device_inventory_and_boot_id(fake_smi, tmp_path):
    from fleet.models import Device
    from tests.control_plane import ControlPlane

    cp = ControlPlane(heartbeat_interval=10)
    agent = cp.make_agent(tmp_path)
    agent.start()
    try:
        (enrollment,) = [e for e in cp.exchanges if e.path == "/api/v1/node-enrollments"]
        stored = sorted(Device.objects.filter(node_id=agent.state.node_id).values_list("device_id", flat=True))
    finally:
        agent.shutdown()
    assert enrollment.status == 201
    assert enrollment.request["boot_id"] == boot_id()
    assert [d["id"] for d in enrollment.request["devices"]] == fake_smi.uuids
    assert all("xid_events" not in d["health"] for d in enrollment.request["devices"])
    assert stored == sorted(fake_smi.uuids), "the server keeps them from enrollment on"
