"""Execution evidence: the intervals in which a node listed a lease as running (docs/marketplace.md).

Rules (one status report = today's heartbeat, which lists the leases the node runs):

- a status report listing a live lease with its fencing token, in the node's current incarnation,
  opens an evidence interval or extends the open one (``last_seen_at`` = the report's receipt time);
- a status report that omits the lease closes it (``not_reported``); one that lists it with another
  token closes it (``token_mismatch``); a new incarnation closes it (``stale_incarnation``) and, if
  the new incarnation lists the lease again, a new interval opens;
- a report that arrives more than the pool's grace (scaled with the fleet, as liveness scales it)
  after the interval was last extended closes it at its last extension (``silence``) and opens a
  new one: the silent time is a gap, never evidence;
- the lease's end closes it (``lease_ended``).

An interval's evidenced span is ``[started_at, last_seen_at]``: only time between two pieces of
evidence counts, so a lease reported once has none.

A lease holding devices has them recorded on its interval with their health while it ran
(``EvidenceInterval.devices``, KEP-4680 in spirit): each status report (whose device part is
applied before this) updates each device's last health, the worst health seen
(:data:`HEALTH_RANK`) and the last fault inside the interval. Marketplace reconciliation puts a
usage whose device turned unhealthy up for review.

Renewals (the cheap liveness signal, which does not list leases) carry an open interval of the
same incarnation forward until the next status report: a status report that lists the lease more
than the grace after the last one extends the interval over the gap when the node stayed alive
in between (:func:`carried`: the liveness sweep ran and saw it neither unreachable nor lost),
instead of closing it as ``silence``. Time after the last status report that listed a lease is not
evidence unless a later one lists it again (an omitting report, a restart or the lease's end closes
the interval at that last listing). :func:`record_renewal` is the eager form, for a renewal path
that can afford one UPDATE.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from django.db.models import F, Q

from fleet import event_types as fleet_events
from fleet import liveness
from fleet.choices import Liveness
from fleet.models import Device, LivenessSweepState, NodeEvent

from .choices import EvidenceClose
from .models import EvidenceInterval

# Worse is higher: the ``worst`` health an interval records for a device.
HEALTH_RANK = {"healthy": 0, "unknown": 1, "missing": 2, "unhealthy": 3}


def grace_seconds(pool) -> float:
    """The pool's heartbeat grace as liveness scales it at the current fleet size (seconds)."""
    return liveness.timings_for(pool, liveness.heartbeat_population()).unreachable_after


def record_status_report(
    *,
    node,
    incarnation: int,
    live: dict[uuid.UUID, dict],
    listed: set[uuid.UUID],
    mismatched: set[uuid.UUID],
    now: datetime,
) -> None:
    """Apply one status report's evidence. Call inside the reconciliation's transaction.

    Args:
        node: the fleet.Node (its ``usage`` is this report's, canonical units).
        incarnation: the report's incarnation.
        live: the node's live leases, ``{lease id: {"fencing_token", "devices" (optional), ...}}``.
        listed: live leases the report listed with their own token.
        mismatched: live leases the report listed with another token.
        now: the server's receipt time.

    Cost: nothing when the node holds no live lease; else one SELECT of its open intervals, one
    UPDATE extending them, and writes only when an interval opens or closes, a usage peak grows or
    a device's health changes; one more SELECT (of the node's devices the leases hold) only when a
    live lease holds devices.
    """
    if not live:
        return
    grace = timedelta(seconds=grace_seconds(node.pool))
    open_rows = {
        row["lease_id"]: row
        for row in EvidenceInterval.objects.filter(node_id=node.pk, closed_at__isnull=True).values(
            "pk", "lease_id", "node_incarnation", "fencing_token", "last_seen_at", "usage_max", "devices"
        )
    }
    health = _device_health(node, live)
    usage = {k: v for k, v in (node.usage or {}).items() if isinstance(v, int) and not isinstance(v, bool)}
    extend: list[int] = []
    close: dict[str, list[int]] = {}
    peaks: list[tuple[int, dict]] = []
    opened: list[EvidenceInterval] = []
    for lease_id, lease in live.items():
        row = open_rows.get(lease_id)
        if lease_id in listed:
            if row is not None:
                reason = None
                if row["node_incarnation"] != incarnation:
                    reason = EvidenceClose.STALE_INCARNATION
                elif row["fencing_token"] != lease["fencing_token"]:
                    reason = EvidenceClose.TOKEN_MISMATCH
                elif now - row["last_seen_at"] > grace and not carried(node, row["last_seen_at"], now, grace):
                    reason = EvidenceClose.SILENCE
                if reason is None:
                    extend.append(row["pk"])
                    peak = _peak(row["usage_max"], usage)
                    seen = _devices_seen(row["devices"], lease, health)
                    if peak != row["usage_max"] or seen != row["devices"]:
                        peaks.append((row["pk"], peak, seen))
                    continue
                close.setdefault(reason, []).append(row["pk"])
            opened.append(
                EvidenceInterval(
                    lease_id=lease_id,
                    node_id=node.pk,
                    node_incarnation=incarnation,
                    fencing_token=lease["fencing_token"],
                    started_at=now,
                    last_seen_at=now,
                    usage_max=usage,
                    devices=_devices_seen([], lease, health),
                )
            )
        elif row is not None:
            if row["node_incarnation"] != incarnation:
                reason = EvidenceClose.STALE_INCARNATION
            elif lease_id in mismatched:
                reason = EvidenceClose.TOKEN_MISMATCH
            else:
                reason = EvidenceClose.NOT_REPORTED
            close.setdefault(reason, []).append(row["pk"])
    if extend:
        EvidenceInterval.objects.filter(pk__in=extend, closed_at__isnull=True).update(
            last_seen_at=now, status_reports=F("status_reports") + 1
        )
    for pk, peak, seen in peaks:
        EvidenceInterval.objects.filter(pk=pk).update(usage_max=peak, devices=seen)
    for reason, pks in close.items():
        EvidenceInterval.objects.filter(pk__in=pks, closed_at__isnull=True).update(closed_at=now, close_reason=reason)
    if opened:
        # A racing report of the same node may have opened one already: the partial unique
        # constraint keeps one, and ignore_conflicts keeps this report from failing on it.
        EvidenceInterval.objects.bulk_create(opened, ignore_conflicts=True)


