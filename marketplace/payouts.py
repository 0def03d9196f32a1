"""Payouts, payout holds and appeals of statement lines (docs/marketplace.md, "Payouts").

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
* Holds are placed when a statement is finalized (:func:`evaluate_holds`) and released by an
  operator with a reason.
* A line appeal is filed by the owner on a line of a final statement before it is paid; resolving
  it ``corrected`` adds a correction line (positive or negative) to the owner's next open
  statement; the original line is never edited.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation
from statistics import median

from django.db import IntegrityError, transaction
from django.db.models import Sum
from django.utils import timezone
from django_fsm import can_proceed

from fleet.events import Actor, record_event
from fleet.models import Pool
from nodepool.api.errors import TRANSITION_NOT_ALLOWED
from nodepool.api.problems import Conflict, Forbidden, NotFound, Problem
from nodepool.api.versioning import check_version

from . import event_types, statements, webhooks
from .choices import (
    PAYABLE_STATES,
    HoldReason,
    LineAppealState,
    LineKind,
    PayoutState,
    PoolPeriodState,
    StatementState,
    UsageState,
)
from .errors import (
    APPROVAL_BY_REQUESTER,
    HOLD_RELEASED,
    INVALID_CURRENCY,
    INVALID_DECIMAL,
    INVALID_FIELD,
    INVALID_OUTCOME,
    LINE_APPEAL_EXISTS,
    LINE_APPEAL_NOT_FOUND,
    LINE_NOT_FOUND,
    LINE_PAID,
    NOTHING_TO_PAY,
    PAYOUT_EXISTS,
    PAYOUT_HOLD_NOT_FOUND,
    PAYOUT_IMPORT_CONFLICT,
    PAYOUT_IMPORT_INVALID,
    PAYOUT_NOT_FOUND,
    PERIOD_NOT_RECONCILED,
    STATEMENT_NOT_FINAL,
    STATEMENT_NOT_FOUND,
    STATEMENT_ON_HOLD,
)
from .models import LineAppeal, Payout, PayoutHold, PoolPeriod, PoolSettlement, Statement, StatementLine
from .periods import pool_period_kind

MAX_TEXT = 4000
DEFAULT_HOLD_MULTIPLE = Decimal(10)
# Findings of a usage record that flag its line for review: a device fault during the lease (the
# devices issue), usage after the node failed a re-verification (fleet.reverification), and a
# record that was disputed (an operator settled it).
REVIEW_FINDINGS = frozenset({"device_fault", "node_deverified", "impossible_usage", "absent_usage"})


def _text(value, name: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_TEXT:
        raise Problem(
            f"{name}: required, a non-empty string of at most {MAX_TEXT} characters.", INVALID_FIELD, field=name
        )
    return value.strip()


def _event(actor: Actor, subject_type: str, subject_id, *, from_state: str, to_state: str, reason: str, data: dict):
    record_event(
        None,
        event_types.STATEMENT,
        actor,
        from_state=from_state,
        to_state=to_state,
        reason=reason[:2000],
        subject_type=subject_type,
        subject_id=subject_id,
        data=data,
    )


# --- amounts --------------------------------------------------------------------------------------
def open_appeal_lines(statement: Statement) -> list[StatementLine]:
    return list(statement.lines.filter(appeals__state=LineAppealState.OPEN).distinct())


def payable_amount(statement: Statement, currency: str) -> tuple[Decimal, list[int]]:
    """``(total in currency − lines under open appeal, [those line ids])``."""
    total = Decimal(statements.totals(statement).get(currency, "0"))
    appealed = [line for line in open_appeal_lines(statement) if line.currency == currency]
    held_back = sum((line.amount for line in appealed if line.state in PAYABLE_STATES), Decimal(0))
    return total - held_back, [line.pk for line in appealed]


def statement_pools(statement: Statement) -> list[int]:
    """The pools of the statement's lines (usage records' pools, idle lines' periods, names otherwise)."""
    pools = set(statement.lines.exclude(usage_record=None).values_list("usage_record__pool_id", flat=True))
    pools |= set(statement.lines.exclude(pool_period=None).values_list("pool_period__pool_id", flat=True))
    names = set(statement.lines.filter(usage_record=None, pool_period=None).values_list("pool_name", flat=True))
    pools |= set(Pool.objects.filter(name__in=names - {""}).values_list("pk", flat=True))
    return sorted(pools)


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


