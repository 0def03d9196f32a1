"""Payouts of final statements (docs/marketplace.md, "Payouts"); payout holds live in
:mod:`marketplace.holds`, appeals of statement lines in :mod:`marketplace.line_appeals`, the
payouts' export and import in :mod:`marketplace.payout_files` (shared helpers:
:mod:`marketplace.money_common`).

nodepool records payments; it does not move money. Each service follows the house pattern:
``atomic()`` → lock the row (``SELECT … FOR UPDATE``) → check the expected version →
``can_proceed`` → transition (memory) → ``save(update_fields=…)`` → event (type ``statement``,
subject ``payout`` / ``payout_hold`` / ``line_appeal``: read by the owner and operators only).

* A payout is requested for one final statement and one currency, only when every pool period
  overlapping the statement, in the pools of its lines, is reconciled, and no payout hold is open.
  Its amount is the statement's total in that currency minus the lines under open appeal. One per
  (statement, currency): the statement row is locked while the request checks, and a unique
  constraint backs it. ``requested → approved`` (by another operator) ``→ paid`` (with the external
  reference) ``| failed`` (may be requested again); ``paid → reversed`` books a negative correction
  on the owner's next open statement.
* Holds are placed when a statement is finalized (:func:`marketplace.holds.evaluate_holds`) and
  released by an operator with a reason.
* A line appeal is filed by the owner on a line of a final statement before it is paid; resolving
  it ``corrected`` adds a correction line (positive or negative) to the owner's next open
  statement; the original line is never edited.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from django.db import IntegrityError, transaction
from django.utils import timezone
from django_fsm import can_proceed

from fleet.events import Actor
from nodepool.api.errors import TRANSITION_NOT_ALLOWED
from nodepool.api.problems import Conflict, Forbidden, NotFound, Problem
from nodepool.api.versioning import check_version

from . import statements, webhooks
from .choices import PAYABLE_STATES, LineAppealState, PoolPeriodState, StatementState
from .errors import (
    APPROVAL_BY_REQUESTER,
    INVALID_CURRENCY,
    NOTHING_TO_PAY,
    PAYOUT_EXISTS,
    PAYOUT_NOT_FOUND,
    PERIOD_NOT_RECONCILED,
    STATEMENT_NOT_FINAL,
    STATEMENT_NOT_FOUND,
)
from .holds import refuse_if_held, statement_pools
from .models import Payout, PoolPeriod, Statement, StatementLine
from .money_common import money_event, required_text
from .periods import pool_period_kind


# --- amounts --------------------------------------------------------------------------------------
def open_appeal_lines(statement: Statement) -> list[StatementLine]:
    return list(statement.lines.filter(appeals__state=LineAppealState.OPEN).distinct())


def payable_amount(statement: Statement, currency: str) -> tuple[Decimal, list[int]]:
    """``(total in currency − lines under open appeal, [those line ids])``."""
    total = Decimal(statements.totals(statement).get(currency, "0"))
    appealed = [line for line in open_appeal_lines(statement) if line.currency == currency]
    held_back = sum((line.amount for line in appealed if line.state in PAYABLE_STATES), Decimal(0))
    return total - held_back, [line.pk for line in appealed]


def unreconciled_periods(statement: Statement) -> list[dict]:
    """Every pool period overlapping the statement, in its lines' pools, that is not reconciled
    (missing ones included): ``[{"pool", "period_start", "state"}]``."""
    missing = []
    for pool_id in statement_pools(statement):
        kind = pool_period_kind(pool_id)
        at = statement.period_start
        while at < statement.period_end:
            start, end = statements.period_bounds(kind, at)
            state = (
                PoolPeriod.objects.filter(pool_id=pool_id, period_start=start).values_list("state", flat=True).first()
            )
            if state != PoolPeriodState.RECONCILED:
                missing.append({"pool": pool_id, "period_start": start.isoformat(), "state": state or "missing"})
            at = end
    return missing


# --- payouts --------------------------------------------------------------------------------------
def payout_request(*, statement_id, currency, actor: Actor, now=None) -> Payout:
    """Request the payout of one final statement in one currency (an operator).

    Raises: NotFound 404 ``statement_not_found``; Conflict 409 ``statement_not_final``,
    ``period_not_reconciled`` (``periods`` lists them), ``statement_on_hold``,
    ``payout_exists`` (one per statement and currency), ``nothing_to_pay``; Problem 400
    ``invalid_currency``. A failed payout is requested again instead (same row).
    """
    if not isinstance(currency, str) or len(currency) != 3 or not currency.isalpha() or not currency.isupper():
        raise Problem("currency: an ISO 4217 code such as EUR.", INVALID_CURRENCY, field="currency")
    now = now or timezone.now()
    with transaction.atomic():
        # The guard against two requests at once: the statement row is locked while this checks
        # and writes, so the second waits and then finds the payout (the unique constraint backs it).
        statement = Statement.objects.select_for_update().filter(pk=statement_id).first()
        if statement is None:
            raise NotFound("No such statement.", STATEMENT_NOT_FOUND)
        if statement.state != StatementState.FINAL:
            raise Conflict("Only a final statement is paid.", STATEMENT_NOT_FINAL)
        missing = unreconciled_periods(statement)
        if missing:
            raise Conflict(
                f"{len(missing)} pool period(s) overlapping the statement are not reconciled.",
                PERIOD_NOT_RECONCILED,
                periods=missing,
            )
        refuse_if_held(statement.pk)
        if currency not in statement.totals:
            raise Problem(f"The statement has no total in {currency}.", INVALID_CURRENCY, field="currency")
        amount, excluded = payable_amount(statement, currency)
        existing = Payout.objects.select_for_update().filter(statement=statement, currency=currency).first()
        if existing is not None:
            if not can_proceed(existing.request_again):
                raise Conflict(
                    f"A payout of this statement in {currency} exists ({existing.state}).", PAYOUT_EXISTS,
                    payout=str(existing.uid),
                )  # fmt: skip
            from_state = existing.state
            existing.request_again()
            existing.amount, existing.excluded_lines = amount, excluded
            existing.requested_by, existing.requested_at, existing.version = actor.user, now, existing.version + 1
            existing.approved_by = existing.approved_at = None
            existing.save(update_fields=["state", "amount", "excluded_lines", "requested_by", "requested_at",
                                         "approved_by", "approved_at", "version", "updated_at"])  # fmt: skip
            _payout_event(existing, actor, from_state, "requested again", now)
            return existing
        if amount <= 0:
            raise Conflict(f"Nothing to pay in {currency} ({amount}).", NOTHING_TO_PAY)
        try:
            with transaction.atomic():
                payout = Payout.objects.create(
                    statement=statement,
                    owner_id=statement.owner_id,
                    currency=currency,
                    amount=amount,
                    excluded_lines=excluded,
                    requested_by=actor.user,
                    requested_at=now,
                )
        except IntegrityError as exc:
            raise Conflict(f"A payout of this statement in {currency} exists.", PAYOUT_EXISTS) from exc
        _payout_event(payout, actor, "", f"requested: {amount} {currency}", now)
    return payout


def _payout_event(payout: Payout, actor: Actor, from_state: str, reason: str, now: datetime) -> None:
    """The transition's event (owner-visible: ``data.owner``) and, when configured, its signed
    webhook notice (marketplace.webhooks: written now, sent after commit, never awaited)."""
    money_event(
        actor,
        "payout",
        payout.pk,
        from_state=from_state,
        to_state=payout.state,
        reason=reason,
        data={
            "payout": str(payout.uid),
            "statement": payout.statement_id,
            "owner": payout.owner_id,
            "amount": str(payout.amount),
            "currency": payout.currency,
        },
    )
    webhooks.enqueue(payout, from_state, now)


def _transition(
    payout_id, verb: str, done: str, *, expected_version: int | None, actor: Actor, now, fields, reason, check=None
) -> Payout:
    """The one shape of every payout transition after the request: lock the row, check the
    version (None: the import, which is idempotent on the payout's uid instead), run
    ``check(payout)``, ``can_proceed`` (409 ``transition_not_allowed``), move, set
    ``fields(payout)`` (a dict), save, event and webhook. ``reason``: text, or ``reason(payout)``."""
    payout = Payout.objects.select_for_update().filter(pk=payout_id).first()
    if payout is None:
        raise NotFound("No such payout.", PAYOUT_NOT_FOUND)
    if expected_version is not None:
        check_version(payout.version, expected_version)
    if check is not None:
        check(payout)
    method = getattr(payout, verb)
    if not can_proceed(method):
        raise Conflict(f"A {payout.state} payout cannot be {done}.", TRANSITION_NOT_ALLOWED, state=payout.state)
    from_state = payout.state
    method()
    values = fields(payout)
    for name, value in values.items():
        setattr(payout, name, value)
    payout.version += 1
    payout.save(update_fields=["state", "version", "updated_at", *values])
    _payout_event(payout, actor, from_state, reason(payout) if callable(reason) else reason, now)
    return payout


def _not_by_requester(actor: Actor):
    def check(payout: Payout) -> None:
        if actor.user is None or actor.user.pk == payout.requested_by_id:
            raise Forbidden(
                "The payout must be approved by another operator than its requester.", APPROVAL_BY_REQUESTER
            )
        refuse_if_held(payout.statement_id)

    return check


def _not_held(payout: Payout) -> None:
    refuse_if_held(payout.statement_id)


def payout_approve(*, payout_id, expected_version: int, actor: Actor, now=None) -> Payout:
    """A second operator approves: ``requested → approved`` (the amount is computed again: an
    appeal filed meanwhile is held back). Raises 404, 412, 403 ``approval_by_requester``, 409
    ``transition_not_allowed`` / ``statement_on_hold``."""
    now = now or timezone.now()

    def fields(payout: Payout) -> dict:
        amount, excluded = payable_amount(payout.statement, payout.currency)
        return {"amount": amount, "excluded_lines": excluded, "approved_by": actor.user, "approved_at": now}

    with transaction.atomic():
        # The statement row first, as a payout request and a line appeal take it (statement, then
        # payout): an appeal being filed either commits before the amount is computed, and its line
        # is held back, or waits and then finds the payout approved (409 ``line_paid``). Without
        # it both read before either wrote and an appealed line was paid. A payout's statement
        # never changes, so it is read unlocked.
        statement_id = Payout.objects.filter(pk=payout_id).values_list("statement_id", flat=True).first()
        if statement_id is not None:
            Statement.objects.select_for_update().filter(pk=statement_id).first()
        return _transition(
            payout_id,
            "approve",
            "approved",
            expected_version=expected_version,
            actor=actor,
            now=now,
            fields=fields,
            reason=lambda p: f"approved: {p.amount} {p.currency}",
            check=_not_by_requester(actor),
        )


def payout_mark_paid(*, payout_id, external_reference, expected_version: int | None, actor: Actor, now=None) -> Payout:
    """``approved → paid`` with the external payment reference. Raises 404, 412, 400 ``invalid_field``,
    409 ``transition_not_allowed`` / ``statement_on_hold``."""
    reference = required_text(external_reference, "external_reference")[:200]
    now = now or timezone.now()
    with transaction.atomic():
        return _transition(
            payout_id,
            "pay",
            "paid",
            expected_version=expected_version,
            actor=actor,
            now=now,
            fields=lambda p: {"external_reference": reference, "paid_at": now},
            reason=f"paid: {reference}",
            check=_not_held,
        )


def payout_mark_failed(*, payout_id, reason, expected_version: int | None, actor: Actor, now=None) -> Payout:
    """``approved → failed`` (it may be requested again). Raises 404, 412, 400, 409."""
    text = required_text(reason, "reason")
    now = now or timezone.now()
    with transaction.atomic():
        return _transition(
            payout_id,
            "fail",
            "marked failed",
            expected_version=expected_version,
            actor=actor,
            now=now,
            fields=lambda p: {"failure_reason": text, "failed_at": now},
            reason=f"failed: {text}",
        )


def payout_reverse(*, payout_id, reason, expected_version: int, actor: Actor, now=None) -> Payout:
    """``paid → reversed`` (a chargeback): a negative correction line of the payout's amount on the
    owner's next open statement. Raises 404, 412, 400, 409."""
    text = required_text(reason, "reason")
    now = now or timezone.now()
    with transaction.atomic():
        payout = _transition(
            payout_id,
            "reverse",
            "reversed",
            expected_version=expected_version,
            actor=actor,
            now=now,
            fields=lambda p: {"reversal_reason": text, "reversed_at": now},
            reason=f"reversed: {text}",
        )
        statements.correction_line(
            owner_id=payout.owner_id,
            after=max(now, payout.statement.period_end),
            amount=-payout.amount,
            currency=payout.currency,
            reason=f"payout {payout.uid} reversed: {text}",
            reverses=payout,
        )
    return payout
