"""Appeals of statement lines (docs/marketplace.md, "Payouts"): filed by the owner on a line of a
final statement before it is paid; resolving it ``corrected`` adds a correction line (positive or
negative) to the owner's next open statement; the original line is never edited. A payout made
while the appeal was open left the line out (marketplace.payouts); what it held back is booked when
the appeal closes."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

from django.db import IntegrityError, transaction
from django.utils import timezone
from django_fsm import can_proceed

from fleet.events import Actor
from nodepool.api.errors import TRANSITION_NOT_ALLOWED
from nodepool.api.problems import Conflict, NotFound, Problem
from nodepool.api.versioning import check_version

from . import statements
from .choices import LineAppealState, PayoutState, StatementState
from .errors import (
    INVALID_DECIMAL,
    INVALID_OUTCOME,
    LINE_APPEAL_EXISTS,
    LINE_APPEAL_NOT_FOUND,
    LINE_NOT_FOUND,
    LINE_PAID,
    STATEMENT_NOT_FINAL,
)
from .models import LineAppeal, Payout, PoolSettlement, Statement, StatementLine
from .money_common import money_event, required_text


# --- line appeals ---------------------------------------------------------------------------------
def line_appeal_create(*, owner, line_id, message, actor: Actor, now=None) -> LineAppeal:
    """The owner appeals one line of their final statement before it is paid.

    Raises: NotFound 404 ``line_not_found`` (another owner's line: no leak); Conflict 409
    ``statement_not_final``, ``line_paid`` (its payout is approved, paid or reversed),
    ``line_appeal_exists``; Problem 400 ``invalid_field``.
    """
    text = required_text(message, "message")
    now = now or timezone.now()
    with transaction.atomic():
        line = StatementLine.objects.select_related("statement").filter(pk=line_id, statement__owner=owner).first()
        if line is None:
            raise NotFound("No such statement line.", LINE_NOT_FOUND)
        # The statement row: a payout request holds it while it computes the amount.
        Statement.objects.select_for_update().filter(pk=line.statement_id).first()
        if line.statement.state != StatementState.FINAL:
            raise Conflict(
                "Only a line of a final statement is appealed; an open one may still change.", STATEMENT_NOT_FINAL
            )
        paying = Payout.objects.filter(
            statement_id=line.statement_id,
            currency=line.currency,
            state__in=[PayoutState.APPROVED, PayoutState.PAID, PayoutState.REVERSED],
        ).first()
        if paying is not None:
            raise Conflict(f"The line's payout is {paying.state}; it can no longer be appealed.", LINE_PAID)
        if LineAppeal.objects.filter(line=line).exclude(state=LineAppealState.WITHDRAWN).exists():
            raise Conflict("This line has been appealed already.", LINE_APPEAL_EXISTS)
        try:
            with transaction.atomic():
                appeal = LineAppeal.objects.create(line=line, owner=owner, message=text, created_at=now)
        except IntegrityError as exc:
            raise Conflict("This line has been appealed already.", LINE_APPEAL_EXISTS) from exc
        _appeal_event(appeal, actor, "", text)
    return appeal


def _appeal_event(appeal: LineAppeal, actor: Actor, from_state: str, reason: str) -> None:
    money_event(actor, "line_appeal", appeal.pk, from_state=from_state, to_state=appeal.state, reason=reason,
           data={"line": appeal.line_id, "owner": appeal.owner_id,
                 "correction_line": appeal.correction_line_id})  # fmt: skip


def line_appeal_resolve(
    *, appeal_id, outcome: str, resolution, amount: Decimal | None, expected_version: int, actor: Actor, now=None
) -> LineAppeal:
    """An operator resolves an open line appeal: ``corrected`` (with ``amount``, positive or
    negative, booked as a correction line on the owner's next open statement) or ``rejected``.

    Raises: NotFound 404 ``line_appeal_not_found``; PreconditionFailed 412; Conflict 409
    ``transition_not_allowed``; Problem 400 ``invalid_outcome``, ``invalid_field``, ``invalid_decimal``.
    """
    if outcome not in (LineAppealState.CORRECTED, LineAppealState.REJECTED):
        raise Problem("outcome must be corrected or rejected.", INVALID_OUTCOME)
    text = required_text(resolution, "resolution")
    if outcome == LineAppealState.CORRECTED and (amount is None or amount == 0):
        raise Problem("amount: a non-zero decimal string for a correction.", INVALID_DECIMAL, field="amount")
    now = now or timezone.now()
    with transaction.atomic():
        # The appeal row alone: its version and its move are what two resolutions (or a resolution
        # and a withdrawal) race for. The line (never edited) and its final statement (never
        # written here; the correction goes to the owner's next open statement) are joined to be
        # read: FOR UPDATE on them, as a plain select_for_update() took on PostgreSQL, made a
        # payout request on that statement, and every insert naming the line or the statement
        # (FOR KEY SHARE), wait for the resolution.
        appeal = (
            LineAppeal.objects.select_for_update(of=("self",))
            .select_related("line__statement")
            .filter(pk=appeal_id)
            .first()
        )
        if appeal is None:
            raise NotFound("No such line appeal.", LINE_APPEAL_NOT_FOUND)
        check_version(appeal.version, expected_version)
        verb = appeal.correct if outcome == LineAppealState.CORRECTED else appeal.reject
        if not can_proceed(verb):
            raise Conflict(f"The appeal is {appeal.state} already.", TRANSITION_NOT_ALLOWED, state=appeal.state)
        verb()
        line = appeal.line
        # A payout made while the appeal was open held the line back: what it held back is due
        # now, with the correction (a rejected appeal releases it as it was).
        held_back = line.amount if _held_back_by_payout(line) else Decimal(0)
        if outcome == LineAppealState.CORRECTED:
            appeal.correction_amount = amount
        due = held_back + (amount if outcome == LineAppealState.CORRECTED else Decimal(0))
        if due or outcome == LineAppealState.CORRECTED:
            appeal.correction_line = statements.correction_line(
                owner_id=appeal.owner_id,
                after=max(now, line.statement.period_end),
                amount=due,
                currency=line.currency,
                reason=f"appeal {appeal.pk} of line {line.pk} ({appeal.state}): {text}"
                + (f"; {held_back} held back from the payout" if held_back else ""),
                corrects=line,
            )
        appeal.resolution, appeal.resolved_by, appeal.resolved_at = text, actor.user, now
        appeal.version += 1
        appeal.save(update_fields=["state", "resolution", "resolved_by", "resolved_at", "correction_amount",
                                   "correction_line", "version"])  # fmt: skip
        _appeal_event(appeal, actor, LineAppealState.OPEN, text)
    return appeal


def _held_back_by_payout(line: StatementLine) -> bool:
    """Whether a payout of the line's statement (approved or later) left this line out.

    Read under the payout's row lock, in the caller's transaction (a resolution or a withdrawal,
    which hold the appeal): an approval decides what it holds back under that lock
    (payouts.payable_amount leaves out the lines under open appeal), so either it approves first
    and this sees the line held back, or it waits and then sees the appeal closed. Unlocked, both
    read before either wrote and the line was paid by neither. Lock order: the appeal, then the
    payout; nothing that locks a payout goes on to lock an appeal.
    """
    payouts = Payout.objects.select_for_update().filter(statement_id=line.statement_id, currency=line.currency)
    return any(
        line.pk in (excluded or [])
        for state, excluded in payouts.values_list("state", "excluded_lines")
        if state in (PayoutState.APPROVED, PayoutState.PAID, PayoutState.REVERSED)
    )


def line_appeal_withdraw(*, appeal_id, owner, actor: Actor) -> LineAppeal:
    """The owner withdraws their open line appeal. Raises 404 ``line_appeal_not_found``, 409."""
    with transaction.atomic():
        appeal = LineAppeal.objects.select_for_update().filter(pk=appeal_id, owner=owner).first()
        if appeal is None:
            raise NotFound("No such line appeal.", LINE_APPEAL_NOT_FOUND)
        if not can_proceed(appeal.withdraw):
            raise Conflict(f"The appeal is {appeal.state} already.", TRANSITION_NOT_ALLOWED, state=appeal.state)
        appeal.withdraw()
        appeal.version += 1
        line = appeal.line
        if _held_back_by_payout(line):  # a payout left the line out while the appeal was open
            appeal.correction_line = statements.correction_line(
                owner_id=appeal.owner_id,
                after=max(timezone.now(), line.statement.period_end),
                amount=line.amount,
                currency=line.currency,
                reason=f"appeal {appeal.pk} of line {line.pk} withdrawn; {line.amount} held back from the payout",
                corrects=line,
            )
        appeal.save(update_fields=["state", "version", "correction_line"])
        _appeal_event(appeal, actor, LineAppealState.OPEN, "withdrawn by the owner")
    return appeal


def appeals_open_longer_than_allowed(now: datetime) -> int:
    """Open line appeals older than their pool's ``appeal_alert_after`` (default 7 days)."""
    count = 0
    for appeal in LineAppeal.objects.filter(state=LineAppealState.OPEN).select_related("line__usage_record"):
        pool_id = appeal.line.usage_record.pool_id if appeal.line.usage_record_id else None
        limit = (
            PoolSettlement.objects.filter(pool_id=pool_id).values_list("appeal_alert_after", flat=True).first()
            or 7 * 86400
        )
        if appeal.created_at < now - timedelta(seconds=limit):
            count += 1
    return count
