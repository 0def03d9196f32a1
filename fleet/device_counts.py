"""What counts as allocatable (the node's count resource of each device type), and the grouped
reads of devices for metrics and lists. Split out of :mod:`fleet.devices`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from functools import partial
from itertools import groupby
from operator import itemgetter
from typing import Any

from django.db.models import BooleanField, Count, Exists, ExpressionWrapper, OuterRef, Q

from .choices import DeviceHealth, Lifecycle
from .models import Device, Node, NodeResource


def above_verified(node: Node) -> dict:
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


# The columns of a device that the device rules read (leases.device_requests.choose: constraints,
# co-location, usability), in the order of a fingerprint's text; with them, whether it is verified.
FINGERPRINT_COLUMNS = (
    "type",
    "index",
    "model",
    "memory_bytes",
    "mig_profile",
    "numa_node",
    "interconnect_group",
    "driver_version",
    "cuda_version",
    "pci_bus_id",
    "held",
    "health",
    "hard_tainted",
)


def fingerprint_of(devices: Iterable[Any]) -> str:
    """The fingerprint of a node's live ``devices`` (Device rows, or dicts with
    :data:`FINGERPRINT_COLUMNS` and ``verified_at``): the sha256 hex of their sorted attributes as
    the device rules read them, without their ids and without who holds them; ``''`` for none.
    Two nodes with the same fingerprint and no live holds give every device request the same
    reason (Node.device_fingerprint, leases.sql.devices.device_reasons_sql)."""
    keys = []
    for device in devices:
        value = device.get if isinstance(device, Mapping) else partial(getattr, device)
        keys.append(json.dumps([*(value(c) for c in FINGERPRINT_COLUMNS), value("verified_at") is not None]))
    if not keys:
        return ""
    return hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()


def _fingerprints(devices) -> dict:
    """``{node id: fingerprint}`` of the nodes of ``devices`` (a Device queryset), in one read."""
    rows = (
        devices.filter(retired_at__isnull=True)
        .order_by("node_id")
        .values("node_id", *FINGERPRINT_COLUMNS, "verified_at")
        .iterator(chunk_size=5000)
    )
    return {node_id: fingerprint_of(group) for node_id, group in groupby(rows, key=itemgetter("node_id"))}


def refresh_fingerprints(nodes=None, *, device_model=Device, node_model=Node) -> int:
    """Recompute Node.device_fingerprint of ``nodes`` (a Node queryset; every node when None) from
    their live devices, in one read of the devices and batched UPDATEs of the nodes whose
    fingerprint changed; returns how many changed. For devices written in bulk, past
    :func:`sync_counts`: the migration that added the column (with its historical models),
    bench/devices.py's fleet."""
    nodes = node_model.objects.all() if nodes is None else nodes
    computed = _fingerprints(device_model.objects.filter(node__in=nodes))
    changed = [
        node_model(pk=pk, device_fingerprint=computed.get(pk, ""))
        for pk, stored in nodes.values_list("pk", "device_fingerprint")
        if computed.get(pk, "") != stored
    ]
    node_model.objects.bulk_update(changed, ["device_fingerprint"], batch_size=1000)
    return len(changed)


def fingerprint_drift(nodes) -> int:
    """How many of ``nodes`` (a Node queryset) store a fingerprint other than their devices' (an
    audit: bench/devices.py, tests). A node that stores none (``''``) is decided on its own
    devices by the census, so only a wrong non-empty fingerprint is drift."""
    computed = _fingerprints(Device.objects.filter(node__in=nodes))
    return sum(
        1 for pk, stored in nodes.values_list("pk", "device_fingerprint") if stored and computed.get(pk, "") != stored
    )


def sync_fingerprint(node: Node, devices: list) -> None:
    """Store the fingerprint of ``devices`` (the node's live device rows) on ``node`` when it
    differs from the stored one (a conditional UPDATE: no row write when it is the same)."""
    fingerprint = fingerprint_of(devices)
    Node.objects.filter(pk=node.pk).exclude(device_fingerprint=fingerprint).update(device_fingerprint=fingerprint)
    node.device_fingerprint = fingerprint


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

    Also stores the node's device fingerprint (:func:`sync_fingerprint`), before admission too:
    every writer of device rows but the claim (which changes only who holds them) ends here.
    """
    rows = list(Device.objects.filter(node=node, retired_at__isnull=True).annotate(held_by_lease=held_for_itself()))
    sync_fingerprint(node, rows)
    if node.lifecycle in (Lifecycle.PENDING, Lifecycle.ADMITTING, Lifecycle.REJECTED):
        return {}
    counts: dict[str, int] = {}
    for row in rows:
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
