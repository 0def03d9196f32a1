"""Scheduled re-verification and deverification (issue 32; docs/fleet.md, "Re-verification").

Admission verifies a node once. A pool with ``reverification_period`` set verifies its nodes again,
over and over, at times the node cannot predict, and takes the trust back from a node that no
longer measures up — as Vast.ai deverifies hosts whose hardware changed, and io.net re-checks
supplier GPUs with a proof of work.

**The schedule.** Each ``ready`` node of such a pool has one open :class:`~fleet.models.Reverification`
(``scheduled``), due at a moment drawn server-side with :data:`secrets.SystemRandom`, uniformly in
the last ``reverification_window`` seconds of a ``reverification_period`` counted from its previous
run (or from when it was first scheduled): ``due = anchor + period − window + U(0, window)``. The
due time is never shown to the node — not in a heartbeat, not in any API a node credential may read —
and the benchmark it answers is created only when the run starts, so a node cannot prepare.

**A run** (:func:`reverification_start`, claimed by the sweep with a compare-and-swap on
``state='scheduled'`` under the node's row lock, so two sweeps start it once):

1. *inventory*: every verified live device still reports what was verified (model, memory, MIG
   profile, serial); a difference is ``inventory_mismatch``;
2. *attestation*, where the pool requires it: the node's evidence verifies again with the pool's
   trusted key as it is now (fleet.admission.check_attestation), else ``attestation_failed``;
3. *benchmark*, through the admission benchmark's nonce flow (``Benchmark``; the node learns of it
   in its next status-report answer, ``instructions.run_benchmark``). On an idle node — or a busy
   one in a pool whose ``reverification_busy_policy`` is ``full`` — the whole machine is measured
   against ``verified`` (mode ``full``). On a busy node the ``free`` policy measures only what is
   free, ``allocatable − allocated`` per resource, sent as the benchmark's ``limits`` and compared
   with the same amounts (mode ``free``); the ``idle`` policy postpones the run until the node
   holds no allocation. Either way the benchmark never takes capacity from running leases.

A measurement below ``expected × (1 − tolerance_percent / 100)`` for any benchmarked resource is
``measured_below_verified``; no answer by the benchmark's deadline is ``no_answer``; late or
repeated answers get the benchmark flow's refusals (404/409/410, fleet.benchmarks.benchmark_complete).

**Deverification** (failed): the node gets the ``nodepool.dev/unverified:NoSchedule`` taint and
``Unverified=True`` (fleet.trust), and a ``reverification`` event with the evidence. Running
leases stay; new work that does not tolerate the taint goes elsewhere. **Passing** lifts both, and
verifies the devices that appeared since admission (their snapshot becomes ``verified``). Each
finished run schedules the next.

Every entry point is safe to run twice at once and idempotent; a run of a node that is not alive,
or (``idle`` policy) is busy, is postponed by :data:`POSTPONE`, never run in a tight loop.
"""

from __future__ import annotations

import logging
import secrets
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q
from django.utils import timezone

from humanunits import quantity
from nodepool import fsm

from . import event_types, signals, trust
from .admission import BENCHMARKED_RESOURCES, check_attestation
from .choices import CheckStatus, Lifecycle, Liveness, ReverificationBusyPolicy, ReverificationState
from .devices import sync_counts
from .events import Actor, record_event
from .instructions import Instruction, post_instructions
from .metrics import REVERIFICATIONS
from .models import Benchmark, Device, Node, NodeResource, Pool, Reverification

logger = logging.getLogger(__name__)

