"""Applying a node's heartbeat: ordering, restarts, conditions, clock skew, instructions.

A heartbeat is applied only when its ``(incarnation, sequence)`` is newer than the stored one:
a higher incarnation, or the same incarnation with a higher sequence. The check and the write
are one conditional UPDATE, so of two racing requests at most one can win; a duplicate, an
older sequence or an older incarnation changes nothing and says so with a stable code.

The UPDATE also carries the values this request read (incarnation, sequence, liveness, the
overdue flag) in its WHERE clause, a compare-and-swap: the events it writes (restart, liveness,
readiness, condition, health changes) are derived from exactly the state it replaced. When
another heartbeat or a sweep got there first, the service re-reads the row and tries again. Any
other change to the node meanwhile (a drain, an upgrade step, a cordon: they bump ``version``,
which the UPDATE returns) makes it reload the node before the answer is built, so an instruction
whose bit the UPDATE cleared is not lost to a stale snapshot.

Times: ``received_at`` is the server's clock. Liveness deadlines come only from it; the node's
``observed_at`` is used only to measure clock skew (a ``ClockSkew`` condition beyond
``NODEPOOL["CLOCK_SKEW_THRESHOLD"]`` seconds), so a node clock in the future never makes a node
look alive longer and one in the past never makes a fresh heartbeat look stale.

The accepted path costs a fixed number of statements: the credential lookup (authentication,
which also loads the node and its pool) and this UPDATE; plus, only when something changed, one
INSERT of events inside a transaction, and only for a node being admitted, a benchmark lookup
(tests/fleet/test_heartbeats_api.py asserts the counts).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from nodepool.api.problems import Conflict, Gone

from . import devices, event_types, health, liveness
from . import sql as fleet_sql
from .choices import BenchmarkStatus, Lifecycle, Liveness
from .errors import CONCURRENT_HEARTBEAT, NODE_RETIRED
from .events import Actor, event_row
from .heartbeat_rules import (
    APPLIED,
    condition_changes,
    merge_conditions,
    ordering_code,
    rotate_hint,
    skew_condition,
)
from .instructions import Instruction, status_report_instructions
from .models import Benchmark, Node, NodeCredential, NodeEvent
from .pacing import TooManyRequests, min_spacing_fraction, pool_timings

logger = logging.getLogger(__name__)

# --- limits (documented in docs/heartbeats.md; beyond them: 413 or 422 and nothing applied) -------
MAX_BODY_BYTES = 192 * 1024  # room for 256 devices (fleet.devices.MAX_DEVICES) beside the rest
MAX_CONDITIONS = 32
MAX_LEASES = 256
MAX_USAGE_ENTRIES = 32
MAX_CONDITION_TYPE = 63
MAX_REASON = 128
MAX_MESSAGE = 1024
MAX_AGENT_VERSION = 64
MAX_READY_REASON = 200
MAX_LEASE_STATE = 32
MAX_COUNTER = 2**53  # incarnation and sequence stay exact in every JSON client

MAX_ATTEMPTS = 5
# Benchmarks are part of admission (issue 3): only a node being admitted is asked to run one, so
# a ready node's heartbeat does not pay for the lookup.
ADMISSION_LIFECYCLES = (Lifecycle.PENDING, Lifecycle.ADMITTING)

# A node whose status report is late by this many status-report intervals gets StatusReportOverdue.
STATUS_REPORT_OVERDUE_INTERVALS = 2
STATUS_REPORT_OVERDUE = health.STATUS_REPORT_OVERDUE


# Where the control plane wants a node in each lifecycle to end up (told to the agent).
_DESIRED = {Lifecycle.ADMITTING: Lifecycle.READY, Lifecycle.DRAINING: Lifecycle.MAINTENANCE}


@dataclass(frozen=True)
class HeartbeatReport:
    """A validated heartbeat body (fleet.api.heartbeat_serializers builds it).

    ``conditions``: ``[{"type", "status", "reason", "message"}]``; ``usage``: ``{resource: int}``
    in canonical units; ``leases``: ``[{"lease_id": str, "fencing_token": int, "state": str}]``.
    """

    incarnation: int
    sequence: int
    observed_at: datetime
    agent_version: str = ""
    ready: bool = False
    ready_reason: str = ""
    conditions: list[dict] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    leases: list[dict] = field(default_factory=list)
    # The device part (fleet.devices): parsed devices (None when the report had none), what
    # parsing refused, and the host's boot id (None when not sent).
    devices: list[dict] | None = None
    device_refusals: list[dict] = field(default_factory=list)
    boot_id: str | None = None


@dataclass
class HeartbeatOutcome:
    """What happened to one heartbeat; the view turns it into the response body."""

    applied: bool
    code: str
    node: Node
    received_at: datetime
    next_heartbeat_in: float
    status_report_interval: float = 60.0
    # The interval told, without the slot's offset (docs/api-contract.md ``renewal_interval``).
    renewal_interval: float = 0.0
    restarted: bool = False
    stop_leases: list[str] = field(default_factory=list)
    checkpoint_leases: list[str] = field(default_factory=list)
    assigned_leases: list[dict] | None = None
    run_benchmark: dict | None = None
    rotate_credential: bool = False
    events: int = 0
    instructions: dict = field(default_factory=dict)

    @property
    def desired_lifecycle(self) -> str:
        return _DESIRED.get(self.node.lifecycle, self.node.lifecycle)


def apply_heartbeat(
    *,
    node: Node,
    report: HeartbeatReport,
    actor: Actor,
    credential: NodeCredential | None = None,
    now: datetime | None = None,
) -> HeartbeatOutcome:
    """Apply ``report`` to ``node`` if it is newer than the stored heartbeat.

    Args:
        node: the authenticated node, with its pool loaded (the snapshot the UPDATE compares with).
        report: the validated body.
        actor: the node, as fleet.events.Actor.
        credential: the credential used (for the rotation hint).
        now: the server's receipt time (default: now).

    Returns:
        HeartbeatOutcome: ``applied`` with code ``applied``, or not applied with
        ``duplicate_sequence`` / ``stale_sequence`` / ``stale_incarnation`` (nothing changed).

    Raises:
        Gone: the node is retired (410 ``node_retired``); nothing is recreated.
        Conflict: the row kept changing under the request (409 ``concurrent_heartbeat``).
    """
    received_at = now or timezone.now()
    # The same per-process timings as the renewals (fleet.pacing says why).
    timings = pool_timings(node.pool_id) if node.pool_id else liveness.timings_for(node.pool, 0)
    for _attempt in range(MAX_ATTEMPTS):
        if node.lifecycle == Lifecycle.RETIRED:
            raise Gone("This node is retired; it can no longer send heartbeats.", NODE_RETIRED)
        code = ordering_code(
            stored_incarnation=node.incarnation,
            stored_sequence=node.sequence,
            incarnation=report.incarnation,
            sequence=report.sequence,
        )
        if code != APPLIED:
            return HeartbeatOutcome(
                applied=False,
                code=code,
                node=node,
                received_at=received_at,
                next_heartbeat_in=liveness.next_heartbeat_in(timings, node_id=node.pk, now=received_at),
                renewal_interval=timings.interval,
                status_report_interval=timings.status_report_interval,
                rotate_credential=rotate_hint(credential, received_at),
            )
        _check_spacing(node=node, report=report, received_at=received_at, timings=timings)
        outcome = _try_apply(node=node, report=report, actor=actor, received_at=received_at, timings=timings)
        if outcome is not None:
            outcome.rotate_credential = rotate_hint(credential, received_at)
            return outcome
        # Someone changed the row since we read it (a racing heartbeat, the sweep, a retirement).
        node = Node.objects.select_related("pool").get(pk=node.pk)
    raise Conflict("The node changed during this heartbeat; send it again.", CONCURRENT_HEARTBEAT)


def _check_spacing(*, node: Node, report: HeartbeatReport, received_at: datetime, timings: liveness.Timings) -> None:
    """The flood guard of status reports: not sooner than half the interval last told.

    Exempt: a report the node was asked for (its pending-instructions marker is set), the first
    report of a new incarnation (unless the node already restarted within the spacing: an agent
    that starts a new incarnation with every report must not flood through the exemption), and
    the first one after the interval changed. Checked on the
    snapshot the conditional UPDATE compares with (its sequence): a racing report that moved the
    row makes this request re-read and check again, so the guard costs no extra statement.

    Raises:
        TooManyRequests: 429 with ``Retry-After``; nothing is written.
    """
    not_before = node.status_report_not_before
    if (
        not_before is None
        or not_before <= received_at
        or node.instructions
        or (report.incarnation > node.incarnation and not _restarted_within(node, received_at, timings))
        or node.interval_given != timings.interval
    ):
        return

    wait = (not_before - received_at).total_seconds()
    raise TooManyRequests(
        f"Status reports may come at most every {timings.interval * min_spacing_fraction():g}s unless a flag "
        f"asks for one; retry in {wait:.1f}s (renewals keep the node alive meanwhile).",
        wait,
    )


def _restarted_within(node: Node, received_at: datetime, timings: liveness.Timings) -> bool:
    """Whether ``node`` recorded a restart less than the flood guard's spacing before
    ``received_at``. One indexed query, only for a new incarnation inside the spacing."""
    since = received_at - timedelta(seconds=timings.interval * min_spacing_fraction())
    return NodeEvent.objects.filter(node_id=node.pk, type=event_types.RESTART, created_at__gt=since).exists()


def _try_apply(
    *, node: Node, report: HeartbeatReport, actor: Actor, received_at: datetime, timings: liveness.Timings
) -> HeartbeatOutcome | None:
    """One compare-and-swap attempt; None when the row was not the one ``node`` describes."""
    restarted = report.incarnation > node.incarnation
    skew = (report.observed_at - received_at).total_seconds()
    previous_skew = next((c for c in node.conditions or [] if c.get("type") == health.CLOCK_SKEW), None)
    conditions = merge_conditions(
        node.conditions or [], report.conditions, skew_condition(previous_skew, skew, received_at), received_at
    )
    node_health, health_reasons = health.evaluate_for_pool(conditions, node.pool)
    values: dict[str, Any] = {
        "incarnation": report.incarnation,
        "sequence": report.sequence,
        "last_heartbeat_at": received_at,
        "liveness": Liveness.ALIVE,
        # The stale deadline: two told intervals of silence (the slot moves the next renewal at most 0.4 of one).
        "next_liveness_check_at": received_at + timedelta(seconds=timings.stale_after),
        "clock_skew_seconds": round(skew, 3),
        # The status report delivers every pending instruction (read after this UPDATE, so one
        # posted meanwhile raises its bit again), restarts the overdue clock and the flood guard.
        "instructions": 0,
        "interval_given": timings.interval,
        "status_report_not_before": received_at + timedelta(seconds=timings.interval * min_spacing_fraction()),
        "last_status_report_at": received_at,
        "status_report_due_at": received_at
        + timedelta(seconds=STATUS_REPORT_OVERDUE_INTERVALS * timings.status_report_interval),
        "status_report_overdue": False,
    }
    for name in ("agent_version", "ready", "ready_reason", "usage"):
        if getattr(node, name) != getattr(report, name):
            values[name] = getattr(report, name)
    if conditions != (node.conditions or []):
        values["conditions"] = conditions
    if node_health != node.health or health_reasons != (node.health_reasons or []):
        values["health"], values["health_reasons"] = node_health, health_reasons
    if node.liveness != Liveness.ALIVE:
        values["liveness_changed_at"] = received_at
    if restarted:
        values["restart_count"] = None  # incremented in SQL

    events = _events(node=node, report=report, conditions=conditions, health_value=node_health, skew=skew, actor=actor)
    # With events to append (a restart among them) or leases listed, the UPDATE, the events and
    # the lease reconciliation share one transaction: a drain reads "this node no longer lists that
    # ended lease" from last_status_report_at and the leases' last_reported_at together
    # (maintenance.drains), and must never see the first without the second. A report that lists
    # nothing and changes nothing, the common case of an idle node, is the single conditional
    # UPDATE in autocommit (atomic by itself): no BEGIN/COMMIT round trips; its reconciliation then
    # runs in its own transaction, and, being recomputed from every report, a crash between the
    # two is repaired by the next one.
    # Read before the UPDATE clears it: a benchmark was posted for a node in service (fleet.reverification).
    benchmark_posted = bool(node.instructions & Instruction.BENCHMARK)
    with transaction.atomic() if events or report.leases else nullcontext():
        version = _conditional_update(node=node, report=report, values=values)
        if version is None:
            return None
        if restarted:
            values["restart_count"] = node.restart_count + 1
        for name, value in values.items():
            setattr(node, name, value)
        if version != node.version:
            # A drain, an upgrade step or an operator changed the node between the read this
            # report compares with and its UPDATE (which cleared the pending-instruction marker):
            # what the apps above answer must come from the node as it now is, or an instruction
            # posted meanwhile (an upgrade for a node now in maintenance) is lost with its bit.
            node.reload()
        if events:
            NodeEvent.objects.bulk_create(events)
        # Reads in autocommit on the fast path; the writers inside (lease reconciliation, an
        # automatic quarantine) open their own transactions.
        return _after_apply(node=node, report=report, actor=actor, received_at=received_at, timings=timings,
                            restarted=restarted, events=len(events), benchmark_posted=benchmark_posted)  # fmt: skip


def _conditional_update(*, node: Node, report: HeartbeatReport, values: dict[str, Any]) -> int | None:
    """The one conditional statement that applies a heartbeat: the row's ``version`` when this
    request won, None when it did not.

    ``UPDATE … WHERE id = :id AND (incarnation < :inc OR (incarnation = :inc AND sequence < :seq))``
    plus the incarnation, sequence, liveness and overdue flag this request read (its
    compare-and-swap: the sweeps move those and the conditions that go with them without bumping
    ``version``) and ``lifecycle <> 'retired'``. ``RETURNING version`` tells the caller whether
    anything else about the node (lifecycle, cordon, holds: every such change bumps ``version``)
    moved since that read. The statement is ``fleet.sql.status_report_update`` (why it is SQL:
    there).
    """
    sql, params = fleet_sql.status_report_update(
        node=node, report_incarnation=report.incarnation, report_sequence=report.sequence, values=values
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return row[0] if row else None


def _after_apply(*, node, report, actor, received_at, timings, restarted, events, benchmark_posted) -> HeartbeatOutcome:
    """Hand the status report to the apps above (lease reconciliation, automatic-quarantine rules,
    upgrades: the ordered registry of fleet.instructions) and add the benchmark instruction."""
    if report.devices is not None or report.device_refusals or report.boot_id is not None:
        _apply_devices(node, report, actor, received_at)
    leases = status_report_instructions(
        sender=Node,
        node=node,
        incarnation=report.incarnation,
        leases=report.leases,
        usage=report.usage,
        agent_version=report.agent_version,
        restarted=restarted,
        actor=actor,
    )
    benchmark = None
    # Being admitted: looked up at every report. In service: only when a re-verification posted the
    # BENCHMARK bit, so that a ready node's report costs no query for it otherwise.
    if node.lifecycle in ADMISSION_LIFECYCLES or (node.lifecycle == Lifecycle.READY and benchmark_posted):
        benchmark = (
            Benchmark.objects.filter(node_id=node.pk, status=BenchmarkStatus.REQUESTED, deadline__gt=received_at)
            .order_by("-requested_at")
            .values_list("nonce", "deadline", "limits")
            .first()
        )
    return HeartbeatOutcome(
        applied=True,
        code=APPLIED,
        node=node,
        received_at=received_at,
        next_heartbeat_in=liveness.next_heartbeat_in(timings, node_id=node.pk, now=received_at),
        renewal_interval=timings.interval,
        status_report_interval=timings.status_report_interval,
        restarted=restarted,
        stop_leases=[str(i) for i in leases.get("stop", [])],
        checkpoint_leases=[str(i) for i in leases.get("checkpoint", [])],
        assigned_leases=leases.get("assigned"),
        run_benchmark=(
            {"nonce": benchmark[0], "deadline": benchmark[1], **({"limits": benchmark[2]} if benchmark[2] else {})}
            if benchmark
            else None
        ),
        events=events,
        # Instructions of the apps above beyond the lease ones (operations' "upgrade"), as they
        # returned them (fleet.instructions, the ordered registry of status-report handlers).
        instructions={k: v for k, v in leases.items() if k not in ("stop", "checkpoint", "assigned")},
    )


def _apply_devices(node: Node, report: HeartbeatReport, actor, received_at: datetime) -> None:
    """The device part of the report, in its own transaction: a fault in it is logged and never
    spoils the rest of the report (already applied) nor answers 500."""
    try:
        devices.apply_report(
            node=node,
            devices=report.devices,
            refusals=report.device_refusals,
            boot_id=report.boot_id,
            actor=actor,
            now=received_at,
        )
    except Exception:
        logger.exception("device_report_failed", extra={"node_id": str(node.pk)})


def _events(
    *, node: Node, report: HeartbeatReport, conditions: list[dict], health_value: str, skew: float, actor
) -> list:
    """The events an applied heartbeat appends; empty when nothing but counters changed."""
    rows = []
    if report.incarnation > node.incarnation:
        rows.append(
            event_row(
                node.pk,
                event_types.RESTART,
                actor,
                from_state=str(node.incarnation),
                to_state=str(report.incarnation),
                reason="the agent restarted (new incarnation)",
                data={"restart_count": node.restart_count + 1, "agent_version": report.agent_version},
            )
        )
    if node.liveness != Liveness.ALIVE:
        rows.append(
            event_row(
                node.pk,
                event_types.LIVENESS,
                actor,
                from_state=node.liveness,
                to_state=Liveness.ALIVE,
                reason="heartbeat received",
            )  # fmt: skip
        )
    if node.ready != report.ready:
        rows.append(
            event_row(
                node.pk,
                event_types.READINESS,
                actor,
                from_state=str(node.ready).lower(),
                to_state=str(report.ready).lower(),
                reason=report.ready_reason,
            )
        )
    for kind, old, new, condition in condition_changes(node.conditions or [], conditions):
        event_type = event_types.CLOCK_SKEW if kind == health.CLOCK_SKEW else event_types.CONDITION
        data: dict[str, Any] = {"type": kind}
        if kind == health.CLOCK_SKEW:
            data["skew_seconds"] = round(skew, 3)
        if condition is not None:
            data.update(reason=condition.get("reason", ""), message=condition.get("message", ""))
        reason = f"{kind}: {old or 'absent'} → {new or 'absent'}"
        rows.append(event_row(node.pk, event_type, actor, from_state=old, to_state=new, reason=reason, data=data))
    if health_value != node.health:
        rows.append(event_row(node.pk, event_types.HEALTH, actor, from_state=node.health, to_state=health_value))
    return rows
