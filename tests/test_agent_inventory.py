"""Inventory, conditions and the benchmark read the real host; nothing is invented."""

import math
import subprocess

import psutil
import pytest

from agent import benchmark, conditions, inventory
from tests.fake_control_plane import FakeControlPlane, make_agent, wait_until


def test_nvidia_smi_output_becomes_gpu_resources_and_accelerators():
    def fake_run(argv, **kwargs):
        assert argv[:2] == ["nvidia-smi", "--query-gpu=name,memory.total"]
        out = "NVIDIA A16, 16384 MiB\nNVIDIA A16, 16384 MiB\nNVIDIA H100 80GB HBM3, 81559 MiB\n"
        return subprocess.CompletedProcess(argv, 0, out, "")

    gpus = inventory.nvidia_gpus(run=fake_run, which=lambda name: "/usr/bin/" + name)
    facts = inventory.collect(run=fake_run, which=lambda name: "/usr/bin/" + name if name == "nvidia-smi" else None)

    assert inventory.accelerators(gpus) == [
        {"type": "nvidia.com/gpu", "model": "NVIDIA A16", "memory": "16384Mi", "count": 2},
        {"type": "nvidia.com/gpu", "model": "NVIDIA H100 80GB HBM3", "memory": "81559Mi", "count": 1},
    ]
    assert facts["capability"]["resources"]["nvidia.com/gpu"] == "3"


def test_no_nvidia_smi_means_no_gpus_declared():
    facts = inventory.collect(which=lambda name: None, exists=lambda path: False)
    assert "nvidia.com/gpu" not in facts["capability"]["resources"]
    assert facts["capability"]["accelerators"] == []
    assert facts["capability"]["features"]["runtimes"] == []


def test_a_failing_nvidia_smi_declares_no_gpus():
    def broken(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 9, "", "NVIDIA-SMI has failed")

    assert inventory.nvidia_gpus(run=broken, which=lambda name: "/usr/bin/nvidia-smi") == []


def test_container_runtimes_are_found_by_binary_or_socket():
    found = inventory.container_runtimes(
        which=lambda name: "/usr/bin/podman" if name == "podman" else None,
        exists=lambda path: path == "/run/containerd/containerd.sock",
    )
    assert found == {
        "containerd": {"binary": None, "socket": "/run/containerd/containerd.sock"},
        "podman": {"binary": "/usr/bin/podman", "socket": None},
    }


def test_declared_memory_and_disk_are_the_hosts_own_figures():
    facts = inventory.collect()
    resources = facts["capability"]["resources"]
    assert int(resources["memory"]) <= psutil.virtual_memory().total
    assert int(resources["ephemeral-storage"]) == psutil.disk_usage("/").total


def test_pressure_conditions_follow_the_thresholds():
    calm = {c["type"]: c["status"] for c in conditions.measure(conditions.Thresholds(memory_available_bytes=1))}
    squeezed = conditions.measure(
        conditions.Thresholds(memory_available_bytes=2**62, disk_available_fraction=1.01, pid_used_fraction=0.0)
    )
    assert calm["MemoryPressure"] == "False"
    assert {c["type"]: c["status"] for c in squeezed} == {
        "Ready": "True",
        "MemoryPressure": "True",
        "DiskPressure": "True",
        "PIDPressure": "True",
    }
    assert {c["type"]: c["reason"] for c in squeezed}["MemoryPressure"] == "AvailableMemoryLow"


def test_benchmark_measures_real_cpu_and_memory():
    result = benchmark.run(cpu_seconds=0.3, memory_sample_bytes=32 * 2**20)

    # No bounds on the figures themselves: they depend on what else the machine is doing.
    details = result["details"]
    assert details["workers"] == math.ceil(inventory.cpu_millicores() / 1000)
    assert details["single_core_ops_per_s"] > 0 and details["parallel_ops_per_s"] > 0
    ratio = 1000 * details["parallel_ops_per_s"] / details["single_core_ops_per_s"]
    assert abs(result["cpu_millicores"] - ratio) <= 1  # the details' rates are rounded to 0.1
    assert 0 <= details["host_cpu_busy_percent_before"] <= 100
    assert result["memory_bytes"] == inventory.memory_bytes()
    assert result["details"]["memory_sample_bytes"] == 32 * 2**20
    assert result["details"]["memory_confirmed"] is True
    assert result["details"]["memory_write_bytes_per_s"] > 0
    assert result["duration_seconds"] > 0


@pytest.fixture
def fake():
    return FakeControlPlane()


def test_a_benchmark_instruction_is_answered_with_real_figures_and_the_nonce(fake, tmp_path):
    agent = make_agent(fake, tmp_path, benchmark_cpu_seconds=0.2, benchmark_memory_bytes=16 * 2**20)
    agent.start()
    nonce = fake.request_benchmark(agent.state.node_id)
    request = fake.nodes[agent.state.node_id].benchmark
    agent.step()
    fake.nodes[agent.state.node_id].benchmark = request  # the same instruction seen twice runs once
    agent.step()

    assert wait_until(lambda: fake.benchmarks[nonce]["result"] is not None, step=agent.tick, timeout=60)
    result = fake.benchmarks[nonce]["result"]
    assert result["cpu_millicores"] > 0
    assert result["memory_bytes"] == inventory.memory_bytes()
    assert agent.benchmarks_started == {nonce}
    agent.shutdown()
