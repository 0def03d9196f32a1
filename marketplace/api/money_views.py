"""Marketplace money API: pool periods and mismatch items, payouts (and their export), payout holds
and appeals of statement lines (docs/marketplace.md, "Pool periods", "Payouts").

Owners read their own payouts, holds and line appeals (another owner's answer 404) and file and
withdraw line appeals; operators read everything and take the other actions, each with the
version they read (If-Match). Views validate, call one service, and shape the response.
"""

from __future__ import annotations

import csv
import io
import json
from decimal import Decimal, InvalidOperation

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet.events import Actor
from nodepool.api.errors import INVALID_FILTER
from nodepool.api.permissions import is_operator
from nodepool.api.problems import NotFound, Problem
from nodepool.api.versioning import ETagMixin, expected_version

from .. import holds, line_appeals, payout_files, payouts, periods
from ..choices import LineAppealState, PayoutState, PoolPeriodState
from ..errors import (
    INVALID_DECIMAL,
    INVALID_FIELD,
    PAYOUT_IMPORT_INVALID,
    PAYOUT_NOT_FOUND,
    POOL_PERIOD_NOT_FOUND,
    UNKNOWN_EXPORT_FORMAT,
)
from ..models import LineAppeal, MismatchItem, Payout, PayoutHold, PoolPeriod
from .common import IsOperator, IsOperatorOrOwner, read_body, read_text

MAX_ROWS = 500


def _money(data: dict, name: str) -> Decimal | None:
    """A signed amount in cents as a decimal string (``"-12.50"``): never a JSON number."""
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 40:
        raise Problem(f'{name}: a decimal string such as "-12.50" (not a JSON number).', INVALID_DECIMAL, field=name)
    try:
        number = Decimal(value)
    except InvalidOperation as exc:
        raise Problem(f"{name}: {value[:40]!r} is not a decimal number.", INVALID_DECIMAL, field=name) from exc
    if not number.is_finite() or number != number.quantize(Decimal("0.01")) or abs(number) >= Decimal(10) ** 15:
        raise Problem(f"{name}: a finite amount with at most two decimals.", INVALID_DECIMAL, field=name)
    return number


def _choice(request, name: str, choices) -> str | None:
    value = request.query_params.get(name)
    if value is not None and value not in choices:
        raise Problem(f"{name}: one of {', '.join(choices)}.", INVALID_FILTER, field=name)
    return value


# --- shapes ---------------------------------------------------------------------------------------
def period_dict(period: PoolPeriod, user) -> dict:
    operator = is_operator(user)
    mine = str(user.pk)

    def visible(values: dict) -> dict:
        return values if operator else {k: v for k, v in values.items() if k == mine}

    money = dict(period.money or {})
    if not operator and money:
        money = {"currency": money.get("currency"), "usage": visible(money.get("usage", {})),
                 "idle": visible(money.get("idle", {}))}  # fmt: skip
    body = {
        "id": period.pk,
        "pool": period.pool.name,
        "period": period.period,
        "period_start": period.period_start.isoformat(),
        "period_end": period.period_end.isoformat(),
        "state": period.state,
        "usage": visible(period.usage),
        "idle": visible(period.idle),
        "money": money,
        "idle_paid": period.idle_paid,
        "waiting_for": period.waiting_for,
        "reconciled_at": period.reconciled_at.isoformat() if period.reconciled_at else None,
        "version": period.version,
    }
    if operator:
        body.update(
            offered=period.offered,
            unallocated=period.unallocated,
            mismatch_items=[item_dict(i) for i in period.mismatch_items.all()],
        )
    return body


def item_dict(item: MismatchItem) -> dict:
    return {
        "id": item.pk,
        "period": item.period_id,
        "kind": item.kind,
        "key": item.key,
        "node": str(item.node_id) if item.node_id else None,
        "usage_record": item.usage_record_id,
        "message": item.message,
        "detail": item.detail,
        "state": "resolved" if item.resolved_at else "open",
        "resolution": item.resolution,
        "resolved_at": item.resolved_at.isoformat() if item.resolved_at else None,
        "version": item.version,
    }


