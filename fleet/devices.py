"""Devices of a node: the wire part of a status report, the inventory rows, verification, health.

The wire shape is DEVICES-WIRE.md (documented in docs/api-contract.md): a report carries
``boot_id`` and ``devices: [{"id", "type", "index", "model", "memory_bytes", "mig_profile",
"parent", "pci_bus_id", "numa_node", "interconnect_group", "serial", "driver_version",
"cuda_version", "health": {...}}]`` (at most :data:`MAX_DEVICES`).

Rules (docs/fleet.md, "Devices"):

- **Parsing never spoils a report.** :func:`parse_devices` checks each device on its own; a bad
  one (malformed, absurd values, a duplicate id within the report) is refused with a reason and
  the rest apply; more than :data:`MAX_DEVICES` refuses the whole device part. Refusals become one
  ``device`` event. Nothing here raises on input.
- **Verified** means: the device id is unique among live nodes (the partial unique index
  ``device_one_live_id``) and the device was present when the node was admitted
  (:func:`verify_node_devices`, called by admission) or an operator verified it since
  (:func:`device_verify`). A device that appears later is not allocatable until then; one whose
  model or memory changed from its verified snapshot loses its verification.
- **Allocatable** (:attr:`fleet.models.Device.allocatable`): verified, not retired, not held, not
  unhealthy or missing, no NoSchedule/NoExecute taint. The node's count resource of each device
  type (``nvidia.com/gpu``) is that count (:func:`sync_counts`), so count-based requests keep working.
- **Handover** (the one definition the first-hour paths use too): a device id reported by node B
  while a live row of node A holds it is *handed over* (A's row retired, B's created) when A is
  retired or rejected, or when A is B (a new incarnation of the same node, an agent taking over
  an imported node: same node row). Otherwise it is an **identity conflict**: B's device is not
  stored and :data:`fleet.signals.device_identity_conflict` asks maintenance to quarantine B, the
  later claimant, never A.
- **Health**: XID events are classified by :func:`fleet.xid.classify_xid` (NVIDIA's catalogue):
  ``fatal`` → taint ``nodepool.dev/device-fault:NoExecute``; ``reset_gpu`` → taint
  ``nodepool.dev/device-reset:NoSchedule``; ``info``/``application`` → recorded only. Uncorrectable
  ECC growth, a remapped-rows failure or pending retired pages count as ``reset_gpu``; a device no
  longer reported is ``missing`` (NoExecute). Device health never feeds the node's health.
  Automatic taints lift after ``Pool.device_recovery_seconds`` without a new fault, or at once
  when the host's ``boot_id`` changed; :data:`FLAP_LIMIT` faults within :data:`FLAP_WINDOW` hold
  the device until an operator releases it.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import BooleanField, Count, Exists, ExpressionWrapper, F, OuterRef, Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from nodepool.api.problems import Conflict, NotFound, Problem
from nodepool.api.versioning import check_version

from . import event_types, signals
from .capability import TAINT_EFFECTS, label_key_ok
from .choices import DeviceHealth, Lifecycle
from .errors import DEVICE_NOT_FOUND, DEVICE_NOT_HELD, INVALID_TAINT, NODE_NOT_FOUND, TAINT_NOT_FOUND
from .events import Actor, event_row, record_event
from .models import Device, Node, NodeEvent, NodeResource
from .xid import classify_xid

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
    if not isinstance(device_id, str) or not DEVICE_ID.match(device_id):
        return None, "id: required, 1-200 characters without spaces"
    if not isinstance(kind, str) or not DEVICE_TYPE.match(kind):
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


# --- rows ------------------------------------------------------------------------------------------
def _columns(device: dict) -> dict[str, Any]:
    values = {
        "type": device["type"],
        "index": device["index"],
        "memory_bytes": device.get("memory_bytes"),
        "numa_node": device.get("numa_node"),
    }
    for name in TEXT_LIMITS:
        values[ATTRIBUTE_COLUMNS.get(name, name)] = device.get(name) or ""
    return values


def _declared(device: dict) -> dict:
    return {k: v for k, v in device.items() if k != "health"}


def _is_hard(taints: list[dict]) -> bool:
    return any(t.get("effect") in HARD_EFFECTS for t in taints)


def _set_taint(row: Device, key: str, effect: str, value: str, reason: str, now: datetime, source: str) -> bool:
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


def _drop_taints(row: Device, keys) -> bool:
    kept = [t for t in row.taints if t.get("key") not in keys]
    changed = len(kept) != len(row.taints)
    row.taints = kept
    return changed


def _node_events(node: Node, actor: Actor, items: list[tuple[str, str, dict]]) -> list[NodeEvent]:
    return [
        event_row(node.pk, event_types.DEVICE, actor, to_state=to_state, reason=reason, data=data, pool=node.pool_id)
        for to_state, reason, data in items
    ]


def _judge_health(row: Device, health: dict, now: datetime, boot_id: str) -> tuple[list, str | None]:
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
        if row.health in (DeviceHealth.UNKNOWN, DeviceHealth.MISSING) and not _has_auto_taint(row):
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
        _set_taint(row, FAULT_TAINT, "NoExecute", "fatal", reason, now, "auto")
        effect = "NoExecute"
    else:
        _set_taint(row, RESET_TAINT, "NoSchedule", "reset-required", reason, now, "auto")
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


def _has_auto_taint(row: Device) -> bool:
    return any(t.get("source") == "auto" for t in row.taints or [])


def _recover(row: Device, *, rebooted: bool, now: datetime, recovery: timedelta) -> bool:
    """Lift ``row``'s automatic taints after a reboot or a quiet recovery period. True if lifted."""
    if row.held or not _has_auto_taint(row) or row.health == DeviceHealth.MISSING:
        return False
    quiet = row.last_fault_at is None or now - row.last_fault_at >= recovery
    if not (rebooted or quiet):
        return False
    row.taints = [t for t in row.taints if t.get("source") != "auto"]
    row.health = DeviceHealth.HEALTHY
    return True