# Outcome codes (Reverification.code): stable, documented in docs/fleet.md.
PASSED = "passed"
MEASURED_BELOW_VERIFIED = "measured_below_verified"
INVENTORY_MISMATCH = "inventory_mismatch"
ATTESTATION_FAILED = "attestation_failed"
NO_ANSWER = "no_answer"
NODE_LEFT_SERVICE = "node_left_service"
SCHEDULE_OFF = "schedule_off"
# The Unverified condition's reason for each failure code (Kubernetes condition reasons are CamelCase).
CONDITION_REASONS = {
    MEASURED_BELOW_VERIFIED: "MeasuredBelowVerified",
    INVENTORY_MISMATCH: "InventoryMismatch",
    ATTESTATION_FAILED: "AttestationFailed",
    NO_ANSWER: "NoBenchmarkAnswer",
}
# What the owner can do about each failure (the owner's view, GET /nodes/{id}/verification).
NEXT_STEPS = {
    MEASURED_BELOW_VERIFIED: (
        "The machine measured less than it was verified with. Restore the hardware it was admitted with "
        "(or stop what else runs on it); the next scheduled check lifts the mark when it measures up. "
        "If the machine changed for good, ask an operator to drain it and admit it again with its new capacity."
    ),
    INVENTORY_MISMATCH: (
        "A device now reports different attributes from the ones verified (listed in the evidence). Put the "
        "verified device back, or ask an operator to verify the new one; the next scheduled check then passes."
    ),
    ATTESTATION_FAILED: (
        "The node's attestation no longer verifies with the pool's trusted key. Re-enroll the machine with "
        "evidence signed by the pool's current key."
    ),
    NO_ANSWER: (
        "The node did not answer its benchmark in time. Keep the agent running and connected; the next "
        "scheduled check lifts the mark when it answers and measures up."
    ),
}
# Compared per device: what the node reports now against its verified snapshot (fleet.devices).
INVENTORY_FIELDS = ("model", "memory_bytes", "mig_profile", "serial")
POSTPONE = timedelta(minutes=5)
IN_SERVICE = (Lifecycle.READY,)
OPEN = (ReverificationState.SCHEDULED, ReverificationState.RUNNING)
_RANDOM = secrets.SystemRandom()


# --- the schedule ---------------------------------------------------------------------------------


def draw_due(pool: Pool, anchor: datetime, *, rng=_RANDOM) -> datetime:
    """The next due time after ``anchor``: ``anchor + period − window + U(0, window)`` seconds.

    ``rng`` is a :class:`random.Random`-like source (``uniform``); the default is the operating
    system's (:class:`secrets.SystemRandom`), so the draw cannot be replayed from a seed."""
    period, window = pool.reverification_period, pool.reverification_window
    return anchor + timedelta(seconds=period - window + rng.uniform(0, window))


def reverifications_schedule(*, now: datetime, limit: int = 500) -> int:
    """Give every ``ready`` node of a pool with a schedule that has no open run a ``scheduled`` one.

    The anchor is the node's last finished run, else ``now`` (a node newly admitted, or a pool whose
    schedule was just turned on, has its first check within one period, spread over the window —
    never the whole fleet at once). Concurrent schedulers insert at most one open run per node (the
    partial unique constraint; conflicting inserts are ignored). Returns how many were created.
    """
    open_runs = Reverification.objects.filter(node=OuterRef("pk"), state__in=OPEN)
    nodes = (
        Node.objects.filter(lifecycle__in=IN_SERVICE, pool__reverification_period__isnull=False)
        .filter(~Exists(open_runs))
        .select_related("pool")
        .only("pk", "pool")[:limit]
    )
    rows = []
    for node in nodes:
        last = (
            Reverification.objects.filter(node=node, finished_at__isnull=False)
            .order_by("-finished_at")
            .values_list("finished_at", flat=True)
            .first()
        )
        rows.append(Reverification(node=node, pool=node.pool, due_at=draw_due(node.pool, last or now)))
    created = Reverification.objects.bulk_create(rows, ignore_conflicts=True)
    return len(created)


def reverifications_cancel(*, actor: Actor, now: datetime) -> int:
    """Cancel open runs of nodes no longer in service or of pools whose schedule is off (set-based:
    one UPDATE per reason, legal sources taken from the model's ``cancel`` transition). A node that
    comes back into service is scheduled afresh. Returns how many were cancelled."""
    cancel_from = fsm.sources(Reverification, "cancel")
    cancelled = 0
    for code, condition in (
        (NODE_LEFT_SERVICE, ~Q(node__lifecycle__in=IN_SERVICE)),
        (SCHEDULE_OFF, Q(node__pool__reverification_period__isnull=True)),
    ):
        ids = list(Reverification.objects.filter(condition, state__in=cancel_from).values_list("pk", flat=True)[:500])
        if ids:
            cancelled += fsm.move(
                Reverification.objects.filter(pk__in=ids),
                "cancel",
                finished_at=now,
                code=code,
                reason=code.replace("_", " "),
            )
    return cancelled


