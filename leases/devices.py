"""Devices of leases: reading what is free, claiming in the grant, releasing at the end.

The grant (leases.services._reserve) calls :func:`claim` in the transaction that reserves the
count capacity: it reads the node's live devices and the ones live leases hold, picks with
:func:`leases.device_requests.choose`, and inserts :class:`~leases.models.LeaseDevice` rows. The
partial unique index ``leasedevice_one_live_holder`` refuses a device a racing grant took first
(IntegrityError: the caller rolls back and tries the next node), on PostgreSQL and SQLite alike;
the read before it is only the choice, never the guard.
"""

from __future__ import annotations

from collections import defaultdict

from django.db import IntegrityError
from django.db.models import BooleanField, Case, Q, Value, When

from fleet.models import Device

from .device_requests import DeviceRequest, choose
from .models import LeaseDevice

DEVICE_FIELDS = (
    "id",
    "node_id",
    "device_id",
    "type",
    "index",
    "model",
    "memory_bytes",
    "mig_profile",
    "parent_device_id",
    "numa_node",
    "interconnect_group",
    "driver_version",
    "cuda_version",
    "pci_bus_id",
    "verified_at",
    "held",
    "health",
    "hard_tainted",
    "taints",
)


class NoDevices(Exception):
    """The node no longer has the devices the request needs (or a racing grant took them)."""


def node_devices(node_ids, types, *, usable_only: bool = False) -> tuple[dict, dict]:
    """``({node_id: [device dicts]}, {node_id: {taken device pks}})`` for live devices of ``types``
    (None: every type). ``usable_only``: only verified, healthy, untainted, unheld devices (what a
    request without tolerations can use; the explanation needs the others to say why).

    One indexed query whatever the number of nodes: ``taken`` (of the devices read) holds devices
    live leases hold and the parents of held MIG instances (a whole GPU whose slice is in use is
    not free either), each decided by an uncorrelated subquery over the live holds of these nodes.
    """
    node_ids = list(node_ids)
    devices: dict = defaultdict(list)
    taken: dict = defaultdict(set)
    holds = LeaseDevice.objects.filter(live=True, device__node_id__in=node_ids)
    held = Q(pk__in=holds.values("device_id")) | Q(
        device_id__in=holds.exclude(device__parent_device_id="").values("device__parent_device_id")
    )
    rows = Device.objects.filter(node_id__in=node_ids, retired_at__isnull=True)
    if types is not None:
        rows = rows.filter(type__in=list(types))
    if usable_only:
        rows = rows.filter(verified_at__isnull=False, held=False, hard_tainted=False, health__in=("healthy", "unknown"))
    rows = rows.annotate(taken=Case(When(held, then=Value(True)), default=Value(False), output_field=BooleanField()))
    for values in rows.values_list(*DEVICE_FIELDS, "taken"):
        device = dict(zip(DEVICE_FIELDS, values[:-1], strict=True))
        devices[device["node_id"]].append(device)
        if values[-1]:
            taken[device["node_id"]].add(device["id"])
    return devices, taken


def device_types(requests: tuple[DeviceRequest, ...]) -> set[str]:
    return {r.type for r in requests}


def claim(*, lease, node_id, requests: tuple[DeviceRequest, ...], tolerates=None) -> list[dict]:
    """Pick and hold devices for ``lease`` on ``node_id``; returns the lease's device list
    ``[{"id", "type", "index"}]`` (empty for a request without device types or a node that
    reports no devices of them). Call inside the grant's transaction.

    Raises:
        NoDevices: not enough matching free devices, or a racing grant held one first (the
            partial unique index); the caller rolls the grant back.
    """
    if not requests:
        return []
    # Every type: a whole GPU's MIG instances are held with it (implied rows).
    devices, taken = node_devices([node_id], None)
    mine = devices.get(node_id, [])
    if not any(d["type"] in device_types(requests) for d in mine):
        if any(not r.implicit for r in requests):
            raise NoDevices("no devices")
        return []
    choice = choose(requests, mine, taken.get(node_id, set()), tolerates=tolerates)
    if choice.reason:
        raise NoDevices(choice.reason)
    if not choice.picked:
        return []
    rows = [LeaseDevice(lease=lease, device_id=d["id"], position=i) for i, d in enumerate(choice.picked)]
    # A whole GPU holds its MIG instances too (and they it): one index, both directions.
    picked_ids = {d["device_id"] for d in choice.picked}
    for device in mine:
        if device["parent_device_id"] in picked_ids and device["id"] not in {d["id"] for d in choice.picked}:
            rows.append(LeaseDevice(lease=lease, device_id=device["id"], implied=True, position=len(rows)))
    try:
        LeaseDevice.objects.bulk_create(rows)
    except IntegrityError as exc:
        raise NoDevices("taken by a racing grant") from exc
    return [{"id": d["device_id"], "type": d["type"], "index": d["index"]} for d in choice.picked]


def release(lease_id) -> int:
    """Free the devices of an ended lease (same transaction as its end). Returns rows freed."""
    return LeaseDevice.objects.filter(lease_id=lease_id, live=True).update(live=False)
