"""Device health and taints (docs/fleet.md, "Devices"): a report's health judged on one row,
automatic taints set and lifted. In memory only: the callers (:func:`fleet.devices.apply_report`,
:mod:`fleet.device_actions`) hold the row under lock and save it.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils.dateparse import parse_datetime

from .choices import DeviceHealth
from .device_wire import MAX_XID_EVENTS
from .models import Device
from .xid import classify_xid

FAULT_TAINT = "nodepool.dev/device-fault"
RESET_TAINT = "nodepool.dev/device-reset"
MISSING_TAINT = "nodepool.dev/device-missing"
AUTO_TAINTS = (FAULT_TAINT, RESET_TAINT, MISSING_TAINT)
HARD_EFFECTS = ("NoSchedule", "NoExecute")
FLAP_LIMIT = 3
FLAP_WINDOW = timedelta(hours=1)


def classify(xid: int, message: str = "") -> str:
    """The resolution class of an XID by NVIDIA's catalogue (:func:`fleet.xid.classify_xid`):
    ``application``, ``info``, ``reset_gpu`` or ``fatal`` (unknown XIDs: ``reset_gpu``)."""
    return str(classify_xid(xid, message or None).resolution)


def is_hard(taints: list[dict]) -> bool:
    return any(t.get("effect") in HARD_EFFECTS for t in taints)


def set_taint(row: Device, key: str, effect: str, value: str, reason: str, now: datetime, source: str) -> bool:
    """Put taint ``key:effect`` on ``row`` (in memory). True when it is new."""
    for taint in row.taints:
        if taint.get("key") == key and taint.get("effect") == effect:
            taint.update(value=value, reason=reason)
            return False
    row.taints = [
        *row.taints,
        {"key": key, "value": value, "effect": effect, "reason": reason, "source": source, "added_at": now.isoformat()},
    ]
    return True


def drop_taints(row: Device, keys) -> bool:
    kept = [t for t in row.taints if t.get("key") not in keys]
    changed = len(kept) != len(row.taints)
    row.taints = kept
    return changed


def judge_health(row: Device, health: dict, now: datetime, boot_id: str) -> tuple[list, str | None]:
    """Apply one report's health to ``row`` (in memory). Returns ``(events, new hard effect)``."""
    events: list[tuple[str, str, dict]] = []
    worst = None  # "fatal" > "reset_gpu"
    xids = []
    for event in health.get("xid_events") or []:
        resolution = classify(event["xid"], event.get("message") or "")
        xids.append({**event, "resolution": resolution})
        if resolution == "fatal":
            worst = "fatal"
        elif resolution == "reset_gpu" and worst is None:
            worst = "reset_gpu"
    previous_ecc = (row.health_detail or {}).get("ecc_uncorrectable") or 0
    ecc = health.get("ecc_uncorrectable")
    causes = [f"xid {x['xid']} ({x['resolution']})" for x in xids if x["resolution"] in ("fatal", "reset_gpu")]
    if isinstance(ecc, int) and ecc > previous_ecc:
        causes.append(f"uncorrectable ECC errors {previous_ecc} → {ecc}")
        worst = worst or "reset_gpu"
    for flag in ("remapped_rows_failure", "retired_pages_pending"):
        if health.get(flag):
            causes.append(flag)
            worst = worst or "reset_gpu"
    detail = dict(row.health_detail or {})
    detail.update({k: v for k, v in health.items() if k != "xid_events"})
    if xids:
        detail["recent_xids"] = [*(detail.get("recent_xids") or []), *xids][-MAX_XID_EVENTS:]
        informational = [x for x in xids if x["resolution"] in ("info", "application")]
        if informational:
            events.append(
                (
                    "recorded",
                    f"device {row.device_id}: xid " + ", ".join(str(x["xid"]) for x in informational) + " recorded",
                    {"device_id": row.device_id, "xids": informational},
                )
            )
    detail["reported_at"] = now.isoformat()
    row.health_detail = detail
    if worst is None:
        if row.health in (DeviceHealth.UNKNOWN, DeviceHealth.MISSING) and not has_auto_taint(row):
            row.health = DeviceHealth.HEALTHY
        return events, None
    row.health = DeviceHealth.UNHEALTHY
    row.last_fault_at = now
    row.fault_boot_id = boot_id
    window_start = now - FLAP_WINDOW
    recent = [t for t in row.recent_faults or [] if (parse_datetime(t) or now) >= window_start]
    row.recent_faults = [*recent, now.isoformat()][-FLAP_LIMIT * 2 :]
    reason = "; ".join(causes)
    if worst == "fatal":
        set_taint(row, FAULT_TAINT, "NoExecute", "fatal", reason, now, "auto")
        effect = "NoExecute"
    else:
        set_taint(row, RESET_TAINT, "NoSchedule", "reset-required", reason, now, "auto")
        effect = "NoSchedule"
    events.append(("tainted", f"device {row.device_id}: {reason} → {effect}", {"device_id": row.device_id}))
    if len(row.recent_faults) >= FLAP_LIMIT and not row.held:
        row.held = True
        events.append(
            (
                "held",
                f"device {row.device_id}: {len(row.recent_faults)} faults within {FLAP_WINDOW}: held until an "
                "operator releases it",
                {"device_id": row.device_id},
            )
        )
    return events, effect


def has_auto_taint(row: Device) -> bool:
    return any(t.get("source") == "auto" for t in row.taints or [])


def recover_row(row: Device, *, rebooted: bool, now: datetime, recovery: timedelta) -> bool:
    """Lift ``row``'s automatic taints after a reboot or a quiet recovery period. True if lifted."""
    if row.held or not has_auto_taint(row) or row.health == DeviceHealth.MISSING:
        return False
    quiet = row.last_fault_at is None or now - row.last_fault_at >= recovery
    if not (rebooted or quiet):
        return False
    row.taints = [t for t in row.taints if t.get("source") != "auto"]
    row.health = DeviceHealth.HEALTHY
    return True