# --- starting a run ---------------------------------------------------------------------------------


def inventory_drift(node: Node) -> list[dict[str, Any]]:
    """``[{"device_id", "field", "verified", "reported"}]``: each attribute of a live device of
    ``node`` that differs from the snapshot verified for it (one query). fleet.devices clears
    ``verified_at`` when the attributes change but keeps the snapshot, which is what this compares
    with. Devices never verified (no snapshot) are not drift: a passing run verifies them."""
    drift = []
    for row in Device.objects.filter(node=node, retired_at__isnull=True).exclude(verified={}):
        snapshot = row.verified or {}
        for name in INVENTORY_FIELDS:
            reported, verified = getattr(row, name), snapshot.get(name)
            if name in snapshot and (verified or None) != (reported or None):
                drift.append({"device_id": row.device_id, "field": name, "verified": verified, "reported": reported})
    return drift


def measurement_plan(node: Node, pool: Pool) -> tuple[str, dict[str, int], dict[str, int]] | None:
    """``(mode, expected, limits)`` for the benchmark of ``node``, or None to postpone.

    ``expected``/``limits`` are ``{resource: canonical int}`` over the benchmarked resources (cpu
    millicores, memory bytes). Idle node, or busy with policy ``full``: ``("full", verified, {})``.
    Busy with ``free``: ``("free", free, free)``, free = allocatable − allocated (resources with
    nothing free are left out; None when nothing is free). Busy with ``idle``: None."""
    verified = (node.verified or {}).get("resources") or {}
    rows = {r.name: r for r in NodeResource.objects.filter(node=node)}
    busy = any(r.allocated > 0 for r in rows.values())
    if not busy or pool.reverification_busy_policy == ReverificationBusyPolicy.FULL:
        expected = {name: int(verified[name]) for name in BENCHMARKED_RESOURCES if verified.get(name)}
        return "full", expected, {}
    if pool.reverification_busy_policy == ReverificationBusyPolicy.IDLE:
        return None
    free = {name: rows[name].free for name in BENCHMARKED_RESOURCES if name in rows and rows[name].free > 0}
    return ("free", free, dict(free)) if free else None


def _postpone(run: Reverification, now: datetime, why: str) -> str:
    Reverification.objects.filter(pk=run.pk, state=ReverificationState.SCHEDULED).update(
        due_at=now + POSTPONE, postponed=F("postponed") + 1, reason=f"postponed: {why}"
    )
    return "postponed"


