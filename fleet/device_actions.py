"""The operator's device actions (verify, taint, untaint, release), admission's verification and
the periodic recovery sweep. Every writer locks the node row before its device rows
(:func:`lock_node`). Split out of :mod:`fleet.devices`.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from nodepool.api.problems import Conflict, NotFound, Problem
from nodepool.api.versioning import check_version

from . import event_types, signals
from .capability import TAINT_EFFECTS, label_key_ok
from .choices import DeviceHealth
from .device_counts import sync_counts
from .device_health import HARD_EFFECTS, drop_taints, has_auto_taint, is_hard, recover_row, set_taint
from .errors import DEVICE_NOT_FOUND, DEVICE_NOT_HELD, INVALID_TAINT, NODE_NOT_FOUND, TAINT_NOT_FOUND
from .events import Actor, record_event
from .models import Device, Node


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


def lock_node(node_id) -> bool:
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
        set_taint(row, key, effect, value, reason, now, "operator")
        row.hard_tainted = is_hard(row.taints)
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
        if not drop_taints(row, (key,)):
            raise Conflict(f"The device has no taint {key!r}.", TAINT_NOT_FOUND)
        row.hard_tainted = is_hard(row.taints)
        if not has_auto_taint(row) and row.health == DeviceHealth.UNHEALTHY:
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
            lock_node(node_id)  # the node before its device, as every device writer
            row = Device.objects.select_for_update(of=("self",)).select_related("node__pool").filter(pk=pk).first()
            if row is None:
                continue
            recovery = timedelta(seconds=row.node.pool.device_recovery_seconds)
            if not recover_row(row, rebooted=False, now=now, recovery=recovery):
                continue
            row.hard_tainted = is_hard(row.taints)
            row.save(update_fields=["taints", "hard_tainted", "health"])
            record_event(row.node, event_types.DEVICE, actor, to_state="recovered",
                         reason=f"device {row.device_id}: healthy for {recovery}; automatic taints lifted",
                         data={"device_id": row.device_id})  # fmt: skip
            sync_counts(row.node)
            returned += 1
    return returned
