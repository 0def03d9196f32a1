"""Marketplace API: usage records, statements and exports, pool prices and settlement windows,
owner settings, the owner's view of a quarantined node, appeals, and their nodes' leases.

Owners see only their own rows (another owner's answers 404, never 403: nothing leaks); operators
see everything and take the actions. Views validate, call one service, and shape the response.
"""

from __future__ import annotations

import json
import re
import uuid
from decimal import Decimal, InvalidOperation

from django.contrib.auth import get_user_model
from django.db.models import Prefetch
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import generics
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet import liveness
from fleet.errors import NODE_NOT_FOUND, POOL_NOT_FOUND, UNKNOWN_POOL
from fleet.events import Actor
from fleet.models import Node, Pool
from leases.models import EvidenceInterval, Lease, LeaseCheckpoint
from maintenance.choices import QuarantineRule
from nodepool.api.errors import INVALID_BODY, INVALID_FILTER
from nodepool.api.fields import parse_aware_datetime
from nodepool.api.permissions import is_client, is_operator, is_owner
from nodepool.api.problems import Forbidden, NotFound, Problem
from nodepool.api.strict import refuse_unknown_members
from nodepool.api.versioning import ETagMixin, expected_version

from .. import appeals, pricing, reconciliation, selectors, statements
from ..choices import AppealState, DisputeDecision, StatementPeriod
from ..errors import (
    APPEAL_NOT_FOUND,
    INVALID_CURRENCY,
    INVALID_DECIMAL,
    INVALID_DECISION,
    INVALID_FIELD,
    NOT_QUARANTINED,
    OWNER_NOT_FOUND,
    RULE_NOT_FOUND,
    SETTLEMENT_WINDOW_TOO_SHORT,
    STATEMENT_NOT_FOUND,
    UNKNOWN_EXPORT_FORMAT,
    USAGE_RECORD_NOT_FOUND,
)
from ..filtersets import (
    AppealFilterSet,
    OwnedLeaseFilterSet,
    PoolPriceFilterSet,
    StatementFilterSet,
    UsageRecordFilterSet,
)
from ..models import OwnerSettings, PoolPrice, PoolSettlement, QuarantineGuidance
from . import serializers as s

MAX_TEXT = 4000
RESOURCE = re.compile(r"^[a-z0-9]([a-z0-9./-]{0,61}[a-z0-9])?$")
CURRENCY = re.compile(r"^[A-Z]{3}$")


class IsOperatorOrOwner(BasePermission):
    message = "Only operators and marketplace owners may read this."

    def has_permission(self, request, view):
        return is_operator(request.user) or is_owner(request.user)


class IsOperator(BasePermission):
    message = "Only operators may do this."

    def has_permission(self, request, view):
        return is_operator(request.user)


class ReadForAllWriteForOperators(BasePermission):
    message = "Only operators may change prices."

    def has_permission(self, request, view):
        if request.method in ("GET", "HEAD", "OPTIONS"):
            return is_operator(request.user) or is_owner(request.user) or is_client(request.user)
        return is_operator(request.user)


def _body(request, members) -> dict:
    """The request body, an object holding only ``members`` (400 ``invalid_body`` when it is not
    an object, 400 ``unknown_field`` for any other member: nodepool.api.strict)."""
    data = request.data
    if not isinstance(data, dict):
        raise Problem("The body must be a JSON object.", INVALID_BODY)
    return refuse_unknown_members(data, members)


def _text(data: dict, name: str, *, required: bool = True, limit: int = MAX_TEXT) -> str:
    value = data.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()) or len(value) > limit:
        raise Problem(f"{name}: required, a non-empty string of at most {limit} characters.", INVALID_FIELD, field=name)
    return value.strip()


def _decimal(data: dict, name: str, *, required: bool = True) -> Decimal | None:
    value = data.get(name)
    if value is None and not required:
        return None
    # Money and quantities travel as decimal strings: a JSON number is a float in most clients.
    if not isinstance(value, str) or len(value) > 40:
        raise Problem(f'{name}: a decimal string such as "0.60" (not a JSON number).', INVALID_DECIMAL, field=name)
    try:
        number = Decimal(value)
    except InvalidOperation as exc:
        raise Problem(f"{name}: {value[:40]!r} is not a decimal number.", INVALID_DECIMAL, field=name) from exc
    if not number.is_finite() or number < 0:
        raise Problem(f"{name}: must be a finite, non-negative decimal.", INVALID_DECIMAL, field=name)
    return number


def _datetime(data: dict, name: str):
    return parse_aware_datetime(data.get(name), name)


