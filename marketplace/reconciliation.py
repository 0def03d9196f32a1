"""Usage records and their reconciliation (docs/marketplace.md, "Reconciliation").

A usage record is opened in the transaction that ends its lease (the ``leases.signals.lease_ended``
signal) and reconciled once its pool's settlement window has passed, by a Celery task queued then
and by a beat sweep that catches anything the task missed. Reconciliation compares three things:

1. the evidence against the lease's authoritative history: evidence outside ``[granted, ended]`` or
   from an incarnation that never held the lease is cut (``adjusted``);
2. the usage the node reported against the allocation: a node that reported more of a resource than
   it has (impossible) → ``disputed``; one that reported none of an allocated resource while listing
   the lease (absent) loses those intervals (``adjusted``), or, when that is all its evidence,
   ``disputed``;
3. the node's quarantines: a quarantine overlapping the lease that is not yet released → ``held``
   (re-run once an operator releases it);
4. the lease's devices: a device fault that tainted one of them while it ran (the ``device`` event
   ``lease_device_fault``, leases.device_faults) or a device its evidence saw unhealthy adds the
   ``device_fault`` finding; the state stays what 1–3 decide, and the finding flags the record's
   statement line for review, which holds the payout (marketplace.holds.REVIEW_FINDINGS);
5. re-verification: a failed scheduled re-verification of the node (fleet.reverification) not yet
   followed by a passing one when the lease ran adds the ``node_deverified`` finding, which flags
   the line for review the same way.

Otherwise ``reconciled``. Only evidenced time is billable. A record is claimed under a row lock
plus a compare-and-swap on its version, so two reconcilers at once give one outcome and one event.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from decimal import Decimal

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from fleet import event_types as fleet_events
from fleet import liveness
from fleet.choices import Liveness
from fleet.events import Actor, record_event
from fleet.models import Node, NodeEvent, NodeResource
from fleet.reverification import unverified_between
from leases.choices import EvidenceClose
from leases.device_faults import DEVICE_FAULT_EVIDENCE
from leases.models import EvidenceInterval, Lease
from maintenance.models import Quarantine
from maintenance.rules import impossible_usage
from nodepool import fsm
from nodepool.api.errors import VERSION_MISMATCH
from nodepool.api.problems import Conflict, NotFound, PreconditionFailed
from nodepool.celery import app as celery_app

from . import conf, event_types
from .choices import OPEN_STATES, PAYABLE_STATES, DisputeDecision, GapReason, UsageState
from .errors import USAGE_NOT_DISPUTED, USAGE_RECORD_NOT_FOUND
from .models import PoolSettlement, UsageRecord
from .statements import attach_line, refresh_line

logger = logging.getLogger(__name__)
MILLI = Decimal("0.001")

_GAP_AFTER_CLOSE = {
    EvidenceClose.NOT_REPORTED: GapReason.NOT_REPORTED,
    EvidenceClose.STALE_INCARNATION: GapReason.STALE_INCARNATION,
    EvidenceClose.TOKEN_MISMATCH: GapReason.TOKEN_MISMATCH,
    EvidenceClose.SILENCE: GapReason.SILENCE,
    EvidenceClose.LEASE_ENDED: GapReason.AFTER_LAST_REPORT,
}


def _seconds(delta: timedelta) -> Decimal:
    return Decimal(str(max(delta.total_seconds(), 0.0))).quantize(MILLI)


# --- the settlement window ---------------------------------------------------------------------
def settlement_window(pool) -> float:
    """Seconds after a lease's end before its usage is reconciled.

    The pool's own ``PoolSettlement.settlement_window`` when set, else the larger of
    ``NODEPOOL["SETTLEMENT_WINDOW_MIN"]`` (15 min) and twice the loss threshold as scaled at the
    current fleet size (fleet.liveness). Never at or below the scaled loss threshold: evidence of a
    silent node must have had the chance to turn into a lost lease before anything is settled.
    """
    lost_after = liveness.timings_for(pool, liveness.heartbeat_population()).lost_after
    configured = PoolSettlement.objects.filter(pool=pool).values_list("settlement_window", flat=True).first()
    if configured:
        return float(max(configured, lost_after + 1))
    return float(max(conf.get("SETTLEMENT_WINDOW_MIN"), 2 * lost_after))


# --- opening a record at the lease's end -------------------------------------------------------
def open_usage_record(*, lease: Lease, now: datetime) -> UsageRecord:
    """The usage record of an ended lease (idempotent: the existing one if any). Called inside the
    transaction that ended the lease; queues its reconciliation after the settlement window."""
    existing = UsageRecord.objects.filter(lease=lease).first()
    if existing is not None:
        return existing
    node = lease.node
    window = settlement_window(node.pool)
    ended_at = lease.ended_at or now
    record = UsageRecord.objects.create(
        lease=lease,
        node=node,
        owner_id=node.owner_id,
        pool_id=lease.pool_id,
        workload_id=lease.workload_id,
        fencing_token=lease.fencing_token,
        resources=dict(lease.resources or {}),
        started_at=lease.granted_at,
        ended_at=ended_at,
        lease_state=lease.state,
        outcome=lease.outcome or "",
        settle_after=ended_at + timedelta(seconds=window),
        allocated_seconds=_seconds(ended_at - lease.granted_at),
    )
    if record.owner_id is not None:
        attach_line(record)
    transaction.on_commit(lambda: _queue(record.pk, window))
    return record


def _queue(record_id: int, window: float) -> None:
    try:
        # By name: marketplace.tasks wraps this module (no import cycle).
        celery_app.signature("marketplace.reconcile_usage_record").apply_async(args=[record_id], countdown=window)
    except Exception:  # the beat sweep reconciles it; a broker hiccup must not fail the lease's end
        logger.exception("could not queue the reconciliation of usage record %s", record_id)


# --- reconciliation -----------------------------------------------------------------------------
def _clip(intervals, lease: Lease, record: UsageRecord) -> tuple[list[tuple[datetime, datetime, dict]], Decimal]:
    """Evidence cut to the lease's authoritative history. Returns (kept, seconds cut)."""
    kept, cut = [], Decimal(0)
    for interval in intervals:
        start, end = interval.started_at, interval.last_seen_at
        raw = _seconds(end - start)
        if interval.fencing_token != lease.fencing_token or interval.node_id != lease.node_id:
            cut += raw
            continue
        lo, hi = max(start, record.started_at), min(end, record.ended_at)
        if hi <= lo:
            cut += raw
            continue
        kept.append((lo, hi, interval.usage_max or {}))
        cut += raw - _seconds(hi - lo)
    return kept, cut


