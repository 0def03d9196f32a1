"""Owner statements: per owner and period, the usage of their nodes as priced lines
(docs/marketplace.md, "Statements").

A usage record becomes a line of its owner's statement for the period containing the lease's end
(the next open one when that statement is already final). The line's amount counts once the record
is reconciled or adjusted. Finalizing moves a statement ``open → final`` only after its period is
over and only when every line is reconciled: pending lines refuse it; held and disputed lines are
first carried to the next period's statement with their reason. A final statement is immutable
(service, model and admin refuse changes) and is the hand-off point to whatever pays owners.
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from fleet.events import Actor, record_event
from nodepool import fsm
from nodepool.api.problems import Conflict, NotFound
from nodepool.api.versioning import check_version

from . import event_types, pricing
from .choices import PAYABLE_STATES, LineKind, StatementPeriod, StatementState, UsageState
from .errors import PERIOD_NOT_OVER, STATEMENT_FINAL, STATEMENT_HAS_UNRECONCILED_LINES, STATEMENT_NOT_FOUND
from .holds import evaluate_holds
from .models import OwnerSettings, Statement, StatementLine, UsageRecord


# --- periods ------------------------------------------------------------------------------------
def period_bounds(kind: str, at: datetime) -> tuple[datetime, datetime]:
    """``[start, end)`` in UTC of the ``kind`` period (:class:`StatementPeriod`) containing ``at``."""
    at = at.astimezone(UTC)
    if kind == StatementPeriod.DAY:
        start = at.replace(hour=0, minute=0, second=0, microsecond=0)
        return start, start + timedelta(days=1)
    if kind == StatementPeriod.WEEK:
        start = (at - timedelta(days=at.weekday())).replace(hour=0, minute=0, second=0, microsecond=0)
        return start, start + timedelta(days=7)
    start = at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start, end


def period_of(owner_id) -> str:
    return (
        OwnerSettings.objects.filter(owner_id=owner_id).values_list("statement_period", flat=True).first()
        or StatementPeriod.MONTH
    )


def statement_for(owner_id, at: datetime) -> Statement:
    """The owner's open statement for the period containing ``at``, created if missing; when that
    one is final, the next period's (a record that arrives late is never lost, nor put on a final
    statement).

    Locks the statement returned (``FOR NO KEY UPDATE``; call inside a transaction): a
    finalization holds it ``FOR UPDATE`` while it reads the lines, so a line added meanwhile waits
    and then finds the statement final, and goes to the next period's.
    """
    kind = period_of(owner_id)
    statements = Statement.objects.select_for_update(no_key=True)
    while True:
        start, end = period_bounds(kind, at)
        statement = statements.filter(owner_id=owner_id, period_start=start).first()
        if statement is None:
            try:
                with transaction.atomic():
                    statement = Statement.objects.create(
                        owner_id=owner_id, period=kind, period_start=start, period_end=end
                    )
            except IntegrityError:  # created meanwhile by a racing lease end
                statement = statements.get(owner_id=owner_id, period_start=start)
        if statement.state == StatementState.OPEN:
            return statement
        at = statement.period_end


# --- lines --------------------------------------------------------------------------------------
def _line_values(record: UsageRecord) -> dict:
    priced = pricing.price_intervals(
        pool_id=record.pool_id, resources=record.resources or {}, intervals=pricing.intervals_of(record)
    )
    counted = record.state in PAYABLE_STATES
    coverage = (
        (record.billable_seconds / record.allocated_seconds).quantize(Decimal("0.0001"))
        if record.allocated_seconds
        else Decimal(0)
    )
    reason = "; ".join(f["message"] for f in record.findings or [])
    if record.state == UsageState.PENDING:
        reason = f"inside the settlement window until {record.settle_after.isoformat()}"
    if priced.unpriced and counted:
        reason = "; ".join(filter(None, [reason, f"no price in force for {', '.join(priced.unpriced)} (part)"]))
    return {
        "state": record.state,
        "node_id_text": str(record.node_id),
        "pool_name": record.pool.name,
        "allocated_seconds": record.allocated_seconds,
        "billable_seconds": record.billable_seconds,
        "coverage": coverage,
        "quantities": {k: str(v) for k, v in priced.quantities.items()},
        "amount": priced.amount if counted else Decimal(0),
        "currency": priced.currency,
        "reason": reason,
    }


def attach_line(record: UsageRecord) -> StatementLine:
    """Put ``record`` on its owner's statement (inside the transaction that opened the record)."""
    statement = statement_for(record.owner_id, record.ended_at)
    return StatementLine.objects.create(statement=statement, usage_record=record, **_line_values(record))


