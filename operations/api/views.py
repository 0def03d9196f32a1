"""Pool-operations API: upgrades and their actions, the dry run, pool operation settings, scale
decisions and machines, preemption notices (from a node, from a provider, from an operator).

Views validate, read the expected version (If-Match or ``expected_version``), call one service
and shape the response.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from django.db import transaction
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, viewsets
from rest_framework.permissions import BasePermission, IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet.authentication import IsNodeSelf, NodeCredentialAuthentication, node_from_request
from fleet.errors import NODE_NOT_FOUND, POOL_NOT_FOUND
from fleet.events import Actor
from fleet.models import Node, Pool
from nodepool.api.authentication import UserTokenAuthentication
from nodepool.api.errors import FORBIDDEN, VALIDATION_ERROR
from nodepool.api.fields import parse_aware_datetime
from nodepool.api.filters import refuse_unknown_parameters
from nodepool.api.permissions import IsOperator, is_operator
from nodepool.api.problems import Forbidden, NotFound, Problem
from nodepool.api.strict import refuse_unknown_members
from nodepool.api.versioning import ETagMixin, expected_version

from .. import (
    bulk,
    disruption,
    preemption,
    providers,
    repair,
    replacement_sweep,
    services,
    shutdown,
    upgrade_plan,
    upgrades,
)
from ..choices import PreemptionSource
from ..errors import (
    INVALID_DAYS,
    INVALID_DEADLINE,
    INVALID_NODE_ID,
    INVALID_OVERRIDE,
    INVALID_REASON,
    PERMISSION_DENIED,
    UPGRADE_NOT_FOUND,
)
from ..filtersets import MachineFilterSet, ScaleDecisionFilterSet, UpgradeFilterSet
from ..models import Preemption, ProviderMachine, ScaleDecision, Upgrade
from . import serializers as s


class CanOperateUpgrades(BasePermission):
    message = "This action needs the operations.operate_upgrade permission."

    def has_permission(self, request, view):
        return bool(
            request.user and request.user.is_authenticated and request.user.has_perm("operations.operate_upgrade")
        )


def _reason(request) -> str:
    data = refuse_unknown_members(request.data, {"reason"})
    reason = data.get("reason", "")
    if not isinstance(reason, str) or len(reason) > 2000:
        raise Problem("reason must be a string of at most 2000 characters.", INVALID_REASON)
    return reason


class UpgradeViewSet(ETagMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """``GET /upgrades`` (``?pool=``, ``?state=``), ``GET /upgrades/{id}``, ``POST /upgrades`` (pending)."""

    permission_classes = [IsAuthenticated, IsOperator]
    queryset = Upgrade.objects.select_related("pool", "canary_pool").order_by("-created_at")
    filterset_class = UpgradeFilterSet

    def get_serializer_class(self):
        return s.UpgradeDetailSerializer if self.action == "retrieve" else s.UpgradeSerializer

    def get_object(self):
        try:
            return super().get_object()
        except Exception as exc:
            if isinstance(exc, Problem):
                raise
            raise NotFound("No such upgrade.", UPGRADE_NOT_FOUND) from exc

    @extend_schema(request=OpenApiTypes.OBJECT, responses={201: s.UpgradeSerializer})
    def create(self, request):
        if not request.user.has_perm("operations.operate_upgrade"):
            raise Forbidden("Creating an upgrade needs the operations.operate_upgrade permission.", PERMISSION_DENIED)
        upgrade = upgrades.upgrade_create(data=request.data, actor=Actor.from_request(request))
        return Response(s.UpgradeSerializer(upgrade).data, status=201)


class UpgradeActionView(ETagMixin, APIView):
    """``POST /upgrades/{id}/<action>`` with ``{"reason"}`` and If-Match or ``expected_version``."""

    permission_classes = [IsAuthenticated, CanOperateUpgrades]
    service = None

    @extend_schema(request=OpenApiTypes.OBJECT, responses=s.UpgradeSerializer)
    def post(self, request, pk):
        reason = _reason(request)
        version = expected_version(request)
        upgrade = type(self).service(
            upgrade_id=pk, expected_version=version, actor=Actor.from_request(request), reason=reason
        )
        return Response(s.UpgradeSerializer(upgrade).data)


def action_view(service):
    return type(
        f"Upgrade{service.__name__.title().replace('_', '')}View",
        (UpgradeActionView,),
        {"service": staticmethod(service)},
    ).as_view()


class UpgradeResumeView(ETagMixin, APIView):
    """``POST /upgrades/{id}/resume`` with ``{"reason", "override"}`` and If-Match: an upgrade its
    canary paused needs ``override`` (``retry_canary``, ``retry_canary_on_other_nodes``,
    ``skip_canary``) and a reason, else 409 ``canary_override_required``."""

    permission_classes = [IsAuthenticated, CanOperateUpgrades]

    @extend_schema(request=OpenApiTypes.OBJECT, responses=s.UpgradeSerializer)
    def post(self, request, pk):
        data = refuse_unknown_members(request.data, {"reason", "override"})
        reason = data.get("reason", "")
        if not isinstance(reason, str) or len(reason) > 2000:
            raise Problem("reason must be a string of at most 2000 characters.", INVALID_REASON)
        override = data.get("override")
        if override is not None and not isinstance(override, str):
            raise Problem("override must be a string.", INVALID_OVERRIDE, field="override")
        version = expected_version(request)
        upgrade = upgrades.upgrade_resume(
            upgrade_id=pk, expected_version=version, actor=Actor.from_request(request), reason=reason, override=override
        )
        return Response(s.UpgradeSerializer(upgrade).data)


class UpgradeDryRunView(APIView):
    """``POST /upgrades/dry-run`` with a create body: the node order and the predicted minimum
    capacity of that upgrade. Changes nothing."""

    permission_classes = [IsAuthenticated, IsOperator]

    @extend_schema(request=OpenApiTypes.OBJECT, responses={200: OpenApiTypes.OBJECT})
    def post(self, request):
        upgrade = Upgrade(**upgrade_plan.parse_upgrade(request.data))
        return Response(upgrade_plan.dry_run(upgrade))


class UpgradePlanView(APIView):
    """``GET /upgrades/{id}/dry-run``: the same prediction for an existing upgrade."""

    permission_classes = [IsAuthenticated, IsOperator]

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request, pk):
        upgrade = Upgrade.objects.filter(pk=pk).select_related("pool").first()
        if upgrade is None:
            raise NotFound("No such upgrade.", UPGRADE_NOT_FOUND)
        return Response(upgrade_plan.dry_run(upgrade))


class PoolOperationsView(ETagMixin, APIView):
    """``GET``/``PATCH /pools/{name}/operations``: spot, fallback pool, drain policy, autoscaling."""

    permission_classes = [IsAuthenticated, IsOperator]

    @extend_schema(responses=s.PoolOperationsSerializer)
    def get(self, request, name):
        pool = get_object_or_404(Pool, name=name)
        return Response(s.PoolOperationsSerializer(upgrade_plan.pool_operations(pool)).data)

    @extend_schema(request=OpenApiTypes.OBJECT, responses=s.PoolOperationsSerializer)
    def patch(self, request, name):
        pool = _pool_named(name)
        version = expected_version(request)
        ops = services.pool_operations_update(
            pool=pool, expected_version=version, data=request.data, actor=Actor.from_request(request)
        )
        return Response(s.PoolOperationsSerializer(ops).data)


def _pool_named(name: str) -> Pool:
    """The pool called ``name``; 404 ``pool_not_found`` otherwise."""
    pool = Pool.objects.filter(name=name).first()
    if pool is None:
        raise NotFound("No such pool.", POOL_NOT_FOUND)
    return pool


class _PoolStatusView(APIView):
    """A read-only, operator-only status document of one pool: ``status(pool) -> dict``."""

    permission_classes = [IsAuthenticated, IsOperator]
    status = None  # set by each subclass (a staticmethod)

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request, name):
        return Response(self.status(_pool_named(name)))


class PoolDisruptionsView(_PoolStatusView):
    """``GET /pools/{name}/disruptions``: the pool's disruption budgets with their windows (active
    or next), the allowed disruptions per reason now, and the nodes automation wants to disrupt
    but may not, each with its blocker (:func:`operations.disruption.pool_status`)."""

    status = staticmethod(disruption.pool_status)


class PoolReplacementsView(_PoolStatusView):
    """``GET /pools/{name}/replacements``: drift and expiry of the pool — its shape hash, drifted
    nodes with their ``Drifted`` condition, expired nodes, and the replacements active and recent
    (:func:`operations.replacement_sweep.pool_status`)."""

    status = staticmethod(replacement_sweep.pool_status)


class PoolRepairsView(_PoolStatusView):
    """``GET /pools/{name}/repairs``: the pool's repair rules, its safety breaker (open or closed,
    since when and why), the outage guard, the repairs in progress and the latest finished ones
    (:func:`operations.repair.pool_status`)."""

    status = staticmethod(repair.pool_status)


class NodeDisruptionView(APIView):
    """``GET /nodes/{id}/disruption``: why automation may not disrupt this node now
    (``{"node_id", "blocked": null | {reason, owner, kind, detail, blocker, since, last_seen_at}}``)."""

    permission_classes = [IsAuthenticated, IsOperator]

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request, pk):
        node = Node.objects.filter(pk=pk).first()
        if node is None:
            raise NotFound(f"No node {pk}.", NODE_NOT_FOUND)
        return Response({"node_id": str(node.pk), "blocked": disruption.node_status(node)})


class PoolPreemptionsView(APIView):
    """``GET /pools/{name}/preemptions?days=7``: preemptions per UTC day, and the latest ones."""

    permission_classes = [IsAuthenticated, IsOperator]

    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request, name):
        pool = _pool_named(name)
        refuse_unknown_parameters(request.query_params, {"days"})
        days = request.query_params.get("days", "7")
        # isascii first: "²".isdigit() is True and int("²") raises (a 500, not a 400).
        if not (days.isascii() and days.isdigit()) or not 1 <= int(days) <= 90:
            raise Problem("days must be an integer from 1 to 90.", INVALID_DAYS)
        latest = Preemption.objects.filter(pool=pool).select_related("pool", "fallback_pool")[:20]
        return Response(
            {
                "pool": pool.name,
                "per_day": preemption.preemptions_per_day(pool, days=int(days)),
                "latest": s.PreemptionSerializer(latest, many=True).data,
            }
        )


# What each preemption notice's body may hold (nodepool.api.strict: anything else is 400 unknown_field).
NODE_NOTICE_MEMBERS = frozenset({"deadline"})
POOL_NOTICE_MEMBERS = frozenset({"delivery_id", "node_id", "deadline"})


def _deadline(data) -> datetime:
    return parse_aware_datetime(data.get("deadline"), "deadline", code=INVALID_DEADLINE)


class NodePreemptionNoticeView(APIView):
    """``POST /nodes/{id}/preemption-notice`` (node credential): ``{"deadline": RFC 3339}``."""

    # A user's token is authenticated too, so that a user gets 403 (not a node), never a bare 401.
    authentication_classes = [NodeCredentialAuthentication, UserTokenAuthentication]
    permission_classes = [IsNodeSelf]

    @extend_schema(request=OpenApiTypes.OBJECT, responses={201: s.PreemptionSerializer})
    def post(self, request, pk):
        node = node_from_request(request)
        record, created = preemption.preemption_notice(
            node_id=node.pk,
            deadline=_deadline(refuse_unknown_members(request.data, NODE_NOTICE_MEMBERS)),
            source=PreemptionSource.AGENT,
            actor=Actor.for_node(node, request_id=getattr(request._request, "request_id", "")),
        )
        return Response(s.PreemptionSerializer(record).data, status=201 if created else 200)


class NodeShutdownDrainView(APIView):
    """``POST /nodes/{id}/shutdown-drain`` (the node's own credential): ``{"deadline": RFC 3339,
    "reason"}`` (both optional) — graceful node shutdown (:mod:`operations.shutdown`): the node
    drains itself with its pool's policy; ``201`` the drain (``200`` when already draining)."""

    authentication_classes = [NodeCredentialAuthentication, UserTokenAuthentication]
    permission_classes = [IsNodeSelf]

    @extend_schema(request=OpenApiTypes.OBJECT, responses={201: OpenApiTypes.OBJECT})
    def post(self, request, pk):
        node = node_from_request(request)
        data = refuse_unknown_members(request.data, {"deadline", "reason"})
        reason = data.get("reason", "")
        if not isinstance(reason, str) or len(reason) > 2000:
            raise Problem("reason must be a string of at most 2000 characters.", INVALID_REASON)
        deadline = _deadline(data) if data.get("deadline") is not None else None
        drain, created = shutdown.shutdown_drain(node=node, deadline=deadline, reason=reason)
        body = {
            "drain_id": str(drain.pk),
            "node_id": str(node.pk),
            "state": drain.state,
            "policy": drain.policy,
            "deadline": drain.deadline.isoformat(),
        }
        return Response(body, status=201 if created else 200)


