"""Marketplace API: usage records, statements and exports, the owner's view of a quarantined node,
appeals, and their nodes' leases (prices, settlement windows, owner settings and guidance:
:mod:`marketplace.api.settings_views`; payouts and pool periods: :mod:`marketplace.api.money_views`).

Owners see only their own rows (another owner's answers 404, never 403: nothing leaks); operators
see everything and take the actions. Views validate, call one service, and shape the response.
"""

from __future__ import annotations

import json
import uuid

from django.db.models import Prefetch
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import generics
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet.errors import NODE_NOT_FOUND
from fleet.events import Actor
from fleet.models import Node
from leases.models import EvidenceInterval, Lease, LeaseCheckpoint
from nodepool.api.errors import INVALID_FILTER
from nodepool.api.permissions import is_operator, is_owner
from nodepool.api.problems import Forbidden, NotFound, Problem
from nodepool.api.versioning import ETagMixin, expected_version

from .. import appeals, reconciliation, selectors, statements
from ..choices import AppealState, DisputeDecision
from ..errors import (
    APPEAL_NOT_FOUND,
    INVALID_DECIMAL,
    INVALID_DECISION,
    INVALID_FIELD,
    NOT_QUARANTINED,
    STATEMENT_NOT_FOUND,
    UNKNOWN_EXPORT_FORMAT,
    USAGE_RECORD_NOT_FOUND,
)
from ..filtersets import AppealFilterSet, OwnedLeaseFilterSet, StatementFilterSet, UsageRecordFilterSet
from . import serializers as s
from .common import IsOperator, IsOperatorOrOwner, read_body, read_decimal, read_text


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
        data = read_body(request, {"decision", "reason", "billable_seconds"})
        decision = data.get("decision")
        if decision not in DisputeDecision.values:
            raise Problem(f"decision must be one of {', '.join(DisputeDecision.values)}.", INVALID_DECISION)
        reason = read_text(data, "reason")
        seconds = read_decimal(data, "billable_seconds", required=decision == DisputeDecision.ADJUST)
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
        data = read_body(request, {"node", "statement"})
        node_id = _uuid(data.get("node"), "node") if isinstance(data.get("node"), str) else None
        if node_id is None:
            raise Problem("node: the id of your quarantined node.", INVALID_FIELD, field="node")
        appeal = appeals.appeal_create(
            owner=request.user,
            node_id=node_id,
            statement=read_text(data, "statement"),
            actor=Actor.from_request(request),
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
        data = read_body(request, {"outcome", "resolution"})
        outcome, resolution = data.get("outcome"), read_text(data, "resolution")
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
