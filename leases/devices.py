"""Devices of leases: reading what is free, claiming in the grant, releasing at the end.

The grant (leases.grant._reserve) calls :func:`claim` in the transaction that reserves the
count capacity: it reads the node's live devices and the ones live leases hold, picks with
:func:`leases.device_requests.choose`, and inserts :class:`~leases.models.LeaseDevice` rows. The
partial unique index ``leasedevice_one_live_holder`` refuses a device a racing grant took first
(IntegrityError: the caller rolls back and tries the next node), on PostgreSQL and SQLite alike;
the read before it is only the choice, never the guard. The claim also marks the held devices
``claimed`` (fleet.Device; with the whole GPU of a held MIG instance) and :func:`release` clears
the mark when nothing live holds them any more, both in the transaction of the hold they mirror:
placement and the 409 read that column in SQL (:func:`leases.sql.devices.device_rule_sql`), and
tests/leases/test_device_sql.py checks it against a recomputation after random grants and ends.
The claim's statements are leases.sql.devices'; this module decides which to run.
"""

from __future__ import annotations

from collections import defaultdict

from django.db import IntegrityError
from django.db.models import BooleanField, Case, Exists, OuterRef, Q, Value, When

from fleet.devices import sync_counts
from fleet.models import Device, Node

from .device_requests import DeviceRequest, choose
from .models import LeaseDevice
from .sql import devices as device_sql


class NoDevices(Exception):
    """The node no longer has the devices the request needs (or a racing grant took them)."""


HOLDER_INDEX = "leasedevice_one_live_holder"  # leases.models.LeaseDevice: one live holder a device


def _constraint(exc: IntegrityError) -> str | None:
    """The name of the constraint that refused a row (PostgreSQL says it; SQLite does not)."""
    return getattr(getattr(exc.__cause__, "diag", None), "constraint_name", None)


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
    for values in rows.values_list(*device_sql.DEVICE_FIELDS, "taken"):
        device = dict(zip(device_sql.DEVICE_FIELDS, values[:-1], strict=True))
        devices[device["node_id"]].append(device)
        if values[-1]:
            taken[device["node_id"]].add(device["id"])
    return devices, taken


def device_types(requests: tuple[DeviceRequest, ...]) -> set[str]:
    return {r.type for r in requests}


def claim(
    *,
    lease,
    node_id,
    requests: tuple[DeviceRequest, ...],
    tolerates=None,
    patient: bool = True,
    insert_lease: bool = False,
) -> list[dict]:
    """Pick and hold devices for ``lease`` on ``node_id``; returns the lease's device list
    ``[{"id", "type", "index"}]`` (empty for a request without device types or a node that
    reports no devices of them). Call inside the grant's transaction.

    ``insert_lease``: where the claim is one statement (leases.sql.devices.claim_plain), it also
    INSERTs ``lease`` and marks it saved; the caller inserts it when ``lease._state.adding`` is
    still True. IntegrityError from the lease's own constraints (a second live lease of the
    workload) then comes out of here as it is.

    ``patient=False`` (the grant's first round over its candidates): a device another transaction
    holds locked right now is taken, not waited for — in practice another grant claiming it —
    and the grant goes on to its next candidate node; the second round waits (a status report or
    an operator's action holds a node's devices for milliseconds: never a 409 for that).

    Raises:
        NoDevices: not enough matching free devices, a racing grant held one first (the partial
            unique index), or (``patient=False``) they are being claimed by racing grants; the
            caller rolls the grant back.
    """
    if not requests:
        return []
    if device_sql.claims_in_one_statement(requests, tolerates):
        try:
            picked, available = device_sql.claim_plain(lease, node_id, requests[0], insert_lease=insert_lease)
        except IntegrityError as exc:
            if _constraint(exc) != HOLDER_INDEX:
                raise  # the lease's own: a second live lease of the workload
            raise NoDevices("taken by a racing grant") from exc
        if picked:
            return picked
        if available >= requests[0].count and not patient:
            raise NoDevices("being claimed by racing grants")
    # Every type: a whole GPU's MIG instances are held with it (implied rows).
    mine = device_sql.claim_view(node_id)
    if not any(d["type"] in device_types(requests) for d in mine):
        if any(not r.implicit for r in requests):
            raise NoDevices("no devices")
        return []
    choice = choose(requests, mine, {d["id"] for d in mine if d["claimed"]}, tolerates=tolerates)
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
        device_sql.insert_claims(rows)
    except IntegrityError as exc:
        raise NoDevices("taken by a racing grant") from exc
    # Device.claimed mirrors the holds, in this transaction: the held devices and the whole GPU of
    # a held MIG instance. The unique index above stays the guard; this only marks what it let in.
    parents = {d["parent_device_id"] for d in choice.picked if d["parent_device_id"]}
    marked = {row.device_id for row in rows} | {d["id"] for d in mine if d["device_id"] in parents}
    device_sql.mark_claimed(sorted(marked))
    if parents or len(rows) > len(choice.picked):
        # A GPU and its MIG instances exclude each other: the relatives this claim took (a held
        # slice's GPU, a whole GPU's slices) leave their type's count now (fleet.devices.counted),
        # before the capacity rows are taken. Nodes without MIG never come here.
        sync_counts(Node.objects.select_related("pool").get(pk=node_id))
    return [{"id": d["device_id"], "type": d["type"], "index": d["index"]} for d in choice.picked]


def release(lease_id) -> int:
    """Free the devices of an ended lease (same transaction as its end, before its count rows are
    given back). Returns rows freed.

    The lease's devices are locked first (``FOR NO KEY UPDATE``; the order every device writer
    takes: device rows, then count rows), so a fault judged at the same moment is counted either
    before or after this release. When one of them is no longer allocatable (it failed while
    held), the node's count resource is recounted (fleet.devices.sync_counts): the failed device
    was counted while its lease held it and leaves the count now.
    """
    claims = LeaseDevice.objects.filter(lease_id=lease_id, live=True)
    held = list(claims.values_list("device_id", "implied", "device__node_id", "device__parent_device_id"))
    if not held:
        return 0
    node_id = held[0][2]
    parents = {parent for _, _, _, parent in held if parent}
    mine = Q(pk__in=[pk for pk, *_ in held])
    touched = mine | Q(node_id=node_id, device_id__in=parents, retired_at__isnull=True) if parents else mine
    devices = list(
        Device.objects.select_for_update(no_key=True)
        .filter(touched)
        .order_by("pk")
        .only("pk", "node_id", "device_id", "verified_at", "retired_at", "held", "hard_tainted", "health")
    )
    freed = claims.update(live=False)
    # Device.claimed again, read after the locks above (a new statement sees what committed while
    # it waited): still held by another lease, or a whole GPU another of whose slices is held.
    live = LeaseDevice.objects.filter(live=True)
    Device.objects.filter(pk__in=[d.pk for d in devices]).update(
        claimed=Exists(live.filter(device_id=OuterRef("pk")))
        | Exists(live.filter(device__node_id=OuterRef("node_id"), device__parent_device_id=OuterRef("device_id")))
    )
    counted = {pk for pk, implied, *_ in held if not implied}
    failed = [d for d in devices if d.pk in counted and not d.allocatable]
    # Relatives of a GPU or MIG instance it held (fleet.devices.counted) return to their counts.
    if failed or parents or len(counted) < len(held):
        sync_counts(Node.objects.select_related("pool").get(pk=node_id))
    return freed
