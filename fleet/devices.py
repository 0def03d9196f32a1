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

from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from . import event_types, signals
from .choices import DeviceHealth, Lifecycle
from .device_actions import (
    device_release,
    device_taint,
    device_untaint,
    device_verify,
    lock_node,
    recover_devices,
    verify_node_devices,
)
from .device_counts import (
    KNOWN_MODELS,
    above_verified,
    counted,
    device_metric_rows,
    device_summary,
    fingerprint_drift,
    free_devices_text,
    held_for_itself,
    normalise_model,
    refresh_fingerprints,
    short_model,
    sync_counts,
)
from .device_health import (
    AUTO_TAINTS,
    FAULT_TAINT,
    FLAP_LIMIT,
    FLAP_WINDOW,
    HARD_EFFECTS,
    MISSING_TAINT,
    RESET_TAINT,
    classify,
    drop_taints,
    is_hard,
    judge_health,
    recover_row,
    set_taint,
)
from .device_wire import (
    ATTRIBUTE_COLUMNS,
    MAX_DEVICES,
    MAX_XID_EVENTS,
    TEXT_LIMITS,
    has_health_news,
    inventory_digest,
    parse_device,
    parse_devices,
)
from .events import Actor, event_row
from .models import Device, Node, NodeEvent


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


def _node_events(node: Node, actor: Actor, items: list[tuple[str, str, dict]]) -> list[NodeEvent]:
    return [
        event_row(node.pk, event_types.DEVICE, actor, to_state=to_state, reason=reason, data=data, pool=node.pool_id)
        for to_state, reason, data in items
    ]


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
        lock_node(node.pk)
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
                set_taint(row, MISSING_TAINT, "NoExecute", "missing", "no longer reported by the node", now, "auto")
                events.append(
                    ("missing", f"device {device_id} no longer reported: NoExecute", {"device_id": device_id})
                )
                result["faulted"].append(row.pk)
            row.hard_tainted = is_hard(row.taints)
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
                    drop_taints(row, (MISSING_TAINT,))
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
            if recover_row(row, rebooted=rebooted, now=now, recovery=recovery):
                events.append(("recovered", f"device {device_id}: automatic taints lifted", {"device_id": device_id}))
            health_events, effect = judge_health(row, device.get("health") or {}, now, boot)
            events += health_events
            if effect == "NoExecute":
                result["faulted"].append(row.pk)
            elif effect == "NoSchedule":
                result["drained"].append(row.pk)
            row.hard_tainted = is_hard(row.taints)
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
        result["above_verified"] = above_verified(node)
    if result.get("above_verified"):
        signals.devices_above_verified.send(sender=Node, node=node, over=result["above_verified"], actor=actor)
    if result["conflicts"]:
        signals.device_identity_conflict.send(sender=Node, node=node, conflicts=result["conflicts"], actor=actor)
    if result["faulted"] or result["drained"]:
        signals.device_faulted.send(
            sender=Node, node=node, faulted=result["faulted"], drained=result["drained"], actor=actor
        )
    return result


# The public names of the device modules, importable from here as before the split.
__all__ = [
    "AUTO_TAINTS",
    "FAULT_TAINT",
    "FLAP_LIMIT",
    "FLAP_WINDOW",
    "HARD_EFFECTS",
    "KNOWN_MODELS",
    "MAX_DEVICES",
    "MAX_XID_EVENTS",
    "MISSING_TAINT",
    "RESET_TAINT",
    "apply_report",
    "classify",
    "counted",
    "device_metric_rows",
    "device_release",
    "device_summary",
    "device_taint",
    "device_untaint",
    "device_verify",
    "fingerprint_drift",
    "free_devices_text",
    "has_health_news",
    "held_for_itself",
    "inventory_digest",
    "normalise_model",
    "parse_device",
    "parse_devices",
    "recover_devices",
    "refresh_fingerprints",
    "short_model",
    "sync_counts",
    "verify_node_devices",
]
