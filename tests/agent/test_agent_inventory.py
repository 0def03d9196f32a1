"""Inventory, conditions and the benchmark read the real host; nothing is invented."""

import math
import subprocess

import psutil
import pytest
from django.test import TestCase

from agent import benchmark, conditions, inventory
from fleet.models import Benchmark
from tests.control_plane import ControlPlane, wait_until


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


def test_a_benchmark_with_limits_measures_no_more_than_the_free_capacity():
    # A re-verification of a busy node (fleet.reverification) sends its free capacity as limits.
    limits = {"cpu": 1000, "memory": 16 * 2**20}
    result = benchmark.run(cpu_seconds=0.2, memory_sample_bytes=32 * 2**20, limits=limits)
    assert result["details"]["workers"] == 1
    assert result["details"]["memory_sample_bytes"] == 16 * 2**20
    assert result["cpu_millicores"] <= 1000 and result["memory_bytes"] == 16 * 2**20
    assert result["details"]["limits"] == limits


@pytest.mark.django_db
def test_admission_asks_for_a_benchmark_and_the_agent_answers_it_once_with_real_figures(tmp_path):
    # benchmark_tolerance is low so that a busy CI machine's figures still pass admission.
    cp = ControlPlane({"bench": {"benchmark_required": True, "benchmark_tolerance": 0.01}})
    agent = cp.make_agent(tmp_path, renewals=False, benchmark_cpu_seconds=0.2, benchmark_memory_bytes=16 * 2**20)
    agent.start()
    agent.step()
    assert cp.admit(agent.state.node_id) == "admitting"
    agent.step()
    request = agent.last_response["instructions"]["run_benchmark"]
    nonce = request["nonce"]
    agent.step()  # the same instruction seen twice runs once
    assert agent.last_response["instructions"]["run_benchmark"] == request

    with TestCase.captureOnCommitCallbacks(execute=True):  # admission goes on after the result
        assert wait_until(lambda: Benchmark.objects.get(nonce=nonce).status == "completed", step=agent.tick, timeout=60)
    bench = Benchmark.objects.get(nonce=nonce)
    assert bench.result["cpu_millicores"] > 0
    assert bench.result["memory_bytes"] == inventory.memory_bytes()
    assert agent.benchmarks_started == {nonce}
    assert len(cp.sent(agent.state.node_id, f"benchmarks/{nonce}")) == 1
    assert cp.node(agent.state.node_id).lifecycle == "ready"
    agent.shutdown()