def reverification_start(*, run_id: int, actor: Actor, now: datetime | None = None) -> str:
    """Start the due run ``run_id``: claim it, compare inventory and attestation, ask for the benchmark.

    Returns ``"started"`` (a benchmark asked for), ``"failed"`` (inventory or attestation failed at
    once: the node is deverified), ``"postponed"`` (the node is not alive, or busy under the
    ``idle`` policy, or has nothing free to measure) or ``"not_due"`` (another sweep took it, it
    was cancelled, or it is not due yet). Locks the node row first (``FOR NO KEY UPDATE``, the
    order every node action takes), then claims the run by compare-and-swap on its state.
    """
    now = now or timezone.now()
    with transaction.atomic():
        run = Reverification.objects.filter(pk=run_id).first()
        if run is None:
            return "not_due"
        node = Node.objects.select_for_update(no_key=True).select_related(None).filter(pk=run.node_id).first()
        run = Reverification.objects.filter(pk=run_id, state=ReverificationState.SCHEDULED, due_at__lte=now).first()
        if node is None or run is None:
            return "not_due"
        pool = Pool.objects.get(pk=node.pool_id)
        if node.lifecycle not in IN_SERVICE or pool.reverification_period is None:
            return "not_due"  # the cancel sweep closes it
        if node.liveness != Liveness.ALIVE:
            return _postpone(run, now, f"the node is {node.liveness}")
        plan = measurement_plan(node, pool)
        if plan is None:
            why = "waiting for the node to be idle" if pool.reverification_busy_policy == "idle" else "nothing free"
            return _postpone(run, now, why)
        run.start()
        claimed = fsm.move(Reverification.objects.filter(pk=run.pk), "start", started_at=now)
        if not claimed:
            return "not_due"
        run.started_at = now
        drift = inventory_drift(node)
        if drift:
            listed = "; ".join(f"{d['device_id']} {d['field']} {d['verified']!r} → {d['reported']!r}" for d in drift)
            _finish(run, node, failed=True, code=INVENTORY_MISMATCH, actor=actor, now=now,
                    reason=f"the device inventory no longer matches what was verified: {listed}",
                    evidence={"inventory": drift})  # fmt: skip
            return "failed"
        if pool.attestation_required:
            outcome = check_attestation(node, pool)
            if outcome.status != CheckStatus.PASSED:
                _finish(run, node, failed=True, code=ATTESTATION_FAILED, actor=actor, now=now,
                        reason=f"attestation: {outcome.detail}", evidence={"attestation": outcome.detail})  # fmt: skip
                return "failed"
        mode, expected, limits = plan
        deadline = now + timedelta(seconds=pool.benchmark_timeout)
        bench = Benchmark.objects.create(
            node=node, nonce=secrets.token_urlsafe(24), requested_at=now, deadline=deadline, limits=limits
        )
        Reverification.objects.filter(pk=run.pk).update(benchmark=bench, mode=mode, expected=expected)
        post_instructions([node.pk], Instruction.BENCHMARK)
        record_event(
            node, event_types.REVERIFICATION, actor, from_state=ReverificationState.SCHEDULED,
            to_state=ReverificationState.RUNNING, reason=f"re-verification started: benchmark ({mode}) due by "
            f"{deadline.isoformat()}", data={"reverification": run.pk, "nonce": bench.nonce, "mode": mode,
                                              "expected": expected, "limits": limits},
        )  # fmt: skip
    return "started"


# --- finishing a run ----------------------------------------------------------------------------------


def compare(expected: dict[str, int], measured: dict[str, int], tolerance_percent: float) -> tuple[dict, list[str]]:
    """``(ratios, shortfalls)``: ``measured / expected`` per resource (rounded to 3 places) and a
    sentence for each below ``1 − tolerance_percent / 100``. Pure."""
    floor = 1 - tolerance_percent / 100
    ratios, shortfalls = {}, []
    for name, want in expected.items():
        if not want:
            continue
        got = int(measured.get(name) or 0)
        ratio = got / want
        ratios[name] = round(ratio, 3)
        if ratio < floor:
            shortfalls.append(
                f"measured {name} {quantity(name, got)} is {ratio:.0%} of the expected {quantity(name, want)} "
                f"(tolerance {tolerance_percent:g}%)"
            )
    return ratios, shortfalls


def _on_benchmark_finished(sender, *, benchmark: Benchmark, measured: dict | None, actor: Actor, now, **kwargs):
    """fleet.signals.benchmark_finished: finish the running re-verification that asked for it."""
    run = Reverification.objects.filter(benchmark=benchmark, state=ReverificationState.RUNNING).first()
    if run is None:
        return
    node = Node.objects.select_for_update(no_key=True).get(pk=run.node_id)
    run = Reverification.objects.filter(pk=run.pk, state=ReverificationState.RUNNING).first()
    if run is None:
        return
    pool = Pool.objects.get(pk=node.pool_id)
    if measured is None:
        _finish(run, node, failed=True, code=NO_ANSWER, actor=actor, now=now,
                reason=f"no benchmark answer by its deadline {benchmark.deadline.isoformat()}",
                evidence={"nonce": benchmark.nonce})  # fmt: skip
        return
    measured = {name: measured[name] for name in BENCHMARKED_RESOURCES if name in measured}
    ratios, shortfalls = compare(run.expected or {}, measured, pool.reverification_tolerance_percent)
    evidence = {"nonce": benchmark.nonce, "ratios": ratios, "shortfalls": shortfalls, "limits": benchmark.limits}
    if shortfalls:
        _finish(run, node, failed=True, code=MEASURED_BELOW_VERIFIED, actor=actor, now=now, measured=measured,
                reason="measured below verified: " + "; ".join(shortfalls), evidence=evidence)  # fmt: skip
    else:
        _finish(run, node, failed=False, code=PASSED, actor=actor, now=now, measured=measured,
                reason=f"benchmark ({run.mode}) confirms the verified capability", evidence=evidence)  # fmt: skip