# --- holds ----------------------------------------------------------------------------------------
def _hold_multiple(pool_ids) -> Decimal:
    multiples = list(PoolSettlement.objects.filter(pool_id__in=pool_ids).values_list("hold_multiple", flat=True))
    return min(multiples) if multiples else DEFAULT_HOLD_MULTIPLE


def comparable_amount(statement: Statement, currency: str) -> tuple[Decimal | None, str]:
    """What an outlier is measured against (docs/marketplace.md, "Payout holds"):

    the owner's previous final statement of the same period kind, when it paid something in this
    currency; otherwise the median per-node amount of the statement's pools over the same period
    (usage lines of every owner whose lease ended in it) times the owner's node count. ``None``
    when neither exists (nothing to compare: no outlier hold).
    """
    previous = (
        Statement.objects.filter(
            owner_id=statement.owner_id,
            period=statement.period,
            state=StatementState.FINAL,
            period_end__lte=statement.period_start,
        )
        .order_by("-period_start")
        .first()
    )
    if previous is not None and Decimal(previous.totals.get(currency, "0")) > 0:
        return Decimal(previous.totals[currency]), f"previous statement {previous.pk}"
    pools = statement_pools(statement)
    per_node = (
        StatementLine.objects.filter(
            kind=LineKind.USAGE,
            currency=currency,
            state__in=PAYABLE_STATES,
            usage_record__pool_id__in=pools,
            usage_record__ended_at__gte=statement.period_start,
            usage_record__ended_at__lt=statement.period_end,
        )
        .values("usage_record__node_id")
        .annotate(total=Sum("amount"))
        .values_list("total", flat=True)
    )
    amounts = list(per_node)
    nodes = statement.lines.filter(kind=LineKind.USAGE).values("usage_record__node_id").distinct().count()
    if not amounts or median(amounts) <= 0:
        return None, "no comparable period and no usage in the pools"
    return median(amounts) * max(nodes, 1), f"pool median per node × {max(nodes, 1)} node(s)"


def evaluate_holds(statement: Statement, *, now: datetime) -> list[PayoutHold]:
    """Place the holds a just-final statement deserves (idempotent: one per reason)."""
    placed = []
    multiple = _hold_multiple(statement_pools(statement))
    for currency, total in statement.totals.items():
        basis, source = comparable_amount(statement, currency)
        if basis is not None and Decimal(total) > multiple * basis:
            placed.append(
                _hold(
                    statement,
                    HoldReason.OUTLIER,
                    f"{total} {currency} is more than {multiple}× the comparable {basis} ({source})",
                    {"currency": currency, "total": total, "comparable": str(basis), "multiple": str(multiple)},
                    now,
                )
            )
    flagged = []
    for line in statement.lines.exclude(usage_record=None).select_related("usage_record"):
        codes = {f.get("code") for f in line.usage_record.findings or []} & REVIEW_FINDINGS
        if codes:
            flagged.append({"line": line.pk, "findings": sorted(codes)})
    if flagged:
        placed.append(
            _hold(
                statement,
                HoldReason.FLAGGED_LINE,
                f"{len(flagged)} line(s) flagged for review",
                {"lines": flagged},
                now,
            )
        )
    return [hold for hold in placed if hold is not None]


def _hold(statement, reason, message, detail, now) -> PayoutHold | None:
    hold, created = PayoutHold.objects.get_or_create(
        statement=statement, reason=reason, defaults={"message": message, "detail": detail, "created_at": now}
    )
    if created:
        _event(
            Actor.system("marketplace.holds"),
            "payout_hold",
            hold.pk,
            from_state="",
            to_state="held",
            reason=message,
            data={"statement": statement.pk, "owner": statement.owner_id, "reason": reason},
        )
    return hold if created else None


