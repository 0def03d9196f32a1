"""Node shapes, zones, pools and GPUs drawn from a seed, so that a fleet can be replayed."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field

# (name, cpu cores, memory GiB, disk GiB, weight). Roughly the spread of a general-purpose cloud.
CPU_SHAPES = [
    ("small", 2, 4, 50, 3),
    ("medium", 4, 16, 100, 5),
    ("large", 8, 32, 200, 4),
    ("xlarge", 16, 64, 400, 2),
    ("2xlarge", 32, 128, 800, 1),
]
# (name, cpu cores, memory GiB, disk GiB, gpu model, gpu memory GiB, gpu count, weight)
GPU_SHAPES = [
    ("gpu-a16", 16, 64, 400, "NVIDIA-A16", 16, 1, 3),
    ("gpu-l4x2", 24, 96, 500, "NVIDIA-L4", 24, 2, 3),
    ("gpu-a100x4", 48, 384, 2000, "NVIDIA-A100-SXM4-80GB", 80, 4, 2),
    ("gpu-h100x8", 96, 1024, 4000, "NVIDIA-H100-80GB-HBM3", 80, 8, 1),
]
# How each GPU shape's GPUs are joined: (interconnect kind, number of equal islands). An 8-GPU
# H100 node in two NVLink islands of four lets placement's co-location rules be exercised.
GPU_INTERCONNECT = {
    "gpu-a16": (None, 1),
    "gpu-l4x2": ("pcie", 1),
    "gpu-a100x4": ("nvlink", 1),
    "gpu-h100x8": ("nvlink", 2),
}
# The label-safe model names above as nvidia-smi prints them (a device's ``model``).
GPU_DISPLAY_MODELS = {
    "NVIDIA-A16": "NVIDIA A16",
    "NVIDIA-L4": "NVIDIA L4",
    "NVIDIA-A100-SXM4-80GB": "NVIDIA A100-SXM4-80GB",
    "NVIDIA-H100-80GB-HBM3": "NVIDIA H100 80GB HBM3",
}
SIM_DRIVER_VERSION, SIM_CUDA_VERSION = "550.54.15", "12.4"
ARCHES = [("amd64", 9), ("arm64", 1)]
NETWORK = [("10g", 6), ("25g", 3), ("100g", 1)]
KERNELS = ["6.1.0-18-amd64", "5.15.0-105-generic", "6.8.0-31-generic"]
GIB = 2**30


@dataclass(frozen=True)
class PoolSpec:
    """A pool the simulator enrolls into: its bootstrap token decides the pool on the server.

    ``weight`` is the pool's share of the fleet; ``gpu`` gives its nodes GPU shapes.
    """

    name: str
    bootstrap_token: str
    weight: float = 1.0
    gpu: bool = False


@dataclass
class NodeSpec:
    """What a virtual node declares at enrollment (quantities as the contract's strings)."""

    name: str
    pool: str
    bootstrap_token: str
    zone: str
    shape: str
    cpu: int  # cores
    memory: int  # bytes
    disk: int  # bytes
    arch: str
    kernel: str
    network_class: str
    gpu_model: str = ""
    gpu_memory: int = 0  # bytes per GPU
    gpu_count: int = 0
    address: str = ""
    labels: dict = field(default_factory=dict)
    agent_version: str = ""  # empty: the agent package's own version

    def devices(self) -> list[dict]:
        """This node's GPUs as DEVICES-WIRE devices (``health`` not included).

        Ids are UUIDs derived from the node's name, so the same seed gives the same devices and
        no two simulated nodes share one. Interconnect groups and NUMA nodes follow
        ``GPU_INTERCONNECT`` (islands of equal size; an island is also a NUMA node).
        """
        # A shape not in the table (a provider's machine template): NVLink, two islands from 8 GPUs.
        kind, islands = GPU_INTERCONNECT.get(self.shape, ("nvlink", 2 if self.gpu_count >= 8 else 1))
        per_island = max(1, -(-self.gpu_count // islands))
        out = []
        for index in range(self.gpu_count):
            island = index // per_island
            out.append(
                {
                    "id": f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'nodepool-simulator/{self.name}/gpu/{index}')}",
                    "type": "nvidia.com/gpu",
                    "index": index,
                    "model": GPU_DISPLAY_MODELS.get(self.gpu_model, self.gpu_model),
                    "memory_bytes": self.gpu_memory,
                    "mig_profile": None,
                    "parent": None,
                    "pci_bus_id": f"00000000:{0x17 + index * 0x10:02X}:00.0",
                    "numa_node": island,
                    "interconnect_group": f"{kind}-{island}" if kind and self.gpu_count > 1 else None,
                    "serial": f"{uuid.uuid5(uuid.NAMESPACE_URL, f'{self.name}/serial/{index}').int % 10**13:013d}",
                    "driver_version": SIM_DRIVER_VERSION,
                    "cuda_version": SIM_CUDA_VERSION,
                }
            )
        return out

    def capability(self, *, impossible: bool = False) -> dict:
        """The ``capability`` of the enrollment body; ``impossible`` declares absurd figures."""
        resources = {"cpu": str(self.cpu), "memory": str(self.memory), "ephemeral-storage": str(self.disk)}
        accelerators = []
        if self.gpu_count:
            resources["nvidia.com/gpu"] = str(self.gpu_count)
            accelerators.append(
                {
                    "type": "nvidia.com/gpu",
                    "model": self.gpu_model,
                    "memory": str(self.gpu_memory),
                    "count": self.gpu_count,
                }
            )
        if impossible:
            # No machine has a hundred thousand cores and a pebibyte of RAM: admission must refuse it.
            resources.update({"cpu": "100000", "memory": "1Pi", "ephemeral-storage": "1Ei"})
        return {
            "resources": resources,
            "accelerators": accelerators,
            "features": {
                "arch": self.arch,
                "os": "linux",
                "kernel": self.kernel,
                "runtimes": ["containerd"],
                "network_class": self.network_class,
                "services": [],
            },
        }


def _pick(rng: random.Random, weighted: list[tuple]) -> tuple:
    return rng.choices(weighted, weights=[w[-1] for w in weighted])[0]


def generate(
    count: int, *, seed: int, pools: list[PoolSpec], zones: list[str], start: int = 0, prefix: str = "sim"
) -> list[NodeSpec]:
    """``count`` node specs numbered from ``start``; the same seed always gives the same fleet.

    Each node's draw depends only on (seed, index), so ``generate(10, start=5)`` equals the last
    ten of ``generate(15)``.
    """
    if not pools:
        raise ValueError("at least one pool (bootstrap token) is needed")
    specs = []
    for index in range(start, start + count):
        rng = random.Random(f"{seed}:{index}")
        pool = rng.choices(pools, weights=[p.weight for p in pools])[0]
        zone = zones[index % len(zones)] if rng.random() < 0.7 else rng.choice(zones)
        name = f"{prefix}-{seed}-{index:04d}"
        if pool.gpu:
            shape, cpu, mem, disk, model, gpu_mem, gpus, _ = _pick(rng, GPU_SHAPES)
        else:
            shape, cpu, mem, disk, _ = _pick(rng, CPU_SHAPES)
            model, gpu_mem, gpus = "", 0, 0
        arch = "amd64" if pool.gpu else _pick(rng, ARCHES)[0]
        specs.append(
            NodeSpec(
                name=name,
                pool=pool.name,
                bootstrap_token=pool.bootstrap_token,
                zone=zone,
                shape=shape,
                cpu=cpu,
                memory=mem * GIB,
                disk=disk * GIB,
                arch=arch,
                kernel=rng.choice(KERNELS),
                network_class=_pick(rng, NETWORK)[0],
                gpu_model=model,
                gpu_memory=gpu_mem * GIB,
                gpu_count=gpus,
                address=f"10.{64 + index // 65536 % 64}.{index // 256 % 256}.{index % 256}",
                labels={"zone": zone, "shape": shape, "simulated": "true"},
            )
        )
    return specs
