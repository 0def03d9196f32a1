"""The device-fault trigger: leases whose device a fault (or an operator) tainted move elsewhere.

Kubernetes' taint manager semantics, applied to device taints (KEP-5055): a ``NoExecute`` device
taint the lease does not tolerate ends it at once; one tolerated with ``toleration_seconds`` ends
it that many seconds after the taint was added; one tolerated without a limit never does. A
device taint ``NoSchedule`` that a fault needing a GPU reset put there (``reset_gpu``) *drains*
the device: its leases that do not tolerate that taint are moved as well, the tolerating ones
stay. Tolerations match device taints exactly as node taints, so an empty-key ``Exists``
toleration (``{"operator": "Exists"}``) tolerates every device taint too: such a lease rides out
a GPU falling off the bus (docs/leases.md).

A lease ended here is ``revoked`` and its work requeued through :func:`leases.requeue.requeue_lease`
(the client's request is recreated on its behalf), in the transaction that ends it. Other leases
of the node keep running, and the node stays schedulable for work that does not need the device.

Called at once by ``fleet.signals.device_faulted`` (the report that saw the fault) and by the
NoExecute sweep (:func:`leases.sweeps.evict_noexecute`) for tolerations that run out.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from fleet import clock
from fleet import event_types as fleet_events
from fleet.events import Actor, record_event
from nodepool.api.problems import Problem

from .choices import DEVICE_FAULT_REVOKE_PREFIX, LIVE_LEASE_STATES, LeaseState
from .lifecycle import end_lease
from .models import Lease, LeaseDevice
from .requeue import requeue_lease
from .spec import parse_spec

logger = logging.getLogger(__name__)
RESET_TAINT = "nodepool.dev/device-reset"


def _evicting(taint: dict) -> bool:
    return taint.get("effect") == "NoExecute" or (
        taint.get("effect") == "NoSchedule" and taint.get("key") == RESET_TAINT
    )


def device_deadline(lease: Lease, taints: list[dict], gaps=()):
    """When ``lease`` must end because of its devices' taints, or None if never (see module doc)."""
    try:
        tolerations = parse_spec(lease.spec).tolerations if lease.spec else ()
    except Problem:  # a spec stored before today's validation: judged without tolerations
        tolerations = ()
    deadline = None
    for taint in taints:
        if not _evicting(taint):
            continue
        matching = [t for t in tolerations if t.tolerates(taint)]
        if not matching:
            return lease.granted_at
        if taint.get("effect") != "NoExecute" or any(t.toleration_seconds is None for t in matching):
            continue
        added = parse_datetime(taint.get("added_at") or "") if isinstance(taint.get("added_at"), str) else None
        since = max(filter(None, [lease.granted_at, added]))
        until = clock.extend_past_gaps(
            since, since + timedelta(seconds=min(t.toleration_seconds for t in matching)), gaps
        )
        deadline = until if deadline is None else min(deadline, until)
    return deadline


def evict_device_faults(*, device_pks=None, now=None, actor: Actor | None = None) -> int:
    """Revoke and requeue live leases their devices' taints no longer let run. Returns how many.

    ``device_pks``: only leases holding these devices (the trigger); None: every lease holding a
    device with an evicting taint (the sweep). Each lease ends by compare-and-swap
    (:func:`leases.lifecycle.end_lease`), so two callers at once end it once.
    """
    now = now or timezone.now()
    actor = actor or Actor.system("leases.device_fault")
    claims = LeaseDevice.objects.filter(live=True, device__hard_tainted=True)
    if device_pks is not None:
        claims = claims.filter(device_id__in=list(device_pks))
    lease_ids = set(claims.values_list("lease_id", flat=True))
    if not lease_ids:
        return 0
    gaps = clock.detected_gaps()
    taints_of: dict = {}
    for lease_id, device_id, taints in LeaseDevice.objects.filter(lease_id__in=lease_ids, live=True).values_list(
        "lease_id", "device__device_id", "device__taints"
    ):
        taints_of.setdefault(lease_id, []).extend({**t, "device_id": device_id} for t in taints or [])
    evicted = 0
    for lease in Lease.objects.filter(pk__in=lease_ids, state__in=LIVE_LEASE_STATES).select_related("pool"):
        deadline = device_deadline(lease, taints_of.get(lease.pk, []), gaps)
        if deadline is None or deadline > now:
            continue
        bad = sorted({t["device_id"] for t in taints_of.get(lease.pk, []) if _evicting(t)})
        reason = f"{DEVICE_FAULT_REVOKE_PREFIX}{', '.join(bad)} tainted; this lease does not tolerate it (any longer)"
        try:
            with transaction.atomic():
                ended = end_lease(lease.pk, to_state=LeaseState.REVOKED, actor=actor, reason=reason, now=now)
                if ended is None:
                    continue
                requeue_lease(ended, pool=None, actor=actor, reason=reason, now=now)
        except Exception:  # one bad row must not stop the others
            logger.exception("could not evict lease %s for a device fault", lease.pk)
            continue
        evicted += 1
    return evicted


DEVICE_FAULT_EVIDENCE = "lease_device_fault"


def record_fault_evidence(*, node, device_pks, actor: Actor, now=None) -> int:
    """Execution evidence (KEP-4680 in spirit): one ``device`` event per live lease holding a
    faulted device, ``to_state="lease_device_fault"`` with the lease id and the devices' health
    as it was, whether or not the lease is evicted. The marketplace's reconciliation reads these
    events to put that lease's usage up for review instead of paying it blindly. Returns how many."""
    now = now or timezone.now()
    rows = LeaseDevice.objects.filter(live=True, device_id__in=list(device_pks)).values_list(
        "lease_id",
        "lease__workload_id",
        "device__device_id",
        "device__health",
        "device__taints",
        "device__health_detail",
    )
    by_lease: dict = {}
    for lease_id, workload_id, device_id, health, taints, detail in rows:
        entry = by_lease.setdefault(lease_id, {"workload_id": workload_id, "devices": []})
        recent = (detail or {}).get("recent_xids") or []
        entry["devices"].append({"id": device_id, "health": health, "taints": taints, "recent_xids": recent[-4:]})
    for lease_id, entry in by_lease.items():
        record_event(
            node, fleet_events.DEVICE, actor, to_state=DEVICE_FAULT_EVIDENCE,
            reason="a device this lease holds faulted: its usage is up for review",
            data={"lease_id": str(lease_id), "devices": entry["devices"], "at": now.isoformat()},
            lease_id=lease_id, workload_id=entry["workload_id"],
        )  # fmt: skip
    return len(by_lease)


def device_faulted(sender, node, faulted, drained, actor, **kwargs):
    """fleet.signals.device_faulted: record the evidence, then the device-fault trigger."""
    record_fault_evidence(node=node, device_pks=[*faulted, *drained], actor=actor)
    evict_device_faults(device_pks=[*faulted, *drained], actor=actor)


__all__ = ["device_faulted", "evict_device_faults"]