def refresh_line(record: UsageRecord) -> StatementLine | None:
    """Bring the record's line up to date after reconciliation (never a final statement's line:
    only payable lines are on final statements and a payable record never changes again).

    Lock order: the caller holds the record row; an existing line is updated without locking its
    statement (the statement row is read, not locked), so a finalization, which locks the
    statement and then the records of its lines, waits for the record and never the reverse. Only
    a record without a line locks a statement here (attach_line → statement_for), and no
    finalization locks that record: it is on none of its statement's lines."""
    line = StatementLine.objects.filter(usage_record=record).select_related("statement").first()
    if line is None:
        return attach_line(record) if record.owner_id is not None else None
    if line.statement.state == StatementState.FINAL:
        return line
    StatementLine.objects.filter(pk=line.pk).update(**_line_values(record))
    return line


def correction_line(*, owner_id, after: datetime, amount: Decimal, currency: str, reason: str, **refs) -> StatementLine:
    """A correction line (positive or negative, already reconciled) on the owner's statement open
    after ``after``: how a reversed payout or a resolved line appeal is booked; the original line is
    never edited."""
    statement = statement_for(owner_id, after)
    return StatementLine.objects.create(
        statement=statement,
        kind=LineKind.CORRECTION,
        state=UsageState.RECONCILED,
        node_id_text="",
        pool_name=refs.get("corrects").pool_name if refs.get("corrects") else "",
        amount=amount,
        currency=currency,
        reason=reason[:2000],
        **refs,
    )


def totals(statement: Statement) -> dict[str, str]:
    """``{currency: amount}`` of the payable lines (as stored when final, computed while open)."""
    if statement.state == StatementState.FINAL:
        return dict(statement.totals)
    sums: dict[str, Decimal] = {}
    for currency, amount in statement.lines.filter(state__in=PAYABLE_STATES).values_list("currency", "amount"):
        if currency:
            sums[currency] = sums.get(currency, Decimal(0)) + amount
    return {currency: str(amount) for currency, amount in sorted(sums.items())}


# --- finalizing ---------------------------------------------------------------------------------
def finalize_statement(*, statement_id, expected_version: int, actor: Actor, now: datetime | None = None) -> Statement:
    """``open → final``: carry held and disputed lines to the next period, then freeze the rest.

    Raises: NotFound 404; PreconditionFailed 412 (stale version); Conflict 409
    ``statement_final`` (already final), ``period_not_over`` (its period has not ended),
    ``statement_has_unreconciled_lines`` (lines still pending reconciliation; ``pending`` = how many).
    Two operators finalizing at once: the statement row is locked, one wins, the other gets 412.

    Lock order: the statement row (``FOR UPDATE``), then the usage records of its lines, then (to
    carry lines) the next period's statement. A reconciliation holds its record and updates its
    line without locking the statement (refresh_line), so it never waits here for the statement.
    """
    now = now or timezone.now()
    with transaction.atomic():
        statement = Statement.objects.select_for_update().filter(pk=statement_id).first()
        if statement is None:
            raise NotFound("No such statement.", STATEMENT_NOT_FOUND)
        check_version(statement.version, expected_version)
        if statement.state == StatementState.FINAL:
            raise Conflict("The statement is final already.", STATEMENT_FINAL)
        if statement.period_end > now:
            raise Conflict(
                f"The period ends at {statement.period_end.isoformat()}; it cannot be final before.", PERIOD_NOT_OVER
            )
        # Lock the records of its lines: a reconciler must not move one between the check and the freeze.
        record_ids = list(statement.lines.values_list("usage_record_id", flat=True))
        states = dict(UsageRecord.objects.select_for_update().filter(pk__in=record_ids).values_list("pk", "state"))
        pending = sum(1 for state in states.values() if state == UsageState.PENDING)
        if pending:
            raise Conflict(
                f"{pending} line(s) are not reconciled yet (inside their settlement window).",
                STATEMENT_HAS_UNRECONCILED_LINES,
                pending=pending,
            )
        carry = [pk for pk, state in states.items() if state in (UsageState.HELD, UsageState.DISPUTED)]
        carried_out = []
        if carry:
            following = statement_for(statement.owner_id, statement.period_end)
            for line in statement.lines.filter(usage_record_id__in=carry).select_related("usage_record"):
                carried_out.append(
                    {
                        "usage_record": line.usage_record_id,
                        "state": states[line.usage_record_id],
                        "reason": line.reason,
                        "to_statement": following.pk,
                    }
                )
            StatementLine.objects.filter(statement=statement, usage_record_id__in=carry).update(
                statement=following, carried_from=statement
            )
        for record in UsageRecord.objects.filter(pk__in=[pk for pk in states if pk not in carry]).select_related(
            "pool"
        ):
            StatementLine.objects.filter(usage_record=record).update(**_line_values(record))
        statement.refresh_from_db()
        frozen = totals(statement)
        # WHERE state IN (…) and the new state from the declared transition Statement.finalize.
        fsm.move(
            Statement.objects.filter(pk=statement.pk),
            "finalize",
            totals=frozen,
            carried_out=carried_out,
            finalized_at=now,
            finalized_by=actor.name[:150],
            version=F("version") + 1,
        )
        record_event(
            None,
            event_types.STATEMENT,
            actor,
            from_state=StatementState.OPEN,
            to_state=StatementState.FINAL,
            reason=f"statement final: {frozen or 'nothing payable'}; {len(carried_out)} line(s) carried over",
            subject_type="statement",
            subject_id=statement.pk,
            data={"owner": statement.owner_id, "totals": frozen, "carried_out": carried_out},
        )
        # Payout holds (outliers, lines flagged for review) are decided on the frozen totals.
        evaluate_holds(Statement.objects.get(pk=statement.pk), now=now)
    return Statement.objects.get(pk=statement.pk)