def apply_report(
    *,
    node: Node,
    devices: list[dict] | None,
    refusals: list[dict],
    boot_id: str | None,
    actor: Actor,
    now: datetime | None = None,
    force: bool = False,
) -> dict:
    """Apply the device part of a status report (or an enrollment inventory) to ``node``'s rows.

    Args:
        devices: parsed devices (:func:`parse_devices`), None when the report had no ``devices``.
        refusals: what parsing refused (recorded as one event).
        boot_id: the host's boot id, None when not sent.
        force: write even when the digest is unchanged (enrollment, tests).

    Returns ``{"changed": bool, "conflicts": [...], "faulted": [device pks], "drained": [device pks]}``.
    Cost when nothing changed (same digest, no health news, same boot): no statement at all.
    """
    now = now or timezone.now()
    result: dict[str, Any] = {"changed": False, "conflicts": [], "faulted": [], "drained": []}
    boot = boot_id if boot_id is not None else node.boot_id
    if refusals:
        NodeEvent.objects.bulk_create(
            _node_events(node, actor, [("refused", f"{len(refusals)} device(s) refused", {"refused": refusals[:32]})])
        )
    if devices is None:
        if boot_id is not None and boot_id != node.boot_id:
            Node.objects.filter(pk=node.pk).update(boot_id=boot_id)
            node.boot_id = boot_id
        return result
    digest = inventory_digest(devices, boot)
    if not force and digest == node.devices_digest and not has_health_news(devices):
        return result
    rebooted = bool(node.boot_id) and boot != node.boot_id
    recovery = timedelta(seconds=getattr(node.pool, "device_recovery_seconds", 900) or 0)
    with transaction.atomic():
        # The node row first, then its devices: the order every node and device action takes (an
        # operator's device action, the grant's hold of its node, the recovery sweep), so that a
        # report never holds device rows while it waits for the node (a deadlock with any of them).
        _lock_node(node.pk)
        rows = {
            row.device_id: row
            # of self, in pk order: the model's ordering joins the node, which FOR UPDATE would lock too
            for row in Device.objects.select_for_update(of=("self",))
            .filter(node=node, retired_at__isnull=True)
            .order_by("pk")
        }
        events: list[tuple[str, str, dict]] = []
        reported = {d["id"]: d for d in devices}
        new_ids = [i for i in reported if i not in rows]
        holders = {
            row.device_id: row
            for row in Device.objects.select_related("node")
            .filter(device_id__in=new_ids, retired_at__isnull=True)
            .exclude(node=node)
        }
        # Rows no longer reported: replaced (a new id at the same PCI address or index) or missing.
        for device_id, row in rows.items():
            if device_id in reported:
                continue
            replacement = next(
                (
                    d
                    for d in devices
                    if d["id"] not in rows
                    and d["type"] == row.type
                    and ((row.pci_bus_id and d.get("pci_bus_id") == row.pci_bus_id) or d["index"] == row.index)
                ),
                None,
            )
            if (row.declared or {}).get("synthetic"):
                # A placeholder of the Kubernetes import: an agent reporting real devices takes the
                # node over (the handover of docs/fleet.md), so the placeholder retires quietly.
                row.retired_at, row.retired_reason = now, "an agent took the imported node over"
                events.append(
                    ("retired", f"synthetic device {device_id} replaced by reported devices", {"device_id": device_id})
                )
            elif replacement is not None:
                row.retired_at, row.retired_reason = now, f"replaced by {replacement['id']}"
                events.append(
                    ("retired", f"device {device_id} replaced by {replacement['id']}", {"device_id": device_id})
                )
            elif row.health != DeviceHealth.MISSING:
                row.health = DeviceHealth.MISSING
                row.last_fault_at = now
                _set_taint(row, MISSING_TAINT, "NoExecute", "missing", "no longer reported by the node", now, "auto")
                events.append(
                    ("missing", f"device {device_id} no longer reported: NoExecute", {"device_id": device_id})
                )
                result["faulted"].append(row.pk)
            row.hard_tainted = _is_hard(row.taints)
            row.save()
        for device_id, device in reported.items():
            row = rows.get(device_id)
            if row is None:
                holder = holders.get(device_id)
                if holder is not None:
                    if holder.node.lifecycle in (Lifecycle.RETIRED, Lifecycle.REJECTED):
                        holder.retired_at = now
                        holder.retired_reason = f"handed over to node {node.pk}"
                        holder.save(update_fields=["retired_at", "retired_reason"])
                    else:
                        result["conflicts"].append(
                            {"device_id": device_id, "held_by": str(holder.node_id), "type": device["type"]}
                        )
                        continue
                row = Device(node=node, device_id=device_id, first_seen_at=now, last_seen_at=now, **_columns(device))
                row.declared = _declared(device)
                try:
                    with transaction.atomic():
                        row.save()
                except IntegrityError:  # another node claimed it in a racing report: it came first
                    result["conflicts"].append({"device_id": device_id, "held_by": None, "type": device["type"]})
                    continue
                events.append(
                    ("added", f"device {device_id} ({device['type']}) added, not verified", {"device_id": device_id})
                )
            else:
                columns = _columns(device)
                for name, value in columns.items():
                    setattr(row, name, value)
                row.declared = _declared(device)
                row.last_seen_at = now
                if row.health == DeviceHealth.MISSING:
                    row.health = DeviceHealth.UNKNOWN
                    _drop_taints(row, (MISSING_TAINT,))
                    events.append(("returned", f"device {device_id} reported again", {"device_id": device_id}))
                verified = row.verified or {}
                if row.verified_at is not None and (
                    verified.get("model", "") != (device.get("model") or "")
                    or verified.get("memory_bytes") != device.get("memory_bytes")
                ):
                    row.verified_at = None
                    events.append(
                        (
                            "unverified",
                            f"device {device_id}: model or memory changed since verification",
                            {"device_id": device_id},
                        )
                    )
            if _recover(row, rebooted=rebooted, now=now, recovery=recovery):
                events.append(("recovered", f"device {device_id}: automatic taints lifted", {"device_id": device_id}))
            health_events, effect = _judge_health(row, device.get("health") or {}, now, boot)
            events += health_events
            if effect == "NoExecute":
                result["faulted"].append(row.pk)
            elif effect == "NoSchedule":
                result["drained"].append(row.pk)
            row.hard_tainted = _is_hard(row.taints)
            row.save()
        if result["conflicts"]:
            events.append(
                (
                    "conflict",
                    f"{len(result['conflicts'])} device id(s) held by another live node",
                    {"conflicts": result["conflicts"]},
                )
            )
        NodeEvent.objects.bulk_create(_node_events(node, actor, events))
        Node.objects.filter(pk=node.pk).update(devices_digest=digest, boot_id=boot)
        node.devices_digest, node.boot_id = digest, boot
        sync_counts(node)
        result["changed"] = True
        result["above_verified"] = _above_verified(node)
    if result.get("above_verified"):
        signals.devices_above_verified.send(sender=Node, node=node, over=result["above_verified"], actor=actor)
    if result["conflicts"]:
        signals.device_identity_conflict.send(sender=Node, node=node, conflicts=result["conflicts"], actor=actor)
    if result["faulted"] or result["drained"]:
        signals.device_faulted.send(
            sender=Node, node=node, faulted=result["faulted"], drained=result["drained"], actor=actor
        )
    return result


