"""``StatusReportOverdue``: a node that renews but has not sent a status report for too long.

Liveness follows renewals; readiness, health, usage and the leases a node runs come from its
status reports (fleet.heartbeats). A node that keeps renewing but whose last status report is
older than two status-report intervals (``Pool.status_report_interval``, at least the renewal
interval) is still alive, but what we know of it is stale news: the liveness sweep gives it the
server-owned condition ``StatusReportOverdue`` (status ``True``), takes it out of placement
(unschedulable reason ``status_report_overdue``) and raises the ``STATUS_REPORT`` flag so its next
renewal asks for a report. Its liveness is unchanged. The next applied status report clears it
(the condition goes, with a condition event, and the node is schedulable again if nothing else
stops it).
"""

from __future__ import annotations

from datetime import datetime

from django.db import transaction

from . import event_types
from .choices import Lifecycle, Liveness
from .events import Actor, event_row
from .health import STATUS_REPORT_OVERDUE
from .instructions import Instruction, post_instructions
from .models import Node, NodeEvent

# Rows marked per sweep run: a fleet-wide reporting failure is marked over a few runs rather
# than in one long transaction; the rest stay due and are picked up next time.
BATCH = 1000


def overdue_condition(now: datetime) -> dict:
    return {
        "type": STATUS_REPORT_OVERDUE,
        "status": "True",
        "reason": "NoStatusReport",
        "message": "no status report for more than two status-report intervals; the node still renews",
        "last_transition_time": now.isoformat(),
    }


def mark_overdue(*, now: datetime, actor: Actor) -> int:
    """Give every alive node whose status report is due (``status_report_due_at <= now``) the
    ``StatusReportOverdue`` condition; returns how many were marked.

    Selected through the partial index ``node_status_report_due``; each row is claimed by
    compare-and-swap on the deadline it was read with, so a status report arriving meanwhile (it
    moves the deadline) wins, and two sweeps at once mark a node once, with one event.
    """
    due = list(
        Node.objects.filter(status_report_due_at__lte=now, status_report_overdue=False, liveness=Liveness.ALIVE)
        .exclude(lifecycle=Lifecycle.RETIRED)
        .order_by("status_report_due_at")
        .values_list("pk", "pool_id", "status_report_due_at", "conditions")[:BATCH]
    )
    marked = []
    for pk, pool_id, due_at, conditions in due:
        kept = [c for c in conditions or [] if c.get("type") != STATUS_REPORT_OVERDUE]
        with transaction.atomic():
            claimed = Node.objects.filter(pk=pk, status_report_due_at=due_at, status_report_overdue=False).update(
                status_report_overdue=True,
                conditions=[*kept, overdue_condition(now)],
                status_report_due_at=None,
            )
            if not claimed:
                continue
            NodeEvent.objects.bulk_create(
                [
                    event_row(
                        pk,
                        event_types.CONDITION,
                        actor,
                        from_state="",
                        to_state="True",
                        pool=pool_id,
                        reason=f"{STATUS_REPORT_OVERDUE}: absent → True",
                        data={"type": STATUS_REPORT_OVERDUE, "reason": "NoStatusReport"},
                    )  # fmt: skip
                ]
            )
        marked.append(pk)
    # The node's next renewal asks for the report.
    post_instructions(marked, Instruction.STATUS_REPORT, on_commit=False)
    return len(marked)