class PoolPreemptionNoticeView(APIView):
    """``POST /pools/{name}/preemption-notices``: ``{"delivery_id", "node_id", "deadline"}`` from the
    pool's provider (signed like the webhook's requests, with the pool's secret) or an operator."""

    # A signed provider request carries no user: the signature is checked in the view.
    permission_classes: list = []

    @extend_schema(request=OpenApiTypes.OBJECT, responses={201: s.PreemptionSerializer})
    def post(self, request, name):
        signed = providers.SIGNATURE_HEADER in request.headers
        if not signed and not is_operator(request.user):
            # Before the pool lookup: a caller with no role learns nothing, not even which pools exist.
            raise Forbidden("Send a signed provider request, or act as an operator.", FORBIDDEN)
        pool = _pool_named(name)
        ops = upgrade_plan.pool_operations(pool)
        # One transaction: a signed delivery is remembered (replays refused) only with the notice
        # it carried; a body refused below leaves no trace, and its sender may fix it and retry.
        with transaction.atomic():
            if signed:
                try:
                    data = providers.verify(ops.provider_secret, request.headers, request.body)
                except providers.SignatureError as exc:
                    # A refused signature is 403; a signed body that is not a JSON object 400 malformed_body.
                    raise Problem(exc.message, exc.code) from None
                source, actor = PreemptionSource.PROVIDER, Actor.system(f"provider:{pool.name}")
            else:
                data, source, actor = request.data, PreemptionSource.OPERATOR, Actor.from_request(request)
            refuse_unknown_members(data, POOL_NOTICE_MEMBERS)
            if data.get("delivery_id") is not None and not isinstance(data["delivery_id"], str):
                raise Problem("delivery_id must be a string.", VALIDATION_ERROR, field="delivery_id")
            node_id = data.get("node_id")
            if not isinstance(node_id, str):
                raise Problem("node_id is required.", INVALID_NODE_ID)
            if not _is_uuid(node_id) or not pool.nodes.filter(pk=node_id).exists():
                raise NotFound(f"No node {node_id} in pool {pool.name}.", NODE_NOT_FOUND)
            record, created = preemption.preemption_notice(
                node_id=node_id, deadline=_deadline(data), source=source, actor=actor
            )
        return Response(s.PreemptionSerializer(record).data, status=201 if created else 200)