# --- export -------------------------------------------------------------------------------------
EXPORT_COLUMNS = [
    "line",
    "kind",
    "usage_record",
    "lease_id",
    "workload_id",
    "node",
    "pool",
    "state",
    "started_at",
    "ended_at",
    "allocated_seconds",
    "billable_seconds",
    "coverage",
    "quantities",
    "amount",
    "currency",
    "reason",
    "carried_from",
    "corrects",
]


def export_rows(statement: Statement) -> list[dict]:
    lines = statement.lines.select_related("usage_record").order_by("usage_record__ended_at", "id")
    rows = []
    for line in lines:
        record = line.usage_record
        rows.append(
            {
                "line": line.pk,
                "kind": line.kind,
                "usage_record": line.usage_record_id,
                "lease_id": str(record.lease_id) if record else "",
                "workload_id": record.workload_id if record else "",
                "node": line.node_id_text,
                "pool": line.pool_name,
                "state": line.state,
                "started_at": record.started_at.isoformat() if record else "",
                "ended_at": record.ended_at.isoformat() if record else "",
                "allocated_seconds": str(line.allocated_seconds),
                "billable_seconds": str(line.billable_seconds),
                "coverage": str(line.coverage),
                "quantities": line.quantities,
                "amount": str(line.amount),
                "currency": line.currency,
                "reason": line.reason,
                "carried_from": line.carried_from_id,
                "corrects": line.corrects_id,
            }
        )
    return rows


def export_json(statement: Statement) -> dict:
    """The statement as a JSON document (amounts as decimal strings, never floats)."""
    return {
        "id": statement.pk,
        "owner": statement.owner.get_username(),
        "period": statement.period,
        "period_start": statement.period_start.isoformat(),
        "period_end": statement.period_end.isoformat(),
        "state": statement.state,
        "finalized_at": statement.finalized_at.isoformat() if statement.finalized_at else None,
        "totals": totals(statement),
        "lines": export_rows(statement),
        "carried_out": statement.carried_out,
    }


def export_csv(statement: Statement) -> str:
    """One row per line, ``quantities`` as ``resource=hours`` pairs; totals follow as ``total`` rows."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=EXPORT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in export_rows(statement):
        row["quantities"] = " ".join(f"{k}={v}" for k, v in sorted(row["quantities"].items()))
        writer.writerow(row)
    for currency, amount in totals(statement).items():
        writer.writerow({"usage_record": "total", "amount": amount, "currency": currency, "state": statement.state})
    return out.getvalue()