def payout_dict(payout: Payout) -> dict:
    return {
        "id": str(payout.uid),
        "pk": payout.pk,
        "statement": payout.statement_id,
        "owner": payout.owner.get_username(),
        "currency": payout.currency,
        "amount": str(payout.amount),
        "excluded_lines": payout.excluded_lines,
        "state": payout.state,
        "requested_by": payout.requested_by.get_username(),
        "requested_at": payout.requested_at.isoformat(),
        "approved_by": payout.approved_by.get_username() if payout.approved_by_id else None,
        "approved_at": payout.approved_at.isoformat() if payout.approved_at else None,
        "paid_at": payout.paid_at.isoformat() if payout.paid_at else None,
        "external_reference": payout.external_reference,
        "failed_at": payout.failed_at.isoformat() if payout.failed_at else None,
        "failure_reason": payout.failure_reason,
        "reversed_at": payout.reversed_at.isoformat() if payout.reversed_at else None,
        "reversal_reason": payout.reversal_reason,
        "version": payout.version,
    }


def hold_dict(hold: PayoutHold) -> dict:
    return {
        "id": hold.pk,
        "statement": hold.statement_id,
        "reason": hold.reason,
        "message": hold.message,
        "detail": hold.detail,
        "state": "released" if hold.released_at else "held",
        "created_at": hold.created_at.isoformat(),
        "released_at": hold.released_at.isoformat() if hold.released_at else None,
        "release_reason": hold.release_reason,
        "version": hold.version,
    }


def appeal_dict(appeal: LineAppeal) -> dict:
    return {
        "id": appeal.pk,
        "line": appeal.line_id,
        "statement": appeal.line.statement_id,
        "message": appeal.message,
        "state": appeal.state,
        "resolution": appeal.resolution,
        "correction_amount": str(appeal.correction_amount) if appeal.correction_amount is not None else None,
        "correction_line": appeal.correction_line_id,
        "created_at": appeal.created_at.isoformat(),
        "resolved_at": appeal.resolved_at.isoformat() if appeal.resolved_at else None,
        "version": appeal.version,
    }


def _mine(queryset, user, field: str = "owner"):
    return queryset if is_operator(user) else queryset.filter(**{field: user})


# --- pool periods ---------------------------------------------------------------------------------
class PoolPeriodList(APIView):
    """``GET /pool-periods`` (?pool=, ?state=): operators all; owners the pools their nodes are in."""

    permission_classes = [IsOperatorOrOwner]

    @extend_schema(responses=OpenApiTypes.OBJECT, operation_id="v1_pool_periods_list")
    def get(self, request):
        state = _choice(request, "state", PoolPeriodState.values)
        rows = PoolPeriod.objects.select_related("pool").prefetch_related("mismatch_items")
        if not is_operator(request.user):
            rows = rows.filter(pool__nodes__owner=request.user).distinct()
        if state:
            rows = rows.filter(state=state)
        if request.query_params.get("pool"):
            rows = rows.filter(pool__name=request.query_params["pool"])
        return Response({"results": [period_dict(p, request.user) for p in rows[:MAX_ROWS]]})


class PoolPeriodDetail(ETagMixin, APIView):
    permission_classes = [IsOperatorOrOwner]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, pk):
        rows = PoolPeriod.objects.select_related("pool")
        if not is_operator(request.user):
            rows = rows.filter(pool__nodes__owner=request.user).distinct()
        period = rows.filter(pk=pk).first()
        if period is None:
            raise NotFound("No such pool period.", POOL_PERIOD_NOT_FOUND)
        return Response(period_dict(period, request.user))


class PoolPeriodReconcile(APIView):
    """``POST /pool-periods/{id}/reconcile`` (operator): run reconciliation again."""

    permission_classes = [IsOperator]

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    def post(self, request, pk):
        period = periods.reconcile_period(period_id=pk, actor=Actor.from_request(request))
        return Response(period_dict(period, request.user))


class MismatchItemList(APIView):
    """``GET /mismatch-items`` (?state=open|resolved, ?period=) (operator)."""

    permission_classes = [IsOperator]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request):
        state = _choice(request, "state", ("open", "resolved"))
        rows = MismatchItem.objects.order_by("created_at", "id")
        if state:
            rows = rows.filter(resolved_at__isnull=(state == "open"))
        period = request.query_params.get("period")
        if period is not None:
            if not period.isdigit():
                raise Problem("period: a pool period id.", INVALID_FILTER, field="period")
            rows = rows.filter(period_id=int(period))
        return Response({"results": [item_dict(i) for i in rows[:MAX_ROWS]]})


class MismatchItemResolve(ETagMixin, APIView):
    """``POST /mismatch-items/{id}/resolve`` (operator, If-Match) ``{"reason"}``."""

    permission_classes = [IsOperator]

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def post(self, request, pk):
        data = read_body(request, {"reason", "expected_version"})
        reason = read_text(data, "reason")
        item = periods.resolve_mismatch(
            item_id=pk, reason=reason, expected_version=expected_version(request), actor=Actor.from_request(request)
        )
        return Response(item_dict(item))


