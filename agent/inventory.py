"""What this host really is: CPU, memory, disk, OS, kernel, container runtimes, GPUs.

Every figure comes from the host (psutil, the ``platform`` module, cgroup files, sockets on
disk, ``nvidia-smi``); nothing is assumed. Where the agent runs inside a cgroup with a CPU
quota or memory limit, the smaller figure is declared, because that is what work placed here
can actually use.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import platform
import shutil
import socket
import subprocess
from collections import Counter
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

# platform.machine() → the Kubernetes/Go architecture names used in labels and affinity.
ARCH_NAMES = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "armv7l": "arm",
    "armv6l": "arm",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
    "i686": "386",
    "i386": "386",
}

# Container runtimes: the binary names looked up on PATH and the sockets their daemons listen on.
RUNTIMES = {
    "containerd": {"binaries": ["containerd"], "sockets": ["/run/containerd/containerd.sock"]},
    "docker": {"binaries": ["docker", "dockerd"], "sockets": ["/var/run/docker.sock", "/run/docker.sock"]},
    "cri-o": {"binaries": ["crio"], "sockets": ["/var/run/crio/crio.sock", "/run/crio/crio.sock"]},
    "podman": {"binaries": ["podman"], "sockets": ["/run/podman/podman.sock"]},
    "runc": {"binaries": ["runc"], "sockets": []},
    "crun": {"binaries": ["crun"], "sockets": []},
}

CGROUP_ROOT = Path("/sys/fs/cgroup")


def architecture() -> str:
    machine = platform.machine()
    return ARCH_NAMES.get(machine.lower(), machine.lower())


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs allowed by a cgroup v2 quota (``cpu.max`` = ``"<quota> <period>"``), or None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def cgroup_memory_limit(root: Path = CGROUP_ROOT) -> int | None:
    """Bytes allowed by a cgroup v2 ``memory.max``, or None if unlimited."""
    try:
        value = (root / "memory.max").read_text().strip()
    except OSError:
        return None
    return None if value == "max" else int(value)


def cpu_millicores() -> int:
    """Usable CPUs in millicores: CPUs in our affinity mask, capped by a cgroup quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (psutil.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    if limit is not None:
        return int(min(cpus, limit) * 1000)
    return cpus * 1000


def memory_bytes() -> int:
    total = psutil.virtual_memory().total
    limit = cgroup_memory_limit()
    return min(total, limit) if limit else total


def container_runtimes(which=shutil.which, exists=os.path.exists) -> dict[str, dict]:
    """Runtimes present on this host: ``{name: {"binary": path | None, "socket": path | None}}``.

    A runtime counts when its binary is on PATH or its daemon's socket exists.
    """
    found = {}
    for name, where in RUNTIMES.items():
        binary = next((p for p in map(which, where["binaries"]) if p), None)
        sock = next((s for s in where["sockets"] if exists(s)), None)
        if binary or sock:
            found[name] = {"binary": binary, "socket": sock}
    return found


def nvidia_gpus(run=subprocess.run, which=shutil.which) -> list[dict]:
    """GPUs reported by ``nvidia-smi`` as ``[{"model", "memory_mib"}]``; empty when absent or failing."""
    if not which("nvidia-smi"):
        return []
    try:
        proc = run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed: %s", exc)
        return []
    if proc.returncode != 0:
        log.warning("nvidia-smi exited %s: %s", proc.returncode, proc.stderr.strip()[:200])
        return []
    gpus = []
    for line in proc.stdout.splitlines():
        if not line.strip():
            continue
        name, _, memory = (part.strip() for part in line.rpartition(","))
        mib = memory.split()[0] if memory else ""
        gpus.append({"model": name, "memory_mib": int(mib) if mib.isascii() and mib.isdigit() else None})
    return gpus


def accelerators(gpus: list[dict]) -> list[dict]:
    """Group GPUs by (model, memory) into the contract's ``accelerators`` entries."""
    counts = Counter((g["model"], g["memory_mib"]) for g in gpus)
    return [
        {"type": "nvidia.com/gpu", "model": model, "memory": f"{mib}Mi" if mib else "0", "count": n}
        for (model, mib), n in sorted(counts.items(), key=lambda kv: str(kv[0]))
    ]


def addresses() -> list[str]:
    """Unicast addresses of up interfaces, loopback and link-local excluded."""
    stats = psutil.net_if_stats()
    found: list[str] = []
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ip = ipaddress.ip_address(addr.address.split("%")[0])
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local or ip.is_multicast:
                continue
            if str(ip) not in found:
                found.append(str(ip))
    return found


def network_class() -> str:
    """``"1g"``, ``"10g"``, … from the fastest up interface's link speed; ``""`` when unknown."""
    speeds = [s.speed for n, s in psutil.net_if_stats().items() if s.isup and s.speed and not n.startswith("lo")]
    if not speeds:
        return ""
    mbps = max(speeds)
    for floor, name in ((400_000, "400g"), (100_000, "100g"), (25_000, "25g"), (10_000, "10g"), (1_000, "1g")):
        if mbps >= floor:
            return name
    return f"{mbps}m"


def collect(*, disk_path: str = "/", run=subprocess.run, which=shutil.which, exists=os.path.exists) -> dict:
    """The enrollment fields describing this host: ``hostname``, ``addresses`` and ``capability``.

    ``capability.resources`` are quantity strings in canonical units (cpu in millicores with an
    ``m`` suffix, bytes as plain integers); ``disk_path`` is the filesystem whose size is
    declared as ``ephemeral-storage``.
    """
    gpus = nvidia_gpus(run=run, which=which)
    resources = {
        "cpu": f"{cpu_millicores()}m",
        "memory": str(memory_bytes()),
        "ephemeral-storage": str(psutil.disk_usage(disk_path).total),
    }
    if gpus:
        resources["nvidia.com/gpu"] = str(len(gpus))
    runtimes = container_runtimes(which=which, exists=exists)
    return {
        "hostname": socket.gethostname(),
        "addresses": addresses(),
        "capability": {
            "resources": resources,
            "accelerators": accelerators(gpus),
            "features": {
                "arch": architecture(),
                "os": platform.system().lower(),
                "kernel": platform.release(),
                "runtimes": sorted(runtimes),
                "network_class": network_class(),
                "services": [],
            },
        },
    }