def _is_uuid(value: str) -> bool:

    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


class ScaleDecisionViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """``GET /scale-decisions?pool=``: autoscaling decisions with their reasons, newest first."""

    permission_classes = [IsAuthenticated, IsOperator]
    serializer_class = s.ScaleDecisionSerializer
    filterset_class = ScaleDecisionFilterSet
    queryset = ScaleDecision.objects.select_related("pool").order_by("-created_at", "-id")


class MachineViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """``GET /machines?pool=``: machines asked of providers, with their scale-up times."""

    permission_classes = [IsAuthenticated, IsOperator]
    serializer_class = s.ProviderMachineSerializer
    filterset_class = MachineFilterSet
    queryset = ProviderMachine.objects.select_related("pool").order_by("-requested_at")


class BulkNodeActionView(APIView):
    """``POST /nodes/bulk/{cordon,uncordon,drain}`` (operators): act on the nodes a label selector
    picks (:mod:`operations.bulk`): ``{"selector", "expected_count", "reason", "pool"?, "dry_run"?}``
    and, for a drain, ``"policy"?`` and ``"deadline"`` or ``"deadline_in"``. ``200`` with every
    node's outcome (``cordoned``, ``uncordoned``, ``still_cordoned``, ``unchanged``, ``draining``,
    ``blocked`` by a disruption budget, ``failed`` with the node's problem code; ``would_…`` in a
    dry run). 400 ``empty_selector`` / ``invalid_filter``, 404 ``pool_not_found``, 409
    ``bulk_count_mismatch`` (nothing done), 422 ``bulk_too_many``."""

    permission_classes = [IsAuthenticated, IsOperator]
    action: str = ""

    @extend_schema(request=s.BulkActionSerializer, responses={200: OpenApiTypes.OBJECT})
    def post(self, request):
        refuse_unknown_parameters(request.query_params, frozenset())
        serializer = s.BulkActionSerializer(data=request.data, context={"action": self.action})
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        nodes = bulk.select_nodes(data["selector"], pool=data.get("pool"))
        bulk.check_count(nodes, data["expected_count"])
        outcomes = bulk.run(
            self.action,
            nodes,
            actor=Actor.from_request(request),
            reason=data["reason"],
            dry_run=data["dry_run"],
            policy=data.get("policy", "wait"),
            deadline=data.get("deadline"),
        )
        counts: dict[str, int] = {}
        for outcome in outcomes:
            counts[outcome.outcome] = counts.get(outcome.outcome, 0) + 1
        body = {"action": self.action, "selector": data["selector"], "dry_run": data["dry_run"],
                "matched": len(nodes), "counts": counts, "nodes": [o.as_dict() for o in outcomes]}  # fmt: skip
        return Response(body)


def bulk_view(action: str):
    return BulkNodeActionView.as_view(action=action)