# --- usage records -------------------------------------------------------------------------------
class UsageRecordList(generics.ListAPIView):
    """``GET /usage-records`` (?state=, ?node=): owners their own nodes', operators all."""

    permission_classes = [IsOperatorOrOwner]
    serializer_class = s.UsageRecordSerializer
    filterset_class = UsageRecordFilterSet

    def get_queryset(self):
        return selectors.usage_records_for(self.request.user)


def _uuid(value: str, name: str):
    try:
        return uuid.UUID(value)
    except (ValueError, TypeError, AttributeError) as exc:
        raise Problem(f"{name} must be a UUID.", INVALID_FILTER, field=name) from exc


def _evidence_prefetch():
    return [
        Prefetch("lease__evidence_intervals", queryset=EvidenceInterval.objects.order_by("started_at", "id")),
        Prefetch("lease__checkpoints", queryset=LeaseCheckpoint.objects.order_by("id")),
    ]


class UsageRecordDetail(ETagMixin, generics.RetrieveAPIView):
    """``GET /usage-records/{id}``: with its gaps, findings and the lease's execution evidence."""

    permission_classes = [IsOperatorOrOwner]
    serializer_class = s.UsageRecordDetailSerializer

    def get_queryset(self):
        return selectors.usage_records_for(self.request.user).prefetch_related(*_evidence_prefetch())


class UsageRecordReconcile(APIView):
    """``POST /usage-records/{id}/reconcile`` (operator): reconcile now, even inside the window."""

    permission_classes = [IsOperator]

    @extend_schema(request=None, responses=s.UsageRecordSerializer)
    def post(self, request, pk):
        record = reconciliation.reconcile_usage(pk, actor=Actor.from_request(request), force=True)
        if record is None:
            raise NotFound("No such usage record.", USAGE_RECORD_NOT_FOUND)
        return Response(s.UsageRecordSerializer(record).data)


class UsageRecordResolve(ETagMixin, APIView):
    """``POST /usage-records/{id}/resolve`` (operator) ``{"decision", "reason", "billable_seconds"?}``
    with If-Match: settle a disputed or held record."""

    permission_classes = [IsOperator]

    @extend_schema(request=OpenApiTypes.OBJECT, responses=s.UsageRecordSerializer)
    def post(self, request, pk):
        data = _body(request, {"decision", "reason", "billable_seconds"})
        decision = data.get("decision")
        if decision not in DisputeDecision.values:
            raise Problem(f"decision must be one of {', '.join(DisputeDecision.values)}.", INVALID_DECISION)
        reason = _text(data, "reason")
        seconds = _decimal(data, "billable_seconds", required=decision == DisputeDecision.ADJUST)
        version = expected_version(request)
        record = selectors.usage_records_for(request.user).filter(pk=pk).first()
        if record is None:
            raise NotFound("No such usage record.", USAGE_RECORD_NOT_FOUND)
        if seconds is not None and seconds > record.evidenced_seconds:
            raise Problem(
                "billable_seconds cannot exceed the evidenced time.", INVALID_DECIMAL, field="billable_seconds"
            )
        record = reconciliation.resolve_usage(
            record_id=pk,
            decision=decision,
            expected_version=version,
            reason=reason,
            billable_seconds=seconds,
            actor=Actor.from_request(request),
        )
        return Response(s.UsageRecordSerializer(record).data)


# --- statements ----------------------------------------------------------------------------------
class StatementList(generics.ListAPIView):
    """``GET /statements`` (?state=open|final): owners their own, operators all."""

    permission_classes = [IsOperatorOrOwner]
    serializer_class = s.StatementSerializer
    filterset_class = StatementFilterSet

    def get_queryset(self):
        return selectors.statements_for(self.request.user)


class StatementDetail(ETagMixin, generics.RetrieveAPIView):
    permission_classes = [IsOperatorOrOwner]
    serializer_class = s.StatementDetailSerializer

    def get_queryset(self):
        return selectors.statements_for(self.request.user).prefetch_related("lines__usage_record")


class StatementFinalize(ETagMixin, APIView):
    """``POST /statements/{id}/finalize`` (operator, If-Match): ``open → final``."""

    permission_classes = [IsOperator]

    @extend_schema(request=None, responses=s.StatementDetailSerializer)
    def post(self, request, pk):
        version = expected_version(request)
        statement = statements.finalize_statement(
            statement_id=pk, expected_version=version, actor=Actor.from_request(request)
        )
        return Response(s.StatementDetailSerializer(statement).data)