signals.benchmark_finished.connect(
    _on_benchmark_finished, sender=Benchmark, dispatch_uid="fleet.reverification.benchmark_finished"
)


def _verify_new_devices(node: Node, actor: Actor, now: datetime) -> list[str]:
    """Verify the live devices of ``node`` never verified (they appeared after admission: no
    snapshot); their snapshot becomes ``verified`` (fleet.devices' shape). A device whose attributes
    changed since its verification is not among them: it is drift (:func:`inventory_drift`), for an
    operator's "verify device". Returns their ids."""
    rows = list(
        Device.objects.filter(node=node, retired_at__isnull=True, verified_at__isnull=True, verified={}).exclude(
            device_id__startswith="k8s-"
        )
    )
    for row in rows:
        row.verified = {"id": row.device_id, "type": row.type, "model": row.model, "memory_bytes": row.memory_bytes,
                        "mig_profile": row.mig_profile, "serial": row.serial, "pci_bus_id": row.pci_bus_id}  # fmt: skip
        row.verified_at, row.verified_by = now, f"reverification:{actor.name}"
        row.save(update_fields=["verified", "verified_at", "verified_by"])
    return [row.device_id for row in rows]


def _finish(run, node, *, failed: bool, code: str, reason: str, evidence: dict, actor: Actor, now: datetime,
            measured: dict | None = None) -> None:  # fmt: skip
    """Close ``run`` (running → failed | passed) and mark or clear ``node``; schedule the next run.
    Call inside a transaction holding the node's row lock, the run read ``running`` under it."""
    if failed:
        run.fail()
    else:
        run.confirm()
    run.finished_at, run.code, run.reason, run.evidence = now, code, reason, evidence
    run.measured = measured or {}
    run.save(update_fields=["state", "finished_at", "code", "reason", "evidence", "measured"])
    verified_devices = []
    if failed:
        trust.mark_unverified(node, reason=CONDITION_REASONS[code], message=reason, now=now)
        changed = True
    else:
        changed = trust.clear_unverified(node, message=reason, now=now)
        verified_devices = _verify_new_devices(node, actor, now)
        if verified_devices:
            evidence["verified_devices"] = verified_devices
            Reverification.objects.filter(pk=run.pk).update(evidence=evidence)
    if changed:
        node.version += 1
        node.save(update_fields=["taints", "taints_added_at", "conditions", "version", "updated_at"])
    if verified_devices:
        sync_counts(node)
    record_event(
        node, event_types.REVERIFICATION, actor, from_state=ReverificationState.RUNNING, to_state=run.state,
        reason=reason, data={"reverification": run.pk, "code": code, "mode": run.mode, "expected": run.expected,
                             "measured": run.measured, **evidence},
    )  # fmt: skip
    pool = Pool.objects.get(pk=node.pool_id)
    if pool.reverification_period is not None and node.lifecycle in IN_SERVICE:
        Reverification.objects.create(node=node, pool=pool, due_at=draw_due(pool, now))
    outcome, pool_name = ("failed" if failed else "passed"), pool.name
    transaction.on_commit(lambda: REVERIFICATIONS.labels(pool=pool_name, outcome=outcome).inc())


# --- the sweep ---------------------------------------------------------------------------------------