def _gaps(record: UsageRecord, intervals: list[EvidenceInterval], kept) -> list[dict]:
    """The unevidenced parts of ``[started_at, ended_at]``, each with the reason it is not evidence."""
    gaps, cursor, reason = [], record.started_at, GapReason.NOT_STARTED
    reasons = {
        (i.started_at, i.last_seen_at): _GAP_AFTER_CLOSE.get(i.close_reason, GapReason.NOT_REPORTED) for i in intervals
    }
    bounds = sorted(kept, key=lambda k: k[0])
    for lo, hi, _ in bounds:
        if lo > cursor:
            gaps.append(_gap(record, cursor, lo, reason))
        cursor = max(cursor, hi)
        reason = next((r for (s, e), r in reasons.items() if s <= lo and hi <= e), GapReason.NOT_REPORTED)
    if record.ended_at > cursor:
        gaps.append(_gap(record, cursor, record.ended_at, reason if bounds else GapReason.NOT_STARTED))
    return gaps


def _gap(record: UsageRecord, start: datetime, end: datetime, reason: str) -> dict:
    # Silence during which the control plane declared the node unreachable is told as such.
    if (
        reason == GapReason.SILENCE
        and NodeEvent.objects.filter(
            node_id=record.node_id,
            type=fleet_events.LIVENESS,
            to_state__in=[Liveness.UNREACHABLE, Liveness.LOST],
            created_at__gte=start,
            created_at__lte=end,
        ).exists()
    ):
        reason = GapReason.UNREACHABLE
    return {
        "start": start.isoformat(),
        "end": end.isoformat(),
        "seconds": float(_seconds(end - start)),
        "reason": reason,
    }