class StatementExport(APIView):
    """``GET /statements/{id}/export.csv`` or ``export.json``: the statement as a file."""

    permission_classes = [IsOperatorOrOwner]

    @extend_schema(responses={(200, "text/csv"): OpenApiTypes.STR, (200, "application/json"): OpenApiTypes.OBJECT})
    def get(self, request, pk, kind):
        if kind not in ("csv", "json"):
            raise NotFound("Statements export as export.csv or export.json.", UNKNOWN_EXPORT_FORMAT)
        statement = selectors.statements_for(request.user).filter(pk=pk).first()
        if statement is None:
            raise NotFound("No such statement.", STATEMENT_NOT_FOUND)
        name = f"statement-{statement.pk}-{statement.period_start:%Y-%m-%d}"
        if kind == "csv":
            response = HttpResponse(statements.export_csv(statement), content_type="text/csv; charset=utf-8")
        else:
            body = json.dumps(statements.export_json(statement), indent=2)
            response = HttpResponse(body, content_type="application/json")
        response["Content-Disposition"] = f'attachment; filename="{name}.{kind}"'
        return response


# --- prices, settlement windows, owner settings, guidance ------------------------------------------
class PoolPriceList(generics.ListCreateAPIView):
    """``GET /pool-prices`` (?pool=) and ``POST`` (operator) ``{"pool", "resource", "unit_price":
    "0.60", "currency": "EUR", "effective_from"}``: a new price version (never an edit)."""

    permission_classes = [ReadForAllWriteForOperators]
    serializer_class = s.PoolPriceSerializer
    filterset_class = PoolPriceFilterSet
    queryset = PoolPrice.objects.select_related("pool")

    @extend_schema(request=OpenApiTypes.OBJECT, responses={201: s.PoolPriceSerializer})
    def post(self, request, *args, **kwargs):
        data = _body(request, {"pool", "resource", "unit_price", "currency", "effective_from", "note"})
        pool = Pool.objects.filter(name=data.get("pool")).first() if isinstance(data.get("pool"), str) else None
        if pool is None:
            raise Problem("pool: the name of an existing pool.", UNKNOWN_POOL, field="pool")
        resource = data.get("resource")
        if not isinstance(resource, str) or not RESOURCE.match(resource):
            raise Problem(
                "resource: a resource name such as cpu, memory or nvidia.com/gpu.", INVALID_FIELD, field="resource"
            )
        currency = data.get("currency")
        if not isinstance(currency, str) or not CURRENCY.match(currency):
            raise Problem("currency: an ISO 4217 code, three capital letters.", INVALID_CURRENCY, field="currency")
        price = pricing.set_price(
            pool=pool,
            resource=resource,
            unit_price=_decimal(data, "unit_price"),
            currency=currency,
            effective_from=_datetime(data, "effective_from"),
            user=request.user,
            note=_text(data, "note", required=False, limit=200),
        )
        return Response(s.PoolPriceSerializer(price).data, status=201)


class PoolSettlementView(APIView):
    """``GET /pools/{name}/settlement`` and ``PUT`` (operator) ``{"settlement_window": seconds | null}``
    and/or the pool-period settings ``{"period": "day" | "week" | "month", "idle_paid": bool,
    "hold_multiple": "10", "appeal_alert_after": seconds}`` (docs/marketplace.md, "Pool periods")."""

    permission_classes = [IsOperator]

    def _answer(self, pool):
        row = PoolSettlement.objects.filter(pool=pool).first() or PoolSettlement(pool=pool)
        return Response(
            {
                "pool": pool.name,
                "settlement_window": row.settlement_window,
                "effective_window": reconciliation.settlement_window(pool),
                "period": row.period,
                "idle_paid": row.idle_paid,
                "hold_multiple": str(Decimal(row.hold_multiple).quantize(Decimal("0.01"))),
                "appeal_alert_after": row.appeal_alert_after,
            }
        )

    @staticmethod
    def _money_settings(data: dict) -> dict:
        values = {}
        if "period" in data:
            if data["period"] not in StatementPeriod.values:
                raise Problem("period: day, week or month.", INVALID_FIELD, field="period")
            values["period"] = data["period"]
        if "idle_paid" in data:
            if not isinstance(data["idle_paid"], bool):
                raise Problem("idle_paid: true or false.", INVALID_FIELD, field="idle_paid")
            values["idle_paid"] = data["idle_paid"]
        if "hold_multiple" in data:
            multiple = _decimal(data, "hold_multiple")
            if multiple < 1 or multiple >= 10**6 or multiple != multiple.quantize(Decimal("0.01")):
                raise Problem(
                    "hold_multiple: at least 1, two decimals at most.", INVALID_DECIMAL, field="hold_multiple"
                )
            values["hold_multiple"] = multiple
        if "appeal_alert_after" in data:
            seconds = data["appeal_alert_after"]
            if isinstance(seconds, bool) or not isinstance(seconds, int) or not 60 <= seconds <= 10**8:
                raise Problem("appeal_alert_after: seconds (an integer, 60 or more).", INVALID_FIELD,
                              field="appeal_alert_after")  # fmt: skip
            values["appeal_alert_after"] = seconds
        return values

    def _pool(self, name):
        pool = Pool.objects.filter(name=name).first()
        if pool is None:
            raise NotFound("No such pool.", POOL_NOT_FOUND)
        return pool

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, name):
        return self._answer(self._pool(name))

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def put(self, request, name):
        pool = self._pool(name)
        data = _body(request, {"settlement_window", "period", "idle_paid", "hold_multiple", "appeal_alert_after"})
        money = self._money_settings(data)
        if money and "settlement_window" not in data:
            PoolSettlement.objects.update_or_create(pool=pool, defaults=money)
            return self._answer(pool)
        value = data.get("settlement_window", "missing")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**8):
            raise Problem(
                "settlement_window: seconds (an integer), or null for the default.",
                INVALID_FIELD,
                field="settlement_window",
            )
        lost_after = liveness.timings_for(pool, liveness.heartbeat_population()).lost_after
        if value is not None and value <= lost_after:
            raise Problem(
                f"settlement_window must exceed the pool's loss threshold ({lost_after:g} s now).",
                SETTLEMENT_WINDOW_TOO_SHORT,
                field="settlement_window",
            )
        PoolSettlement.objects.update_or_create(pool=pool, defaults={"settlement_window": value, **money})
        return self._answer(pool)