def _above_verified(node: Node) -> dict:
    """``{type: {"declared", "verified"}}`` for each device type of ``node`` with more live devices
    than verified ones, where at least one is verified (one grouped query). More devices than
    verified fall under maintenance's ``capacity_above_verified`` rule (fleet.signals)."""
    over = {}
    for kind, live, verified in (
        Device.objects.filter(node=node, retired_at__isnull=True)
        .values_list("type")
        .annotate(live=Count("pk"), verified=Count("pk", filter=Q(verified_at__isnull=False)))
        .order_by("type")
    ):
        if verified and live > verified:
            over[kind] = {"declared": live, "verified": verified}
    return over


def held_for_itself() -> Exists:
    """True for a device a live lease holds for itself (a row of the lease's count of its type);
    not for the implied rows of a whole GPU's MIG instances."""
    claims = Device._meta.get_field("claims").related_model  # leases.LeaseDevice, without importing leases
    return Exists(claims.objects.filter(device_id=OuterRef("pk"), live=True, implied=False))


def counted() -> Q:
    """A device row in its type's allocatable count: allocatable (verified, healthy, untainted, not
    held out) and not taken by a relative — a GPU and its MIG instances exclude each other, so a
    device ``claimed`` (fleet.models.Device) but not held for itself (:func:`held_for_itself`)
    counts nowhere while that lease lives. What :func:`sync_counts` writes, pool capacity and
    ``/metrics`` read (a device that failed while held is the one difference: sync_counts keeps it
    until its lease ends, see there)."""
    usable = Q(verified_at__isnull=False, retired_at__isnull=True, held=False, hard_tainted=False) & ~Q(
        health__in=(DeviceHealth.UNHEALTHY, DeviceHealth.MISSING)
    )
    return usable & (Q(claimed=False) | Q(held_for_itself()))


