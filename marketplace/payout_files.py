"""Payouts in files (docs/marketplace.md, "Payouts"): the export columns, and the import of the
payment system's results (``paid`` with its external reference, or ``failed`` with a reason), all
rows checked before any is stored."""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from django.db import transaction
from django.utils import timezone

from fleet.events import Actor
from nodepool.api.errors import TRANSITION_NOT_ALLOWED
from nodepool.api.problems import Conflict, Problem

from . import payouts
from .choices import PayoutState
from .errors import PAYOUT_IMPORT_CONFLICT, PAYOUT_IMPORT_INVALID, PAYOUT_NOT_FOUND, STATEMENT_ON_HOLD
from .models import Payout, PayoutHold
from .money_common import MAX_TEXT

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
                payouts.payout_mark_paid(payout_id=payout.pk, external_reference=row.external_reference,
                                 expected_version=None, actor=actor, now=now)  # fmt: skip
            elif outcome == PayoutState.FAILED:
                payouts.payout_mark_failed(payout_id=payout.pk, reason=row.failure_reason, expected_version=None,
                                   actor=actor, now=now)  # fmt: skip
            results.append({"row": row.index, "id": str(row.uid), "outcome": outcome})
    return results