class OwnerSettingsView(APIView):
    """``GET /owner-settings/{username}`` (the owner or an operator) and ``PUT`` (operator)
    ``{"statement_period": "month" | "week" | "day"}``: applies to statements opened from now on."""

    permission_classes = [IsOperatorOrOwner]

    def _owner(self, request, username):
        user = get_user_model().objects.filter(username=username).first()
        if user is None or not is_owner(user) or (not is_operator(request.user) and user.pk != request.user.pk):
            raise NotFound("No such owner.", OWNER_NOT_FOUND)
        return user

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, username):
        user = self._owner(request, username)
        return Response({"owner": user.username, "statement_period": statements.period_of(user.pk)})

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def put(self, request, username):
        if not is_operator(request.user):
            raise Forbidden("Only operators may change an owner's settings.")
        user = self._owner(request, username)
        period = _body(request, {"statement_period"}).get("statement_period")
        if period not in StatementPeriod.values:
            raise Problem(
                f"statement_period must be one of {', '.join(StatementPeriod.values)}.",
                INVALID_FIELD,
                field="statement_period",
            )
        OwnerSettings.objects.update_or_create(owner=user, defaults={"statement_period": period})
        return Response({"owner": user.username, "statement_period": period})


class QuarantineGuidanceList(APIView):
    """``GET /quarantine-guidance``: every quarantine rule's next-step text for owners."""

    permission_classes = [IsOperatorOrOwner]

    @extend_schema(operation_id="v1_quarantine_guidance_list", responses=OpenApiTypes.OBJECT)
    def get(self, request):
        return Response({r: selectors.next_steps(r) for r in QuarantineRule.values})


class QuarantineGuidanceView(APIView):
    """``GET /quarantine-guidance/{rule}`` and ``PUT`` (operator) ``{"next_steps": text}``."""

    permission_classes = [IsOperatorOrOwner]

    def _rule(self, rule):
        if rule not in QuarantineRule.values:
            raise NotFound("No such quarantine rule.", RULE_NOT_FOUND)
        return rule

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, rule):
        return Response({"rule": self._rule(rule), "next_steps": selectors.next_steps(rule)})

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def put(self, request, rule):
        if not is_operator(request.user):
            raise Forbidden("Only operators may write guidance.")
        self._rule(rule)
        text = _text(_body(request, {"next_steps"}), "next_steps")
        QuarantineGuidance.objects.update_or_create(
            rule=rule, defaults={"next_steps": text, "updated_by": request.user.get_username()}
        )
        return Response({"rule": rule, "next_steps": text})