# --- payouts --------------------------------------------------------------------------------------
def _payouts(request):
    return _mine(Payout.objects.select_related("owner", "requested_by", "approved_by"), request.user)


class PayoutList(APIView):
    """``GET /payouts`` (?state=): owners their own, operators all. ``POST /payouts``
    ``{"statement", "currency"}`` (operator) requests one."""

    permission_classes = [IsOperatorOrOwner]

    @extend_schema(responses=OpenApiTypes.OBJECT, operation_id="v1_payouts_list")
    def get(self, request):
        state = _choice(request, "state", PayoutState.values)
        rows = _payouts(request)
        if state:
            rows = rows.filter(state=state)
        return Response({"results": [payout_dict(p) for p in rows[:MAX_ROWS]]})

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def post(self, request):
        if not is_operator(request.user):
            self.permission_denied(request, message="Only operators request payouts.")
        data = read_body(request, {"statement", "currency"})
        statement = data.get("statement")
        if not isinstance(statement, int) or isinstance(statement, bool):
            raise Problem("statement: a statement id (integer).", INVALID_FIELD, field="statement")
        payout = payouts.payout_request(
            statement_id=statement, currency=data.get("currency"), actor=Actor.from_request(request)
        )
        return Response(payout_dict(payout), status=201)


class PayoutDetail(ETagMixin, APIView):
    permission_classes = [IsOperatorOrOwner]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, pk):
        payout = _payouts(request).filter(pk=pk).first()
        if payout is None:
            raise NotFound("No such payout.", PAYOUT_NOT_FOUND)
        return Response(payout_dict(payout))


class PayoutAction(ETagMixin, APIView):
    """``POST /payouts/{id}/approve | paid {"external_reference"} | failed {"reason"} | reverse
    {"reason"}`` (operator, If-Match)."""

    permission_classes = [IsOperator]
    action = ""

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def post(self, request, pk):
        actor, version = Actor.from_request(request), None
        if self.action == "approve":
            read_body(request, {"expected_version"}) if request.data else None
            version = expected_version(request)
            payout = payouts.payout_approve(payout_id=pk, expected_version=version, actor=actor)
        elif self.action == "paid":
            data = read_body(request, {"external_reference", "expected_version"})
            payout = payouts.payout_mark_paid(
                payout_id=pk, external_reference=data.get("external_reference"),
                expected_version=expected_version(request), actor=actor,
            )  # fmt: skip
        elif self.action == "failed":
            data = read_body(request, {"reason", "expected_version"})
            payout = payouts.payout_mark_failed(
                payout_id=pk, reason=data.get("reason"), expected_version=expected_version(request), actor=actor
            )
        else:
            data = read_body(request, {"reason", "expected_version"})
            payout = payouts.payout_reverse(
                payout_id=pk, reason=data.get("reason"), expected_version=expected_version(request), actor=actor
            )
        return Response(payout_dict(payout))


class PayoutExport(APIView):
    """``GET /payouts/export.csv`` or ``export.json`` (operator; ?state=): one row per payout, keyed
    by its stable ``id`` (a UUID), so whatever imports it can do so idempotently."""

    permission_classes = [IsOperator]

    @extend_schema(responses={(200, "text/csv"): OpenApiTypes.STR, (200, "application/json"): OpenApiTypes.OBJECT})
    def get(self, request, kind):
        if kind not in ("csv", "json"):
            raise NotFound("Payouts export as export.csv or export.json.", UNKNOWN_EXPORT_FORMAT)
        state = _choice(request, "state", PayoutState.values)
        rows = _payouts(request).order_by("requested_at", "id")
        if state:
            rows = rows.filter(state=state)
        records = [{k: payout_dict(p)[k] for k in payout_files.EXPORT_COLUMNS} for p in rows]
        if kind == "json":
            return HttpResponse(json.dumps({"payouts": records}, indent=2), content_type="application/json")
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=payout_files.EXPORT_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
        return HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")