def sync_counts(node: Node) -> dict[str, int]:
    """Set the node's count resource of each device type it has rows of; returns ``{type: count}``.

    The count is the type's allocatable devices plus the devices a live lease still holds that are
    no longer allocatable (a GPU that failed while allocated): ``allocated`` counts that lease's
    devices until it ends, so counting its device in ``allocatable`` too keeps ``free =
    allocatable - allocated`` equal to the allocatable devices nobody holds — neither one fewer
    (the failed device subtracted twice) nor ever negative. When the lease ends, its release
    (leases.devices.release) calls this again and the failed device leaves the count.

    Only for a node with an inventory (admitted): before admission nothing is offered. Callers
    hold the rows this reads still: the node's device rows (a fault, a verification, a report) or
    the released lease's devices (leases.devices.release), so a fault and a release racing on one
    device are counted in one order or the other, never from two half views.
    """
    if node.lifecycle in (Lifecycle.PENDING, Lifecycle.ADMITTING, Lifecycle.REJECTED):
        return {}
    counts: dict[str, int] = {}
    for row in Device.objects.filter(node=node, retired_at__isnull=True).annotate(held_by_lease=held_for_itself()):
        counts.setdefault(row.type, 0)
        # A device claimed but not held for itself is taken by a relative (the MIG instances of a
        # GPU leased whole, the GPU of a leased MIG instance): in no count while that lease lives.
        counts[row.type] += row.held_by_lease or (row.allocatable and not row.claimed)
    if not counts:
        return counts
    reserved = node.pool.reserved_totals()
    existing = {r.name: r for r in NodeResource.objects.filter(node=node, name__in=list(counts))}
    for name, count in counts.items():
        allocatable = max(0, count - reserved.get(name, 0))
        row = existing.get(name)
        if row is None:
            NodeResource.objects.create(
                node=node, name=name, capacity=count, reserved=reserved.get(name, 0), allocatable=allocatable
            )
        elif row.capacity != count or row.allocatable != allocatable:
            NodeResource.objects.filter(pk=row.pk).update(capacity=count, allocatable=allocatable)
    return counts