# --- the owner's view of a node, appeals, their nodes' leases --------------------------------------
class NodeQuarantineStatus(APIView):
    """``GET /nodes/{id}/quarantine-status``: the node's latest quarantine as the caller may see it
    (owners: the rule or reason, evidence minus operator-private parts, next steps, appeals)."""

    permission_classes = [IsOperatorOrOwner]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, pk):
        node = Node.objects.filter(pk=pk).first()
        if node is None or not (is_operator(request.user) or node.owner_id == request.user.pk):
            raise NotFound("No such node.", NODE_NOT_FOUND)
        view = selectors.quarantine_view(node, request.user)
        if view is None:
            raise NotFound("This node has never been quarantined.", NOT_QUARANTINED)
        return Response({"node": str(node.pk), "lifecycle": node.lifecycle, **view})


class AppealList(generics.ListAPIView):
    """``GET /appeals`` (?state=open: the operators' queue) and ``POST`` (owner) ``{"node", "statement"}``."""

    permission_classes = [IsOperatorOrOwner]
    filterset_class = AppealFilterSet

    def get_queryset(self):
        qs = selectors.appeals_for(self.request.user)
        # The operators' queue (?state=open) oldest first; the filter itself is AppealFilterSet's.
        queue = self.request.query_params.getlist("state") == [AppealState.OPEN]
        return qs.order_by("created_at", "id") if queue else qs

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, *args, **kwargs):
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response([selectors.appeal_dict(a) for a in page])

    @extend_schema(request=OpenApiTypes.OBJECT, responses={201: OpenApiTypes.OBJECT})
    def post(self, request, *args, **kwargs):
        if not is_owner(request.user) or is_operator(request.user):
            raise Forbidden("Only a node's owner may appeal its quarantine.")
        data = _body(request, {"node", "statement"})
        node_id = _uuid(data.get("node"), "node") if isinstance(data.get("node"), str) else None
        if node_id is None:
            raise Problem("node: the id of your quarantined node.", INVALID_FIELD, field="node")
        appeal = appeals.appeal_create(
            owner=request.user, node_id=node_id, statement=_text(data, "statement"), actor=Actor.from_request(request)
        )
        return Response(selectors.appeal_dict(appeal), status=201)


class AppealDetail(ETagMixin, APIView):
    permission_classes = [IsOperatorOrOwner]

    @extend_schema(operation_id="v1_appeals_detail", responses=OpenApiTypes.OBJECT)
    def get(self, request, pk):
        appeal = selectors.appeals_for(request.user).filter(pk=pk).first()
        if appeal is None:
            raise NotFound("No such appeal.", APPEAL_NOT_FOUND)
        return Response(selectors.appeal_dict(appeal))


class AppealResolve(ETagMixin, APIView):
    """``POST /appeals/{id}/resolve`` (operator, If-Match) ``{"outcome": "upheld" | "overturned", "resolution"}``."""

    permission_classes = [IsOperator]

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def post(self, request, pk):
        data = _body(request, {"outcome", "resolution"})
        outcome, resolution = data.get("outcome"), _text(data, "resolution")
        version = expected_version(request)
        appeal = appeals.appeal_resolve(
            appeal_id=pk,
            outcome=outcome,
            resolution=resolution,
            expected_version=version,
            actor=Actor.from_request(request),
        )
        return Response(selectors.appeal_dict(appeal))


class AppealWithdraw(APIView):
    """``POST /appeals/{id}/withdraw`` (the owner who filed it)."""

    permission_classes = [IsOperatorOrOwner]

    @extend_schema(request=None, responses=OpenApiTypes.OBJECT)
    def post(self, request, pk):
        appeal = appeals.appeal_withdraw(appeal_id=pk, owner=request.user, actor=Actor.from_request(request))
        return Response(selectors.appeal_dict(appeal))


def _owned_leases(user):
    qs = Lease.objects.select_related("pool", "shape", "usage_record")
    if is_operator(user):
        return qs
    return qs.filter(node__owner=user) if is_owner(user) else qs.none()


class OwnedLeaseList(generics.ListAPIView):
    """``GET /owned-leases`` (?node=, ?state=): leases on the caller's nodes (operators: all),
    without the client's private fields."""

    permission_classes = [IsOperatorOrOwner]
    serializer_class = s.OwnedLeaseSerializer
    filterset_class = OwnedLeaseFilterSet

    def get_queryset(self):
        return _owned_leases(self.request.user)


class OwnedLeaseDetail(generics.RetrieveAPIView):
    """``GET /owned-leases/{id}``: with its evidence intervals and checkpoint history."""

    permission_classes = [IsOperatorOrOwner]
    serializer_class = s.OwnedLeaseDetailSerializer

    def get_queryset(self):
        return _owned_leases(self.request.user).prefetch_related(
            Prefetch("evidence_intervals", queryset=EvidenceInterval.objects.order_by("started_at", "id")),
            "checkpoints",
        )