def hold_release(*, hold_id, reason, expected_version: int, actor: Actor, now=None) -> PayoutHold:
    """An operator releases a payout hold with a reason.

    Raises: NotFound 404 ``payout_hold_not_found``; PreconditionFailed 412; Conflict 409
    ``hold_released``; Problem 400 ``invalid_field``.
    """
    text = _text(reason, "reason")
    now = now or timezone.now()
    with transaction.atomic():
        hold = PayoutHold.objects.select_for_update().filter(pk=hold_id).first()
        if hold is None:
            raise NotFound("No such payout hold.", PAYOUT_HOLD_NOT_FOUND)
        check_version(hold.version, expected_version)
        if hold.released_at is not None:
            raise Conflict("The hold is released already.", HOLD_RELEASED)
        hold.released_at, hold.released_by, hold.release_reason = now, actor.user, text
        hold.version += 1
        hold.save(update_fields=["released_at", "released_by", "release_reason", "version"])
        data = {"statement": hold.statement_id, "owner": hold.statement.owner_id, "reason": hold.reason}
        _event(actor, "payout_hold", hold.pk, from_state="held", to_state="released", reason=text, data=data)
    return hold


def _refuse_if_held(statement_id) -> None:
    open_holds = list(
        PayoutHold.objects.filter(statement_id=statement_id, released_at=None).values_list("reason", flat=True)
    )
    if open_holds:
        raise Conflict(
            "The statement has a payout hold; an operator must release it first.",
            STATEMENT_ON_HOLD,
            holds=open_holds,
        )


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
        _refuse_if_held(statement.pk)
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
    _event(
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
        _refuse_if_held(payout.statement_id)

    return check


def _not_held(payout: Payout) -> None:
    _refuse_if_held(payout.statement_id)


def payout_approve(*, payout_id, expected_version: int, actor: Actor, now=None) -> Payout:
    """A second operator approves: ``requested → approved`` (the amount is computed again: an
    appeal filed meanwhile is held back). Raises 404, 412, 403 ``approval_by_requester``, 409
    ``transition_not_allowed`` / ``statement_on_hold``."""
    now = now or timezone.now()

    def fields(payout: Payout) -> dict:
        amount, excluded = payable_amount(payout.statement, payout.currency)
        return {"amount": amount, "excluded_lines": excluded, "approved_by": actor.user, "approved_at": now}

    with transaction.atomic():
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
    reference = _text(external_reference, "external_reference")[:200]
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
    text = _text(reason, "reason")
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
    text = _text(reason, "reason")
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
        _correction_line(
            owner_id=payout.owner_id,
            after=max(now, payout.statement.period_end),
            amount=-payout.amount,
            currency=payout.currency,
            reason=f"payout {payout.uid} reversed: {text}",
            reverses=payout,
        )
    return payout


# --- export and import ------------------------------------------------------------------------------
EXPORT_COLUMNS = [
    "id", "statement", "owner", "currency", "amount", "state", "requested_at", "approved_at", "paid_at",
    "external_reference", "failure_reason",
]  # fmt: skip
IMPORT_STATES = (PayoutState.PAID, PayoutState.FAILED)
MAX_IMPORT_ROWS = 1000


@dataclass(frozen=True)
class ImportRow:
    """One row of a payout import: the export's row as the payment system left it."""

    index: int  # 1-based, as the operator counts rows of the file (the header not counted)
    uid: uuid.UUID
    state: str
    amount: Decimal | None
    currency: str
    external_reference: str
    failure_reason: str


def parse_import(records) -> list[ImportRow]:
    """Check the rows of an import (the objects of ``export.json``'s ``payouts``, or the rows of
    ``export.csv`` as dicts of strings, an empty string meaning absent).

    Each row: ``id`` (the payout's uid, required), ``state`` (required: one of the payout states),
    ``external_reference`` (required when ``paid``), ``failure_reason`` (required when ``failed``),
    ``amount`` and ``currency`` (optional; when given they must be the payout's: a decimal string,
    never a JSON number); the export's other columns are allowed and ignored, any other member
    is refused. Raises Problem 400 ``payout_import_invalid`` listing every bad row
    (``errors: [{"row", "field", "code", "message"}]``, ``code`` always ``invalid``: the problem
    schema's field error with the row it is in)."""
    if not isinstance(records, list) or not records or len(records) > MAX_IMPORT_ROWS:
        raise Problem(
            f"payouts: a list of 1 to {MAX_IMPORT_ROWS} rows of the payouts export.", PAYOUT_IMPORT_INVALID,
            errors=[{"row": 0, "field": "payouts", "code": "invalid", "message": "not a list of 1 to 1000 rows"}],
        )  # fmt: skip
    errors, rows, seen = [], [], set()
    for index, record in enumerate(records, start=1):
        problems = []

        def bad(field, message, problems=problems, index=index):
            problems.append({"row": index, "field": field, "code": "invalid", "message": message})

        if not isinstance(record, dict):
            bad("", "a row is an object of the export's columns")
            errors.extend(problems)
            continue
        values = {key: (None if value == "" else value) for key, value in record.items()}
        for key in sorted(set(values) - set(EXPORT_COLUMNS)):
            bad(str(key)[:40], "not a column of the payouts export")
        uid = None
        with contextlib.suppress(ValueError):
            uid = uuid.UUID(values.get("id")) if isinstance(values.get("id"), str) else None
        if uid is None:
            bad("id", "the payout's id from the export (a UUID)")
        elif uid in seen:
            bad("id", "this payout is in the import twice")
        seen.add(uid)
        state = values.get("state")
        if state not in PayoutState.values:
            bad("state", f"one of {', '.join(PayoutState.values)}")
        texts = {}
        for name in ("external_reference", "failure_reason", "currency"):
            value = values.get(name)
            if value is not None and (
                not isinstance(value, str) or len(value) > (200 if name != "failure_reason" else MAX_TEXT)
            ):
                bad(name, "a string" + (" of at most 200 characters" if name != "failure_reason" else ""))
            texts[name] = value.strip() if isinstance(value, str) else ""
        if state == PayoutState.PAID and not texts["external_reference"]:
            bad("external_reference", "a paid payout needs the payment system's reference")
        if state == PayoutState.FAILED and not texts["failure_reason"]:
            bad("failure_reason", "a failed payout needs a reason")
        amount = values.get("amount")
        if amount is not None:
            try:
                amount = Decimal(amount) if isinstance(amount, str) and len(amount) <= 40 else None
            except InvalidOperation:
                amount = None
            if amount is None or not amount.is_finite():
                bad("amount", 'a finite decimal string such as "4.84" (not a JSON number)')
        if not problems:
            rows.append(ImportRow(index, uid, state, amount, texts["currency"], texts["external_reference"],
                                  texts["failure_reason"]))  # fmt: skip
        errors.extend(problems)
    if errors:
        raise Problem(f"{len(errors)} problem(s) in the import; nothing was stored.", PAYOUT_IMPORT_INVALID,
                      errors=errors[:100])  # fmt: skip
    return rows


def payout_import(rows: list[ImportRow], *, actor: Actor, now=None) -> list[dict]:
    """Record what the payment system did with exported payouts: a row ``paid`` (with its
    external reference) moves an approved payout to paid, a row ``failed`` (with a reason) moves
    it to failed; a row in the payout's current state (and, for paid, the same reference) changes
    nothing, so importing the same file twice is idempotent. All or nothing: the payouts are
    locked (in id order), every row is checked, and one refused row refuses the import.

    Returns ``[{"row", "id", "outcome": "paid" | "failed" | "unchanged"}]``. Raises Conflict 409
    ``payout_import_conflict`` with ``rows: [{"row", "id", "code", "message"}]``, codes
    ``payout_not_found``, ``amount_differs``, ``currency_differs``, ``reference_differs``,
    ``transition_not_allowed`` (only paid and failed are imported; a reversal takes a reason
    through the API) and ``statement_on_hold``.
    """
    now = now or timezone.now()
    with transaction.atomic():
        found = {
            p.uid: p for p in Payout.objects.select_for_update().filter(uid__in=[r.uid for r in rows]).order_by("pk")
        }
        held = set(
            PayoutHold.objects.filter(
                statement_id__in=[p.statement_id for p in found.values()], released_at=None
            ).values_list("statement_id", flat=True)
        )
        conflicts, plan = [], []
        for row in rows:
            payout = found.get(row.uid)

            def refuse(code, message, row=row):
                conflicts.append({"row": row.index, "id": str(row.uid), "code": code, "message": message})

            if payout is None:
                refuse(str(PAYOUT_NOT_FOUND), "no payout has this id")
                continue
            if row.amount is not None and row.amount != payout.amount:
                refuse("amount_differs", f"the payout's amount is {payout.amount}, the row says {row.amount}")
            if row.currency and row.currency != payout.currency:
                refuse("currency_differs", f"the payout's currency is {payout.currency}, the row says {row.currency}")
            if row.state == payout.state:
                if row.state == PayoutState.PAID and row.external_reference != payout.external_reference:
                    refuse("reference_differs", "the payout was recorded paid with another reference")
                else:
                    plan.append((row, payout, "unchanged"))
            elif row.state in IMPORT_STATES and payout.state == PayoutState.APPROVED:
                if row.state == PayoutState.PAID and payout.statement_id in held:
                    refuse(STATEMENT_ON_HOLD, "the statement has a payout hold")
                plan.append((row, payout, row.state))
            else:
                refuse(TRANSITION_NOT_ALLOWED, f"a {payout.state} payout cannot become {row.state} by import")
        if conflicts:
            raise Conflict(f"{len(conflicts)} row(s) refused; nothing was stored.", PAYOUT_IMPORT_CONFLICT,
                           rows=conflicts[:100])  # fmt: skip
        results = []
        for row, payout, outcome in plan:
            if outcome == PayoutState.PAID:
                payout_mark_paid(payout_id=payout.pk, external_reference=row.external_reference,
                                 expected_version=None, actor=actor, now=now)  # fmt: skip
            elif outcome == PayoutState.FAILED:
                payout_mark_failed(payout_id=payout.pk, reason=row.failure_reason, expected_version=None,
                                   actor=actor, now=now)  # fmt: skip
            results.append({"row": row.index, "id": str(row.uid), "outcome": outcome})
    return results


def _correction_line(
    *, owner_id, after: datetime, amount: Decimal, currency: str, reason: str, **refs
) -> StatementLine:
    statement = statements.statement_for(owner_id, after)
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


# --- line appeals ---------------------------------------------------------------------------------
def line_appeal_create(*, owner, line_id, message, actor: Actor, now=None) -> LineAppeal:
    """The owner appeals one line of their final statement before it is paid.

    Raises: NotFound 404 ``line_not_found`` (another owner's line: no leak); Conflict 409
    ``statement_not_final``, ``line_paid`` (its payout is approved, paid or reversed),
    ``line_appeal_exists``; Problem 400 ``invalid_field``.
    """
    text = _text(message, "message")
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
    _event(actor, "line_appeal", appeal.pk, from_state=from_state, to_state=appeal.state, reason=reason,
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
    text = _text(resolution, "resolution")
    if outcome == LineAppealState.CORRECTED and (amount is None or amount == 0):
        raise Problem("amount: a non-zero decimal string for a correction.", INVALID_DECIMAL, field="amount")
    now = now or timezone.now()
    with transaction.atomic():
        appeal = LineAppeal.objects.select_for_update().select_related("line__statement").filter(pk=appeal_id).first()
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
            appeal.correction_line = _correction_line(
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
    """Whether a payout of the line's statement (approved or later) left this line out."""
    excluded = Payout.objects.filter(
        statement_id=line.statement_id,
        currency=line.currency,
        state__in=[PayoutState.APPROVED, PayoutState.PAID, PayoutState.REVERSED],
    ).values_list("excluded_lines", flat=True)
    return any(line.pk in (ids or []) for ids in excluded)


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
            appeal.correction_line = _correction_line(
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