class PayoutImport(APIView):
    """``POST /payouts/import`` (operator): read back what the payment system did with an export.

    The body is ``export.json``'s shape (``{"payouts": [rows]}``, ``application/json``) or
    ``export.csv`` itself (``text/csv``, the header row first). Rows ``paid`` (with
    ``external_reference``) and ``failed`` (with ``failure_reason``) move approved payouts; rows
    already in the payout's state change nothing, so a re-import is idempotent. All or nothing:
    400 ``payout_import_invalid`` (malformed rows, ``errors``), 409 ``payout_import_conflict``
    (rows that contradict the stored payouts, ``rows``). Answers ``{"applied", "unchanged",
    "results": [{"row", "id", "outcome"}]}``.
    """

    permission_classes = [IsOperator]

    @extend_schema(request={"application/json": OpenApiTypes.OBJECT, "text/csv": OpenApiTypes.STR},
                   responses=OpenApiTypes.OBJECT)  # fmt: skip
    def post(self, request):
        if (request.content_type or "").split(";")[0].strip().lower() == "text/csv":
            try:
                text = request.body.decode("utf-8-sig")
            except UnicodeDecodeError as exc:
                raise Problem("The CSV must be UTF-8.", PAYOUT_IMPORT_INVALID, errors=[]) from exc
            records = [dict(row) for row in csv.DictReader(io.StringIO(text))]
            for row in records:  # a row longer than the header: csv puts the rest under None
                if None in row:
                    row["(extra cells)"] = row.pop(None)
        else:
            records = read_body(request, {"payouts"}).get("payouts")
        results = payout_files.payout_import(payout_files.parse_import(records), actor=Actor.from_request(request))
        unchanged = sum(1 for r in results if r["outcome"] == "unchanged")
        return Response({"applied": len(results) - unchanged, "unchanged": unchanged, "results": results})


# --- holds ----------------------------------------------------------------------------------------
class PayoutHoldList(APIView):
    """``GET /payout-holds`` (?state=held|released): owners their statements', operators all."""

    permission_classes = [IsOperatorOrOwner]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request):
        state = _choice(request, "state", ("held", "released"))
        rows = _mine(PayoutHold.objects.all(), request.user, "statement__owner")
        if state:
            rows = rows.filter(released_at__isnull=(state == "held"))
        return Response({"results": [hold_dict(h) for h in rows[:MAX_ROWS]]})


class PayoutHoldRelease(ETagMixin, APIView):
    """``POST /payout-holds/{id}/release`` (operator, If-Match) ``{"reason"}``."""

    permission_classes = [IsOperator]

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def post(self, request, pk):
        data = read_body(request, {"reason", "expected_version"})
        hold = holds.hold_release(
            hold_id=pk, reason=data.get("reason"), expected_version=expected_version(request),
            actor=Actor.from_request(request),
        )  # fmt: skip
        return Response(hold_dict(hold))


# --- line appeals ---------------------------------------------------------------------------------
class LineAppealList(APIView):
    """``GET /line-appeals`` (?state=): owners their own, operators all (oldest first).
    ``POST /line-appeals`` ``{"line", "message"}`` (the line's owner)."""

    permission_classes = [IsOperatorOrOwner]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request):
        state = _choice(request, "state", LineAppealState.values)
        rows = _mine(LineAppeal.objects.select_related("line").order_by("created_at", "id"), request.user)
        if state:
            rows = rows.filter(state=state)
        return Response({"results": [appeal_dict(a) for a in rows[:MAX_ROWS]]})

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def post(self, request):
        data = read_body(request, {"line", "message"})
        line = data.get("line")
        if not isinstance(line, int) or isinstance(line, bool):
            raise Problem("line: a statement line id (integer).", INVALID_FIELD, field="line")
        appeal = line_appeals.line_appeal_create(
            owner=request.user, line_id=line, message=data.get("message"), actor=Actor.from_request(request)
        )
        return Response(appeal_dict(appeal), status=201)


class LineAppealResolve(ETagMixin, APIView):
    """``POST /line-appeals/{id}/resolve`` (operator, If-Match) ``{"outcome": "corrected" |
    "rejected", "resolution", "amount": "-1.20"}`` (amount for a correction, a decimal string)."""

    permission_classes = [IsOperator]

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def post(self, request, pk):
        data = read_body(request, {"outcome", "resolution", "amount", "expected_version"})
        amount = _money(data, "amount")
        appeal = line_appeals.line_appeal_resolve(
            appeal_id=pk, outcome=data.get("outcome"), resolution=data.get("resolution"), amount=amount,
            expected_version=expected_version(request), actor=Actor.from_request(request),
        )  # fmt: skip
        return Response(appeal_dict(appeal))


class LineAppealWithdraw(APIView):
    """``POST /line-appeals/{id}/withdraw`` (the owner who filed it)."""

    permission_classes = [IsOperatorOrOwner]

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    def post(self, request, pk):
        appeal = line_appeals.line_appeal_withdraw(appeal_id=pk, owner=request.user, actor=Actor.from_request(request))
        return Response(appeal_dict(appeal))