def verify_node_devices(*, node: Node, actor: Actor, now: datetime | None = None) -> int:
    """Verify every live device of ``node`` present now (admission). Returns how many.

    Not the synthetic devices of a Kubernetes import (ids ``k8s-…``, fleet.k8s_import): nobody
    reported them, so only an operator's "verify device" or an agent taking the node over does."""
    now = now or timezone.now()
    rows = list(
        Device.objects.filter(node=node, retired_at__isnull=True, verified_at__isnull=True).exclude(
            device_id__startswith="k8s-"
        )
    )
    for row in rows:
        row.verified = _declared_snapshot(row)
        row.verified_at, row.verified_by = now, f"admission:{actor.name}"
        row.save(update_fields=["verified", "verified_at", "verified_by"])
    return len(rows)


def _declared_snapshot(row: Device) -> dict:
    return {
        "id": row.device_id,
        "type": row.type,
        "model": row.model,
        "memory_bytes": row.memory_bytes,
        "mig_profile": row.mig_profile,
        "serial": row.serial,
        "pci_bus_id": row.pci_bus_id,
    }


def _lock_node(node_id) -> bool:
    """Lock the node row (``FOR NO KEY UPDATE``) before any of its device rows. False if gone."""
    return bool(list(Node.objects.select_for_update(no_key=True).filter(pk=node_id).values_list("pk", flat=True)))


def _locked_device(node_id, device_id: str, expected_version=None) -> Device:
    """The device row under lock, its node locked first (``FOR NO KEY UPDATE``, the order every
    node action takes) and checked against the operator's expected node version (412), which
    this action then bumps: a device action is a change of the node."""
    node = Node.objects.select_for_update(no_key=True).filter(pk=node_id).first()
    if node is None:
        raise NotFound("No such node.", NODE_NOT_FOUND)
    if expected_version is not None:
        check_version(node.version, expected_version)
    row = (
        Device.objects.select_for_update(of=("self",))
        .filter(node_id=node_id, device_id=device_id, retired_at__isnull=True)
        .order_by("pk")
        .first()
    )
    if row is None:
        raise NotFound("No such live device on this node.", DEVICE_NOT_FOUND)
    Node.objects.filter(pk=node_id).update(version=F("version") + 1)
    node.version += 1
    row.node = node
    return row


def device_verify(
    *, node_id, device_id: str, actor: Actor, reason: str = "", now: datetime | None = None, expected_version=None
) -> Device:
    """The operator's "verify device": accept the device's current attributes; it becomes
    allocatable (if healthy and untainted). Raises 404 ``device_not_found``."""
    now = now or timezone.now()
    with transaction.atomic():
        row = _locked_device(node_id, device_id, expected_version)
        row.verified = _declared_snapshot(row)
        row.verified_at, row.verified_by = now, actor.name
        row.save(update_fields=["verified", "verified_at", "verified_by"])
        record_event(
            row.node, event_types.DEVICE, actor, to_state="verified",
            reason=reason or f"device {device_id} verified", data={"device_id": device_id},
        )  # fmt: skip
        sync_counts(row.node)
    return row


