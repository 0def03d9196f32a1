"""The wire part of a status report's devices (DEVICES-WIRE.md): parsing, never raising on input.

Split out of :mod:`fleet.devices` (the rules are in its docstring); what a report applies to the
rows is :func:`fleet.devices.apply_report`.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

MAX_DEVICES = 256
MAX_XID_EVENTS = 32
MAX_PLAUSIBLE_MEMORY = 4 * 2**40  # 4 TiB on one device: beyond is a bug or a lie
MAX_INDEX = 1023
DEVICE_TYPE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
DEVICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")
GPU_TYPES = ("nvidia.com/gpu", "nvidia.com/mig")
TEXT_LIMITS = {
    "model": 200,
    "mig_profile": 64,
    "parent": 200,
    "pci_bus_id": 64,
    "interconnect_group": 128,
    "serial": 128,
    "driver_version": 64,
    "cuda_version": 32,
}
ATTRIBUTE_COLUMNS = {"parent": "parent_device_id"}  # wire name → column, where they differ


# --- parsing ---------------------------------------------------------------------------------------
def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _parse_health(raw: Any) -> tuple[dict, str | None]:
    if raw is None:
        return {}, None
    if not isinstance(raw, dict):
        return {}, "health must be an object"
    out: dict[str, Any] = {}
    events = raw.get("xid_events") or []
    if not isinstance(events, list) or len(events) > MAX_XID_EVENTS:
        return {}, f"health.xid_events must be a list of at most {MAX_XID_EVENTS}"
    xids = []
    for event in events:
        if not isinstance(event, dict) or not _int_in(event.get("xid"), 0, 100_000):
            return {}, "health.xid_events[] needs an integer xid"
        message = event.get("message") or ""
        at = event.get("at") or ""
        xids.append({"xid": event["xid"], "at": str(at)[:64], "message": str(message)[:512]})
    out["xid_events"] = xids
    ecc = raw.get("ecc_uncorrectable")
    if ecc is not None:
        if not _int_in(ecc, 0, 2**53):
            return {}, "health.ecc_uncorrectable must be a non-negative integer"
        out["ecc_uncorrectable"] = ecc
    for flag in ("retired_pages_pending", "remapped_rows_failure", "thermal_throttle", "power_throttle"):
        value = raw.get(flag)
        if value is not None:
            if not isinstance(value, bool):
                return {}, f"health.{flag} must be true or false"
            out[flag] = value
    return out, None


def parse_device(raw: Any) -> tuple[dict | None, str | None]:
    """One wire device → ``(clean dict, None)`` or ``(None, why it is refused)``. Never raises."""
    if not isinstance(raw, dict):
        return None, "a device is an object"
    device_id, kind, index = raw.get("id"), raw.get("type"), raw.get("index")
    if not isinstance(device_id, str) or not DEVICE_ID.fullmatch(device_id):
        return None, "id: required, 1-200 characters without spaces"
    if not isinstance(kind, str) or not DEVICE_TYPE.fullmatch(kind):
        return None, "type: required, '<domain>/<name>'"
    if not _int_in(index, 0, MAX_INDEX):
        return None, f"index: required, an integer from 0 to {MAX_INDEX}"
    clean: dict[str, Any] = {"id": device_id, "type": kind, "index": index}
    for name, limit in TEXT_LIMITS.items():
        value = raw.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or len(value) > limit:
            return None, f"{name}: a string of at most {limit} characters"
        clean[name] = value
    memory = raw.get("memory_bytes")
    if memory is not None:
        if not _int_in(memory, 0, MAX_PLAUSIBLE_MEMORY):
            return None, f"memory_bytes: absurd value {memory!r} (0 to 4 TiB)"
        clean["memory_bytes"] = memory
    numa = raw.get("numa_node")
    if numa is not None:
        if not _int_in(numa, 0, 1023):
            return None, f"numa_node: absurd value {numa!r}"
        clean["numa_node"] = numa
    health, problem = _parse_health(raw.get("health"))
    if problem:
        return None, problem
    clean["health"] = health
    return clean, None


def parse_devices(raw: Any) -> tuple[list[dict] | None, list[dict]]:
    """The ``devices`` member of a report → ``(devices or None when absent, refusals)``.

    ``refusals`` are ``[{"position", "id", "reason"}]``. A duplicate id refuses every copy of it
    (which one is real cannot be told). Over :data:`MAX_DEVICES` refuses the whole part (returns
    ``([], [...])`` — an empty list would retire everything, so the caller keeps the stored rows).
    """
    if raw is None:
        return None, []
    if not isinstance(raw, list):
        return None, [{"position": None, "id": None, "reason": "devices must be a list"}]
    if len(raw) > MAX_DEVICES:
        return None, [{"position": None, "id": None, "reason": f"more than {MAX_DEVICES} devices in one report"}]
    parsed: list[tuple[int, dict]] = []
    refusals: list[dict] = []
    for position, item in enumerate(raw):
        device, problem = parse_device(item)
        if problem:
            refusals.append({"position": position, "id": _wire_id(item), "reason": problem})
        else:
            parsed.append((position, device))
    seen: dict[str, int] = {}
    for _, device in parsed:
        seen[device["id"]] = seen.get(device["id"], 0) + 1
    out = []
    for position, device in parsed:
        if seen[device["id"]] > 1:
            refusals.append({"position": position, "id": device["id"], "reason": "duplicate id within the report"})
        else:
            out.append(device)
    return out, refusals


def _wire_id(item: Any) -> str | None:
    value = item.get("id") if isinstance(item, dict) else None
    return value[:200] if isinstance(value, str) else None


def inventory_digest(devices: list[dict], boot_id: str) -> str:
    """A digest of what the rows hold (attributes, not health): equal digests and no health news
    mean nothing to write."""
    static = [{k: v for k, v in d.items() if k != "health"} for d in devices]
    blob = json.dumps([static, boot_id], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def has_health_news(devices: list[dict]) -> bool:
    """Whether any device reports something to act on (an XID, ECC errors, a failure flag)."""
    for device in devices:
        health = device.get("health") or {}
        if (
            health.get("xid_events")
            or health.get("ecc_uncorrectable")
            or any(
                health.get(flag)
                for flag in ("retired_pages_pending", "remapped_rows_failure", "thermal_throttle", "power_throttle")
            )
        ):
            return True
    return False
