"""Devices the agent owns: inventory, health and XID events per device, and lease isolation.

The wire shapes are DEVICES-WIRE's (docs/agent.md, "Devices"): each device is an object with a
stable ``id`` (a GPU's UUID), a ``type`` (``"<domain>/<name>"``), an ``index`` and optional
attributes and ``health``. A vendor fits in through a :class:`DeviceProvider`; NVIDIA's is
:class:`agent.nvidia.NvidiaProvider`, the only one so far.

:class:`DeviceTracker` is what the agent holds: it refreshes the inventory at most every
``refresh`` seconds (``nvidia-smi`` is not run on every heartbeat), collects XID events as they
come, and hands each status report the devices with the events not yet reported.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

MAX_DEVICES = 256  # per report (DEVICES-WIRE.md)
MAX_XID_EVENTS = 32  # per device and report; the oldest are dropped past it
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
GPU_TYPES = ("nvidia.com/gpu", "nvidia.com/mig")


class DeviceProvider(Protocol):
    """One vendor's devices on this host.

    ``inventory()`` returns the devices as the wire wants them (``health`` without
    ``xid_events``), ``[]`` when the vendor's tools are absent; it may run commands and must not
    raise for a host without the vendor's hardware. ``xid_events()`` returns the error events
    seen since its last call, each ``{"xid": int, "at": RFC 3339, "message": str}`` plus
    ``"device_id"`` or ``"pci_bus_id"`` to say which device; ``[]`` when none or no source.
    """

    name: str

    def inventory(self) -> list[dict]: ...

    def xid_events(self) -> list[dict]: ...


def boot_id(path: Path = BOOT_ID_PATH) -> str:
    """This boot's id (Linux ``/proc/sys/kernel/random/boot_id``); ``""`` where there is none.

    A different value from the last report means the host rebooted: the server takes it as a
    reset of every device on the node.
    """
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def pci_key(bus_id: str | None) -> str:
    """``"0000:17:00"`` for ``"00000000:17:00.0"`` (nvidia-smi) or ``"0000:17:00"`` (kernel log).

    The kernel's ``NVRM: Xid (PCI:0000:17:00)`` drops the function number and keeps a 4-digit
    domain; nvidia-smi prints an 8-digit domain and the function. Both map to this key.
    """
    if not bus_id:
        return ""
    parts = bus_id.strip().lower().removeprefix("pci:").split(":")
    if len(parts) != 3:
        return bus_id.strip().lower()
    domain, bus, device = parts
    try:
        return f"{int(domain, 16):04x}:{bus}:{device.split('.')[0]}"
    except ValueError:
        return bus_id.strip().lower()


def count_resources(devices: list[dict]) -> dict[str, str]:
    """The count resources old servers read (``{"nvidia.com/gpu": "8"}``), one per device type."""
    counts = Counter(d["type"] for d in devices if d.get("type"))
    return {kind: str(n) for kind, n in sorted(counts.items())}


def lease_environment(devices: list[dict] | None) -> dict[str, str]:
    """The environment that confines a workload to its lease's devices (DEVICES-WIRE.md).

    Args:
        devices: the lease's ``devices`` (``[{"id", "type", "index"}]``), in the lease's order;
            None or ``[]`` for a lease without devices.

    Returns ``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES`` naming exactly the lease's
    GPUs and MIG instances by UUID (``""`` and ``"void"`` when it has none, so a workload never
    sees every GPU by default), and ``NODEPOOL_DEVICES`` naming all its devices, any type.
    """
    devices = [d for d in devices or [] if isinstance(d, dict) and isinstance(d.get("id"), str) and d["id"]]
    gpus = [d["id"] for d in devices if d.get("type") in GPU_TYPES]
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(gpus),
        "NVIDIA_VISIBLE_DEVICES": ",".join(gpus) if gpus else "void",
        "NODEPOOL_DEVICES": ",".join(d["id"] for d in devices),
    }


class DeviceTracker:
    """The agent's view of its devices between status reports.

    Args:
        providers: the vendors to ask (:class:`DeviceProvider`).
        refresh: seconds an inventory is reused before the providers are asked again.
        clock: monotonic seconds (tests move it).
    """

    def __init__(self, providers: list[DeviceProvider], *, refresh: float = 30.0, clock=time.monotonic):
        self.providers = list(providers)
        self.refresh = refresh
        self.clock = clock
        self._inventory: list[dict] = []
        self._taken_at: float | None = None
        # Events not yet in an answered status report: device id -> [event], oldest first.
        self.pending: dict[str, list[dict]] = {}
        self.unmatched = 0  # events naming no device we know (logged, counted, not reported)
        # Whether any provider ever found a device: a host that never had one sends no ``devices``
        # at all (no news, and nothing for the server to parse); one that had some sends the list,
        # even empty, because GPUs that vanished are news (the server marks them missing).
        self.ever_found = False

    def inventory(self, *, force: bool = False) -> list[dict]:
        """The devices, refreshed when older than ``refresh`` (or ``force``); a failing provider
        keeps its last answer out and is logged, never raised."""
        now = self.clock()
        if force or self._taken_at is None or now - self._taken_at >= self.refresh:
            found: list[dict] = []
            seen: set[str] = set()
            for provider in self.providers:
                try:
                    devices = provider.inventory()
                except Exception:  # a vendor tool's surprise must not stop heartbeats
                    log.exception("device provider %s failed", getattr(provider, "name", provider))
                    continue
                for device in devices:
                    if device.get("id") in seen:
                        log.warning("device %s reported twice; the second is dropped", device.get("id"))
                        continue
                    seen.add(device["id"])
                    found.append(device)
            if len(found) > MAX_DEVICES:
                log.warning("%s devices found; reporting the first %s", len(found), MAX_DEVICES)
                found = found[:MAX_DEVICES]
            self._inventory, self._taken_at = found, now
            self.ever_found = self.ever_found or bool(found)
        return self._inventory

    def collect_events(self) -> None:
        """Take the providers' new XID events into ``pending``, matched to a device by id or PCI bus."""
        by_pci = {pci_key(d.get("pci_bus_id")): d["id"] for d in self._inventory if d.get("pci_bus_id")}
        known = {d["id"] for d in self._inventory}
        for provider in self.providers:
            try:
                events = provider.xid_events()
            except Exception:
                log.exception("XID source of %s failed", getattr(provider, "name", provider))
                continue
            for event in events:
                device_id = event.get("device_id")
                if device_id not in known:
                    device_id = by_pci.get(pci_key(event.get("pci_bus_id")))
                if not device_id:
                    self.unmatched += 1
                    log.warning("XID %s for no known device: %s", event.get("xid"), event)
                    continue
                entry = {"xid": int(event["xid"]), "at": event.get("at", ""), "message": event.get("message", "")}
                queue = self.pending.setdefault(device_id, [])
                queue.append(entry)
                del queue[:-MAX_XID_EVENTS]

    def report(self) -> list[dict]:
        """The devices for a status report: the inventory with each device's pending XID events."""
        self.collect_events()
        devices = []
        for device in self.inventory():
            health = dict(device.get("health") or {})
            health["xid_events"] = list(self.pending.get(device["id"], []))
            devices.append({**device, "health": health})
        return devices

    def reported(self, devices: list[dict]) -> None:
        """A status report carrying ``devices`` was answered: its events are no longer pending."""
        for device in devices:
            sent = len((device.get("health") or {}).get("xid_events") or [])
            queue = self.pending.get(device["id"])
            if queue is not None and sent:
                del queue[:sent]
                if not queue:
                    del self.pending[device["id"]]

    @staticmethod
    def fingerprint(devices: list[dict]) -> tuple:
        """What in the devices warrants a status report when it changes: a device added or gone,
        a health flag or the uncorrectable ECC count. (XID events not yet reported are a reason
        of their own: :meth:`has_unreported_events`.)"""
        out = []
        for d in devices:
            health = d.get("health") or {}
            flags = tuple(
                (key, value) for key, value in sorted(health.items()) if key != "xid_events" and value is not None
            )
            out.append((d["id"], flags))
        return tuple(sorted(out))

    @staticmethod
    def has_unreported_events(devices: list[dict]) -> bool:
        """True when a device in a report being built carries XID events (they are unreported)."""
        return any((d.get("health") or {}).get("xid_events") for d in devices)