def device_taint(
    *,
    node_id,
    device_id: str,
    key: str,
    effect: str,
    value: str = "",
    reason: str,
    actor: Actor,
    now=None,
    expected_version=None,
) -> Device:
    """An operator's taint on one device (like a cordon hold, with a reason). NoExecute evicts its
    leases that do not tolerate it. Raises 400 ``invalid_taint`` / 404 ``device_not_found``."""
    now = now or timezone.now()
    if not label_key_ok(key):
        raise Problem("key: not a valid taint key", INVALID_TAINT, errors=[{"field": "key", "code": "invalid_taint"}])
    if effect not in TAINT_EFFECTS:
        raise Problem(f"effect: must be one of {', '.join(TAINT_EFFECTS)}", INVALID_TAINT,
                      errors=[{"field": "effect", "code": "invalid_taint"}])  # fmt: skip
    if not isinstance(reason, str) or not reason.strip():
        raise Problem("reason: required", INVALID_TAINT, errors=[{"field": "reason", "code": "required"}])
    with transaction.atomic():
        row = _locked_device(node_id, device_id, expected_version)
        _set_taint(row, key, effect, value, reason, now, "operator")
        row.hard_tainted = _is_hard(row.taints)
        row.save(update_fields=["taints", "hard_tainted"])
        taint = {"key": key, "value": value, "effect": effect}
        record_event(
            row.node, event_types.DEVICE, actor, to_state="tainted", reason=f"device {device_id}: {reason}",
            data={"device_id": device_id, "taint": taint},
        )  # fmt: skip
        sync_counts(row.node)
    if effect in HARD_EFFECTS:
        faulted, drained = ([row.pk], []) if effect == "NoExecute" else ([], [row.pk])
        signals.device_faulted.send(sender=Node, node=row.node, faulted=faulted, drained=drained, actor=actor)
    return row


def device_untaint(*, node_id, device_id: str, key: str, reason: str, actor: Actor, expected_version=None) -> Device:
    """Remove taint ``key`` (any effect, automatic or operator's) from one device. Raises 404/409."""
    with transaction.atomic():
        row = _locked_device(node_id, device_id, expected_version)
        if not _drop_taints(row, (key,)):
            raise Conflict(f"The device has no taint {key!r}.", TAINT_NOT_FOUND)
        row.hard_tainted = _is_hard(row.taints)
        if not _has_auto_taint(row) and row.health == DeviceHealth.UNHEALTHY:
            row.health = DeviceHealth.HEALTHY
        row.save(update_fields=["taints", "hard_tainted", "health"])
        record_event(row.node, event_types.DEVICE, actor, to_state="untainted",
                     reason=f"device {device_id}: {key} removed: {reason}", data={"device_id": device_id})  # fmt: skip
        sync_counts(row.node)
    return row


def device_release(*, node_id, device_id: str, reason: str, actor: Actor, expected_version=None) -> Device:
    """Release a device held for flapping: it returns when its automatic taints lift. Raises 404/409."""
    with transaction.atomic():
        row = _locked_device(node_id, device_id, expected_version)
        if not row.held:
            raise Conflict("The device is not held.", DEVICE_NOT_HELD)
        row.held, row.recent_faults = False, []
        row.save(update_fields=["held", "recent_faults"])
        record_event(row.node, event_types.DEVICE, actor, to_state="released",
                     reason=f"device {device_id} released: {reason}", data={"device_id": device_id})  # fmt: skip
        sync_counts(row.node)
    return row


def recover_devices(*, now: datetime | None = None, actor: Actor | None = None) -> int:
    """The periodic half of recovery: lift automatic taints of devices quiet for their pool's
    ``device_recovery_seconds``. Row by row under a lock (few rows: only faulted devices).
    Returns how many devices returned."""
    now = now or timezone.now()
    actor = actor or Actor.system("fleet.recover_devices")
    candidates = list(
        Device.objects.filter(retired_at__isnull=True, held=False, last_fault_at__isnull=False)
        .exclude(health=DeviceHealth.MISSING)
        .exclude(taints=[])
        .values_list("pk", "node_id", flat=False)[:1000]
    )
    returned = 0
    for pk, node_id in candidates:
        with transaction.atomic():
            _lock_node(node_id)  # the node before its device, as every device writer
            row = Device.objects.select_for_update(of=("self",)).select_related("node__pool").filter(pk=pk).first()
            if row is None:
                continue
            recovery = timedelta(seconds=row.node.pool.device_recovery_seconds)
            if not _recover(row, rebooted=False, now=now, recovery=recovery):
                continue
            row.hard_tainted = _is_hard(row.taints)
            row.save(update_fields=["taints", "hard_tainted", "health"])
            record_event(row.node, event_types.DEVICE, actor, to_state="recovered",
                         reason=f"device {row.device_id}: healthy for {recovery}; automatic taints lifted",
                         data={"device_id": row.device_id})  # fmt: skip
            sync_counts(row.node)
            returned += 1
    return returned


