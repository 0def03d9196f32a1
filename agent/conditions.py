"""Node conditions measured on the host, in Kubernetes' vocabulary.

The thresholds follow the kubelet's hard eviction defaults (``memory.available<100Mi``,
``nodefs.available<10%``, ``nodefs.inodesFree<5%``; kubelet "Node-pressure Eviction"), and
for PIDs the share of ``kernel.pid_max`` in use (the kubelet's ``pid.available`` signal). The
agent reports observations; the control plane judges health under the pool's policy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from humanunits import quantity


@dataclass(frozen=True)
class Thresholds:
    """When a pressure condition turns ``True``.

    Args:
        memory_available_bytes: MemoryPressure below this many available bytes.
        disk_available_fraction: DiskPressure below this share of free space on ``disk_path``...
        disk_inodes_free_fraction: ...or below this share of free inodes.
        pid_used_fraction: PIDPressure above this share of ``pid_max`` in use.
    """

    memory_available_bytes: int = 100 * 2**20
    disk_available_fraction: float = 0.10
    disk_inodes_free_fraction: float = 0.05
    pid_used_fraction: float = 0.90
    disk_path: str = "/"


def _condition(type_: str, bad: bool, reason_bad: str, reason_ok: str, message: str) -> dict:
    return {
        "type": type_,
        "status": "True" if bad else "False",
        "reason": reason_bad if bad else reason_ok,
        "message": message,
    }


def pid_max(path: Path = Path("/proc/sys/kernel/pid_max")) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def measure(thresholds: Thresholds = Thresholds(), *, ready: bool = True, ready_reason: str = "") -> list[dict]:
    """``Ready``, ``MemoryPressure``, ``DiskPressure`` and ``PIDPressure`` as measured now."""
    mem = psutil.virtual_memory()
    memory_bad = mem.available < thresholds.memory_available_bytes
    conditions = [
        {
            "type": "Ready",
            "status": "True" if ready else "False",
            "reason": "AgentReady" if ready else (ready_reason or "AgentNotReady"),
            "message": "",
        },
        _condition(
            "MemoryPressure",
            memory_bad,
            "AvailableMemoryLow",
            "SufficientMemory",
            f"memory {quantity('memory', mem.available)} available of {quantity('memory', mem.total)}",
        ),
    ]
    disk = psutil.disk_usage(thresholds.disk_path)
    free_fraction = disk.free / disk.total if disk.total else 1.0
    try:
        st = os.statvfs(thresholds.disk_path)
        inode_fraction = st.f_favail / st.f_files if st.f_files else 1.0
    except OSError:
        inode_fraction = 1.0
    disk_bad = (
        free_fraction < thresholds.disk_available_fraction or inode_fraction < thresholds.disk_inodes_free_fraction
    )
    conditions.append(
        _condition(
            "DiskPressure",
            disk_bad,
            "DiskSpaceLow",
            "SufficientDisk",
            f"{thresholds.disk_path}: {free_fraction:.1%} space, {inode_fraction:.1%} inodes free",
        )
    )
    limit = pid_max()
    used = len(psutil.pids())
    pid_bad = bool(limit) and used / limit > thresholds.pid_used_fraction
    conditions.append(
        _condition(
            "PIDPressure",
            pid_bad,
            "PIDsExhausted",
            "SufficientPID",
            f"{used} processes of pid_max {limit}" if limit else f"{used} processes",
        )
    )
    return conditions


def usage() -> dict:
    """Current use: ``{"cpu": millicores busy since the last call, "memory": bytes in use}``."""
    cpus = psutil.cpu_count() or 1
    busy = psutil.cpu_percent(interval=None) / 100 * cpus
    mem = psutil.virtual_memory()
    return {"cpu": int(busy * 1000), "memory": int(mem.total - mem.available)}