def reverify_due(*, actor: Actor, now: datetime | None = None, limit: int = 200) -> dict[str, int]:
    """One pass of the beat job ``fleet.reverify_due_nodes``: cancel runs of nodes out of service,
    schedule nodes without a run, start the due ones (at most ``limit``, oldest due first).

    Safe to run twice at once: scheduling inserts at most one open run per node, and each start is
    a compare-and-swap under the node's row lock. A run that raises is logged and left scheduled
    for the next pass; lost ``Unverified`` conditions are put back (:func:`conditions_repair`).
    Returns counts: ``{"cancelled", "scheduled", "started", "failed", "postponed", "repaired"}``.
    """
    now = now or timezone.now()
    summary = {"cancelled": reverifications_cancel(actor=actor, now=now),
               "scheduled": reverifications_schedule(now=now), "started": 0, "failed": 0, "postponed": 0,
               "repaired": conditions_repair(now=now)}  # fmt: skip
    due = Reverification.objects.filter(state=ReverificationState.SCHEDULED, due_at__lte=now).order_by("due_at")
    for run_id in list(due.values_list("pk", flat=True)[:limit]):
        try:
            result = reverification_start(run_id=run_id, actor=actor, now=now)
        except Exception:  # one bad row never stops the sweep (healthchecks' sendalerts)
            logger.exception("reverification_start_failed", extra={"reverification_id": run_id})
            continue
        if result in summary:
            summary[result] += 1
    return summary


def conditions_repair(*, now: datetime, limit: int = 500) -> int:
    """Put ``Unverified=True`` back on tainted nodes that lost it. A status report applies its
    conditions with a compare-and-swap on the node's sequence, not its version (fleet.heartbeats),
    so one read before a deverification and applied after it writes the condition list without
    ``Unverified``; the taint, which reports never write, stays. Row by row under the node's lock;
    the reason and message come from the node's latest failed run. Returns how many were repaired."""
    repaired = 0
    tainted = Node.objects.exclude(lifecycle=Lifecycle.RETIRED).exclude(taints=[]).values_list("pk", "taints")
    for node_id, taints in tainted.iterator(chunk_size=2000):
        if repaired >= limit or not any(t.get("key") == trust.UNVERIFIED_TAINT_KEY for t in taints or []):
            continue
        with transaction.atomic():
            node = Node.objects.select_for_update(no_key=True).get(pk=node_id)
            if not trust.is_unverified(node) or any(
                c.get("type") == trust.UNVERIFIED and c.get("status") == "True" for c in node.conditions or []
            ):
                continue
            failed = history(node_id, limit=1)
            code = failed[0].code if failed and failed[0].code in CONDITION_REASONS else MEASURED_BELOW_VERIFIED
            message = failed[0].reason if failed else "deverified by a scheduled re-verification"
            trust.mark_unverified(node, reason=CONDITION_REASONS[code], message=message, now=now)
            node.save(update_fields=["conditions", "updated_at"])
            repaired += 1
    return repaired


# --- reading ------------------------------------------------------------------------------------------


def history(node_id, *, limit: int = 20) -> list[Reverification]:
    """A node's finished runs (passed, failed), newest first: its re-verification history."""
    finished = Reverification.objects.filter(
        node_id=node_id, state__in=[ReverificationState.PASSED, ReverificationState.FAILED]
    )
    return list(finished.order_by("-finished_at", "-id")[:limit])


def unverified_between(node_id, start: datetime, end: datetime) -> Reverification | None:
    """The failed run that left ``node_id`` unverified at some time in ``[start, end]``, or None:
    a run failed before ``end`` with no passing run (nor re-admission) finishing after it and
    before ``start``. Marketplace reconciliation flags usage in such a window for review."""
    failed = (
        Reverification.objects.filter(node_id=node_id, state=ReverificationState.FAILED, finished_at__lte=end)
        .order_by("-finished_at")
        .first()
    )
    if failed is None:
        return None
    cleared = Reverification.objects.filter(
        node_id=node_id, state=ReverificationState.PASSED, finished_at__gt=failed.finished_at, finished_at__lte=start
    ).exists()
    return None if cleared else failed