# Models /metrics names (a bounded label: marketplace models are self-reported); anything else "other".
KNOWN_MODELS = ("B200", "B100", "GH200", "H200", "H100", "H800", "A100", "A800", "A40", "A30", "A10", "L40S", "L40",
                "L4", "V100", "T4", "MI300X", "MI250X", "Gaudi2", "Gaudi3")  # fmt: skip


def normalise_model(model: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` → ``"H100"``; unknown → ``"other"`` (longest known name first)."""
    words = re.split(r"[^A-Za-z0-9]+", model or "")
    for known in sorted(KNOWN_MODELS, key=len, reverse=True):
        if any(w.upper() == known.upper() or w.upper().startswith(known.upper() + "-") for w in words):
            return known
    return "other"


def device_metric_rows():
    """``[(pool pk, type, model, health, allocatable, count)]`` with bounded labels (types
    outside the known device types and unknown models become ``other``). ``allocatable`` as
    :func:`counted` says (a slice of a GPU leased whole is not). One grouped query over every
    device: run by the fleet-state beat task (:mod:`fleet.fleet_state`), never by a scrape."""
    known_types = {"nvidia.com/gpu", "nvidia.com/mig", "amd.com/gpu", "intel.com/gpu", "habana.ai/gaudi"}
    rows: dict = {}
    grouped = (
        Device.objects.filter(retired_at__isnull=True)
        .exclude(node__lifecycle=Lifecycle.RETIRED)
        .annotate(allocatable=ExpressionWrapper(counted(), output_field=BooleanField()))
        .values_list("node__pool", "type", "model", "health", "allocatable")
        .annotate(n=Count("pk"))
        .order_by()
    )
    for pool, kind, model, health, allocatable, n in grouped:
        key = (pool, kind if kind in known_types else "other", normalise_model(model), health, bool(allocatable))
        rows[key] = rows.get(key, 0) + n
    return [[*key, n] for key, n in rows.items()]


def short_model(model: str) -> str:
    """A model as a person reads it in a list: the known name (``"H100"``), else the reported one."""
    known = normalise_model(model)
    return model if known == "other" and model else known


def device_summary(node_ids) -> dict:
    """``{node_id: {type: {"total", "allocatable", "models": {model: count}, "free_models":
    {short model: count}}}}`` for lists and pages (one query for every node). ``allocatable`` as
    :func:`counted` says; ``free_models`` counts the allocatable devices nobody has ``claimed``
    (held, or taken by a relative: a GPU and its MIG instances exclude each other), by
    :func:`short_model`."""
    out: dict = {}
    for node_id, kind, model, allocatable, claimed in (
        Device.objects.filter(node_id__in=list(node_ids), retired_at__isnull=True)
        .annotate(allocatable=ExpressionWrapper(counted(), output_field=BooleanField()))
        .values_list("node_id", "type", "model", "allocatable", "claimed")
    ):
        entry = out.setdefault(node_id, {}).setdefault(
            kind, {"total": 0, "allocatable": 0, "models": {}, "free_models": {}}
        )
        entry["total"] += 1
        entry["models"][model] = entry["models"].get(model, 0) + 1
        entry["allocatable"] += bool(allocatable)
        if allocatable and not claimed:
            short = short_model(model)
            entry["free_models"][short] = entry["free_models"].get(short, 0) + 1
    return out


def free_devices_text(summary: dict) -> str:
    """``"4×H100 2×A100"``: a node's free devices by model, compact (admin list, CLI); "" if none."""
    counts: dict = {}
    for entry in summary.values():
        for model, n in entry.get("free_models", {}).items():
            counts[model] = counts.get(model, 0) + n
    return " ".join(f"{n}×{model}" for model, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])))


__all__ = [
    "apply_report",
    "classify",
    "device_release",
    "device_taint",
    "device_untaint",
    "device_verify",
    "parse_devices",
    "recover_devices",
    "sync_counts",
    "verify_node_devices",
]