def _finding(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def _impossible(record: UsageRecord, peaks: list[dict]) -> list[str]:
    """Resources the node reported using beyond what it has, in any of ``peaks``: the automatic
    quarantine's rule (maintenance.rules.impossible_usage: the same tolerance, and a resource
    missing from the inventory has capacity 0 unless the pool allows it undeclared)."""
    node = Node.objects.select_related("pool").filter(pk=record.node_id).first()
    if node is None:
        return []
    capacity = dict(NodeResource.objects.filter(node_id=node.pk).values_list("name", "capacity"))
    allowed = list(node.pool.allowed_undeclared_resources or [])
    over = set()
    for peak in peaks:
        found = impossible_usage(node, peak or {}, capacities=capacity, allowed_undeclared=allowed)
        over.update((found or {}).get("over_capacity", {}))
    return sorted(over)


def _device_faults(record: UsageRecord, intervals: list[EvidenceInterval]) -> list[str]:
    """Ids of the lease's devices that faulted while it ran: named by a ``lease_device_fault``
    event of the lease (the fault tainted the device) or seen unhealthy in its evidence."""
    ids: set[str] = set()
    for data in NodeEvent.objects.filter(
        type=fleet_events.DEVICE, to_state=DEVICE_FAULT_EVIDENCE, lease_id=record.lease_id
    ).values_list("data", flat=True):
        ids.update(str(d.get("id")) for d in (data or {}).get("devices") or [] if isinstance(d, dict) and d.get("id"))
    for interval in intervals:
        for device in interval.devices or []:
            if isinstance(device, dict) and device.get("id") and device.get("worst") == "unhealthy":
                ids.add(str(device["id"]))
    return sorted(ids)


def evaluate(record: UsageRecord) -> dict:
    """What reconciliation concludes for ``record`` now (changes nothing)."""
    lease = record.lease
    intervals = list(EvidenceInterval.objects.filter(lease_id=lease.pk).order_by("started_at", "id"))
    evidenced = sum((_seconds(i.last_seen_at - i.started_at) for i in intervals), Decimal(0))
    kept, cut = _clip(intervals, lease, record)
    findings: list[dict] = []
    adjusted_why: list[str] = []
    if cut > 0:
        adjusted_why.append(f"{cut} s of evidence outside the lease's history (times, node, fencing token) cut")
        findings.append({"code": "evidence_outside_history", "message": adjusted_why[-1]})

    allocated = {name: int(amount) for name, amount in (record.resources or {}).items() if int(amount) > 0}
    impossible = _impossible(record, [peak for _, _, peak in kept])
    if impossible:
        findings.append(_finding("impossible_usage", f"the node reported more {', '.join(impossible)} than it has"))
    absent = [k for k in kept if any(name in k[2] and k[2][name] == 0 for name in allocated)]
    if absent and len(absent) == len(kept):
        findings.append(
            _finding("absent_usage", "the node reported no use of the allocated resources in all its evidence")
        )
    elif absent:
        seconds = sum((_seconds(hi - lo) for lo, hi, _ in absent), Decimal(0))
        kept = [k for k in kept if k not in absent]
        adjusted_why.append(f"{seconds} s in which the node reported no use of the allocated resources removed")
        findings.append({"code": "absent_usage_partial", "message": adjusted_why[-1]})

    faulty = _device_faults(record, intervals)
    if faulty:
        findings.append(
            _finding(
                "device_fault",
                f"device(s) {', '.join(faulty)} faulted while the lease ran: its usage is up for review",
            )
        )

    deverified = unverified_between(record.node_id, record.started_at, record.ended_at)
    if deverified is not None:
        findings.append(
            _finding(
                "node_deverified",
                f"the node was deverified at {deverified.finished_at.isoformat()} ({deverified.code}): "
                f"usage after the failed check is up for review",
            )
        )

    quarantine = (
        Quarantine.objects.filter(node_id=record.node_id, created_at__lte=record.ended_at)
        .filter(Q(released_at__isnull=True) | Q(released_at__gte=record.started_at))
        .order_by("-created_at")
    )
    open_quarantine = quarantine.filter(released_at__isnull=True).first()
    if open_quarantine is not None:
        message = f"the node is quarantined ({open_quarantine.rule}): {open_quarantine.reason}"
        findings.append(_finding("node_quarantined", message))
    billable = sum((_seconds(hi - lo) for lo, hi, _ in kept), Decimal(0))
    if open_quarantine is not None:
        state = UsageState.HELD
    elif impossible or any(f["code"] == "absent_usage" for f in findings):
        state = UsageState.DISPUTED
    elif adjusted_why:
        state = UsageState.ADJUSTED
    else:
        state = UsageState.RECONCILED
    return {
        "state": state,
        "evidenced_seconds": evidenced,
        "billable_seconds": billable,
        "billable_intervals": [[lo.isoformat(), hi.isoformat()] for lo, hi, _ in kept],
        "gaps": _gaps(record, intervals, kept),
        "findings": findings,
        "adjustment": (
            {"quantity_seconds": str(billable), "evidenced_seconds": str(evidenced), "why": "; ".join(adjusted_why)}
            if state == UsageState.ADJUSTED
            else {}
        ),
        "held_by": open_quarantine,
    }


# The declared transition that moves an open record to each outcome of evaluate() (UsageRecord).
SETTLE = {
    UsageState.RECONCILED: "reconcile",
    UsageState.ADJUSTED: "adjust",
    UsageState.DISPUTED: "dispute",
    UsageState.HELD: "hold",
}
# The declared transition of each operator decision on a disputed or held record.
DECIDE = {
    DisputeDecision.ACCEPT: "accept_dispute",
    DisputeDecision.ADJUST: "adjust_dispute",
    DisputeDecision.REJECT: "reject_dispute",
}


def reconcile_usage(record_id, *, actor: Actor, now: datetime | None = None, force: bool = False) -> UsageRecord | None:
    """Reconcile one usage record once its settlement window has passed (``force`` skips the wait).

    Idempotent: a record already reconciled, adjusted or disputed is returned unchanged; a held one
    is re-run (it stays held while its quarantine is open). Safe to run twice at once: the record
    row is locked (PostgreSQL) and the write is a compare-and-swap on ``version``, so one run
    writes the outcome and its event and the other changes nothing. Returns the record, or None
    when there is no such record.
    """
    now = now or timezone.now()
    with transaction.atomic():
        # The record row alone (of=self): its lease has ended and what evaluate() reads of it (its
        # key, node and fencing token) never changes. Joined, the lease row was locked FOR UPDATE
        # too: a status report still listing the ended lease (it locks the lease) and every insert
        # naming the lease waited for this reconciliation.
        record = (
            UsageRecord.objects.select_for_update(of=("self",)).select_related("lease").filter(pk=record_id).first()
        )
        if record is None:
            return None
        if record.state not in OPEN_STATES or (record.settle_after > now and not force):
            return record
        before = record.state
        result = evaluate(record)
        if record.state == UsageState.HELD and result["state"] == UsageState.HELD:
            if result["held_by"] != record.held_by:  # released, but another quarantine holds it now
                UsageRecord.objects.filter(pk=record.pk).update(held_by=result["held_by"])
                record.held_by = result["held_by"]
            return record  # still held: nothing new to say
        # The claim (STYLE.md habit 6), its WHERE state IN (…) and new state read from the declared
        # transition (UsageRecord.reconcile, adjust, dispute or hold).
        changed = fsm.move(
            UsageRecord.objects.filter(pk=record.pk, version=record.version, state=record.state),
            SETTLE[result["state"]],
            evidenced_seconds=result["evidenced_seconds"],
            billable_seconds=result["billable_seconds"],
            billable_intervals=result["billable_intervals"],
            gaps=result["gaps"],
            findings=result["findings"],
            adjustment=result["adjustment"],
            held_by=result["held_by"],
            reconciled_at=now,
            reconciled_by=actor.name[:150],
            version=F("version") + 1,
        )
        if not changed:
            return UsageRecord.objects.get(pk=record.pk)
        record.refresh_from_db()
        _record_outcome(record, actor, from_state=before)
        refresh_line(record)
    return record


def _record_outcome(record: UsageRecord, actor: Actor, *, from_state: str, reason: str = "") -> None:
    record_event(
        record.node_id,
        event_types.USAGE,
        actor,
        from_state=from_state,
        to_state=record.state,
        reason=reason or "; ".join(f["message"] for f in record.findings) or "evidence matches the lease",
        pool=record.pool_id,
        lease_id=record.lease_id,
        workload_id=record.workload_id,
        subject_type="usage_record",
        subject_id=record.pk,
        data={
            "billable_seconds": str(record.billable_seconds),
            "evidenced_seconds": str(record.evidenced_seconds),
            "allocated_seconds": str(record.allocated_seconds),
        },
    )


def reconcile_due(*, actor: Actor, now: datetime | None = None, limit: int = 500) -> dict:
    """The beat sweep: reconcile records past their window, and re-run held ones whose quarantine
    has been released. Safe to run twice at once (each record is claimed as above)."""
    now = now or timezone.now()
    due = list(
        UsageRecord.objects.filter(state=UsageState.PENDING, settle_after__lte=now)
        .order_by("settle_after")
        .values_list("pk", flat=True)[:limit]
    )
    released = list(
        UsageRecord.objects.filter(state=UsageState.HELD, held_by__released_at__isnull=False).values_list(
            "pk", flat=True
        )[:limit]
    )
    outcomes: dict[str, int] = {}
    for pk in [*due, *released]:
        try:
            record = reconcile_usage(pk, actor=actor, now=now)
        except Exception:  # one bad record must not stop the sweep; it is retried next run
            logger.exception("reconciliation of usage record %s failed", pk)
            outcomes["error"] = outcomes.get("error", 0) + 1
            continue
        if record is not None:
            outcomes[record.state] = outcomes.get(record.state, 0) + 1
    return outcomes


def resolve_usage(
    *,
    record_id,
    decision: str,
    expected_version: int,
    reason: str,
    actor: Actor,
    billable_seconds: Decimal | None = None,
    now: datetime | None = None,
) -> UsageRecord:
    """An operator settles a disputed (or held) record: ``accept`` the evidenced time, ``adjust``
    to ``billable_seconds`` (0 ≤ it ≤ the evidenced time), or ``reject`` (pay nothing).

    Raises: NotFound 404; PreconditionFailed 412 (stale version); Conflict 409
    ``usage_not_disputed`` when the record is pending, reconciled or adjusted.
    """
    now = now or timezone.now()
    with transaction.atomic():
        record = UsageRecord.objects.select_for_update().filter(pk=record_id).first()
        if record is None:
            raise NotFound("No such usage record.", USAGE_RECORD_NOT_FOUND)
        if record.version != expected_version:
            raise PreconditionFailed(
                f"The usage record is at version {record.version}.", VERSION_MISMATCH, current_version=record.version
            )
        verb = DECIDE.get(decision, "adjust_dispute")
        if record.state not in fsm.sources(UsageRecord, verb):
            raise Conflict(
                f"The usage record is {record.state}; only disputed or held records are resolved.", USAGE_NOT_DISPUTED
            )
        before = record.state
        evidenced = sum(
            (Decimal(str((e - s).total_seconds())) for s, e in _parsed(record.billable_intervals)), Decimal(0)
        ).quantize(MILLI)
        if decision == DisputeDecision.ACCEPT:
            state, billable, intervals = UsageState.RECONCILED, evidenced, record.billable_intervals
        elif decision == DisputeDecision.REJECT:
            state, billable, intervals = UsageState.ADJUSTED, Decimal(0), []
        else:
            billable = Decimal(billable_seconds or 0).quantize(MILLI)
            state, intervals = UsageState.ADJUSTED, _truncate(record.billable_intervals, billable)
        changes = {
            "billable_seconds": billable,
            "billable_intervals": intervals,
            "reconciled_at": now,
            "reconciled_by": actor.name[:150],
            "version": F("version") + 1,
        }
        if state == UsageState.ADJUSTED:
            changes["adjustment"] = {
                "quantity_seconds": str(billable),
                "evidenced_seconds": str(evidenced),
                "why": f"operator decision ({decision}): {reason}",
            }
        # Moved by the declared decision (UsageRecord.accept_dispute, adjust_dispute, reject_dispute).
        fsm.move(UsageRecord.objects.filter(pk=record.pk, version=record.version), verb, **changes)
        record.refresh_from_db()
        _record_outcome(record, actor, from_state=before, reason=f"operator decision ({decision}): {reason}")
        refresh_line(record)
    return record


def _parsed(intervals):
    return [(parse_datetime(a), parse_datetime(b)) for a, b in intervals or []]


def _truncate(intervals, seconds: Decimal) -> list:
    """The first ``seconds`` of billable time (an operator's adjusted quantity, priced as it fell)."""
    kept, left = [], seconds
    for start, end in _parsed(intervals):
        if left <= 0:
            break
        span = Decimal(str((end - start).total_seconds()))
        if span > left:
            end = start + timedelta(seconds=float(left))
            span = left
        kept.append([start.isoformat(), end.isoformat()])
        left -= span
    return kept


def payable(record: UsageRecord) -> bool:
    return record.state in PAYABLE_STATES