def carried(node, since: datetime, now: datetime, grace: timedelta) -> bool:
    """Did renewals carry the node from ``since`` (an interval's last status report) to ``now``?

    True when ``now`` is within the grace of ``since`` (nothing to carry), or when the liveness
    sweep has run within the last grace (so silence would have been noticed) and recorded no
    ``unreachable``/``lost`` for the node in between, nor did a message revive it from those
    (renewals do not list leases, so the node's own liveness is the only witness between two status
    reports). When the sweep has not run, nothing is carried: under-billing, never over-billing.
    Costs two small queries, only for an interval older than the grace.
    """
    if now - since <= grace:
        return True
    if not LivenessSweepState.objects.filter(pk=1, last_run_at__gte=now - grace).exists():
        return False
    degraded = (Liveness.UNREACHABLE, Liveness.LOST)
    return not NodeEvent.objects.filter(
        Q(to_state__in=degraded) | Q(from_state__in=degraded),
        node_id=node.pk,
        type=fleet_events.LIVENESS,
        created_at__gt=since,
        created_at__lte=now,
    ).exists()


def close_for_lease(lease_id, *, now: datetime, reason: str = EvidenceClose.LEASE_ENDED) -> int:
    """Close the lease's open interval (its end); the evidenced span stays ``[started, last_seen]``."""
    return EvidenceInterval.objects.filter(lease_id=lease_id, closed_at__isnull=True).update(
        closed_at=now, close_reason=reason
    )


def _device_health(node, live: dict) -> dict:
    """``{device id: {"type", "model", "health", "last_fault_at"}}`` of the devices the live leases
    hold (one SELECT; none when no lease holds a device)."""
    ids = {d.get("id") for lease in live.values() for d in (lease.get("devices") or []) if isinstance(d, dict)}
    ids.discard(None)
    if not ids:
        return {}
    rows = Device.objects.filter(node_id=node.pk, device_id__in=ids, retired_at__isnull=True).values_list(
        "device_id", "type", "model", "health", "last_fault_at"
    )
    return {
        device_id: {"type": kind, "model": model, "health": health, "last_fault_at": fault}
        for device_id, kind, model, health, fault in rows
    }


def _devices_seen(before: list, lease: dict, health: dict) -> list[dict]:
    """The interval's device list after one more report: each device of the lease with its
    health now, the worst seen since the interval opened, and its last fault since the lease's
    grant (``faulted_at``); a device the node no longer has is ``missing``."""
    previous = {d.get("id"): d for d in before or [] if isinstance(d, dict)}
    seen = []
    for device in lease.get("devices") or []:
        if not isinstance(device, dict) or not device.get("id"):
            continue
        device_id = device["id"]
        old = previous.get(device_id) or {}
        now = health.get(device_id) or {"type": device.get("type", ""), "model": "", "health": "missing"}
        worst = max(
            (h for h in (old.get("worst"), now["health"]) if h in HEALTH_RANK),
            key=HEALTH_RANK.__getitem__,
            default=now["health"],
        )
        entry = {
            "id": device_id,
            "type": now["type"] or old.get("type", ""),
            "model": now["model"] or old.get("model", ""),
            "health": now["health"],
            "worst": worst,
        }
        fault = now.get("last_fault_at")
        granted = lease.get("granted_at")
        if fault is not None and (granted is None or fault >= granted):
            entry["faulted_at"] = fault.isoformat()  # the device's last fault since the grant
        elif old.get("faulted_at"):
            entry["faulted_at"] = old["faulted_at"]
        seen.append(entry)
    return seen


def _peak(before: dict, usage: dict) -> dict:
    merged = dict(before or {})
    for name, value in usage.items():
        if value > merged.get(name, -1):
            merged[name] = value
    return merged
