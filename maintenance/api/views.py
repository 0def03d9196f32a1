"""Maintenance API: one endpoint per operator action, drain and quarantine reads, disruption budgets.

Views validate, read the expected version, call one service and shape the response.
"""

from __future__ import annotations

from django.urls import reverse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.permissions import BasePermission, IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet.events import Actor
from nodepool.api.errors import INVALID_QUERY_PARAMETER
from nodepool.api.filters import refuse_unknown_parameters
from nodepool.api.permissions import HasRole, is_client, is_operator
from nodepool.api.problems import PreconditionRequired, Problem
from nodepool.api.versioning import ETagMixin, expected_version

from .. import budgets as budget_services
from .. import drains, progress, services
from ..filtersets import DrainFilterSet, QuarantineFilterSet
from ..selectors import budgets, drains_for, quarantines_for
from . import serializers as s

_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


class HasModelPermission(BasePermission):
    """The user holds the view's ``required_permission`` (operators do, through their group)."""

    def has_permission(self, request, view):
        perm = view.required_permission
        self.message = f"This action needs the {perm} permission."
        return bool(request.user and request.user.is_authenticated and request.user.has_perm(perm))


class NodeActionView(ETagMixin, APIView):
    """``POST /nodes/{id}/<action>`` with ``{"reason": …}`` and If-Match or ``expected_version``."""

    permission_classes = [IsAuthenticated, HasModelPermission]
    required_permission = "fleet.operate_node"
    request_serializer = s.ActionReasonSerializer
    # The query parameters the action reads: any other is 400 invalid_filter, so that a mistyped
    # ``?dryrun=true`` is refused instead of draining for real.
    query_parameters: frozenset[str] = frozenset()

    def validated(self, request) -> dict:
        refuse_unknown_parameters(request.query_params, self.query_parameters)
        serializer = self.request_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        data.pop("expected_version", None)
        return data

    def post(self, request, pk):
        data = self.validated(request)
        version = expected_version(request)
        node = self.act(node_id=pk, expected_version=version, actor=Actor.from_request(request), **data)
        return Response(s.NodeStateSerializer(node).data)

    def act(self, **kwargs):  # pragma: no cover - each subclass defines it
        raise NotImplementedError


@extend_schema(request=s.CordonRequestSerializer, responses=s.NodeStateSerializer)
class CordonView(NodeActionView):
    """Place the caller's own hold (``user:<username>``); other actors' holds are untouched."""

    request_serializer = s.CordonRequestSerializer

    def act(self, **kwargs):
        return services.cordon_node(**kwargs)


@extend_schema(request=s.UncordonRequestSerializer, responses=s.NodeStateSerializer)
class UncordonView(NodeActionView):
    """Remove the caller's own hold; ``owner`` + ``force`` (operators only) removes someone else's."""

    request_serializer = s.UncordonRequestSerializer

    def act(self, **kwargs):
        return services.uncordon_node(**kwargs)


@extend_schema(request=s.ActionReasonSerializer, responses=s.NodeStateSerializer)
class ReturnToServiceView(NodeActionView):
    def act(self, **kwargs):
        return services.return_node_to_service(**kwargs)


@extend_schema(request=s.ActionReasonSerializer, responses=s.NodeStateSerializer)
class RepairDrainView(NodeActionView):
    """A node left ``draining`` with no active drain → ``ready`` under the operator's own hold (recorded)."""

    def act(self, **kwargs):
        return drains.repair_stuck_drain(**kwargs)


@extend_schema(request=s.RetireRequestSerializer, responses=s.NodeStateSerializer)
class RetireView(NodeActionView):
    request_serializer = s.RetireRequestSerializer

    def act(self, **kwargs):
        return services.retire_node(**kwargs)


@extend_schema(request=s.QuarantineRequestSerializer, responses=s.NodeStateSerializer)
class QuarantineView(NodeActionView):
    required_permission = "fleet.quarantine_node"
    request_serializer = s.QuarantineRequestSerializer

    def post(self, request, pk):
        data = self.validated(request)
        version = expected_version(request)
        quarantine = services.quarantine_node(
            node_id=pk, expected_version=version, actor=Actor.from_request(request), **data
        )
        body = s.NodeStateSerializer(quarantine.node).data
        body["quarantine"] = s.QuarantineSerializer(quarantine).data
        return Response(body)


@extend_schema(request=s.ReleaseRequestSerializer, responses=s.NodeStateSerializer)
class ReleaseView(NodeActionView):
    required_permission = "fleet.release_node"
    request_serializer = s.ReleaseRequestSerializer

    def post(self, request, pk):
        data = self.validated(request)
        version = expected_version(request)
        node, secret = services.release_node(
            node_id=pk, expected_version=version, actor=Actor.from_request(request), **data
        )
        body = s.NodeStateSerializer(node).data
        if secret is not None:
            body["credential"] = secret
        return Response(body)


def _dry_run(request) -> bool:
    """``?dry_run``: absent is false; ``true``/``1``/``yes`` or ``false``/``0``/``no``.

    Raises:
        Problem: 400 ``invalid_query_parameter`` for anything else, an empty value included.
    """
    if "dry_run" not in request.query_params:
        return False
    raw = request.query_params["dry_run"].strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise Problem("dry_run must be true or false.", INVALID_QUERY_PARAMETER)


@extend_schema(
    request=s.DrainRequestSerializer,
    responses={201: s.DrainSerializer, 200: dict},
    parameters=[OpenApiParameter("dry_run", bool, description="change nothing; answer what would happen")],
)
class DrainView(NodeActionView):
    """``POST /nodes/{id}/drain`` (``?dry_run=true`` changes nothing and answers what would happen)."""

    request_serializer = s.DrainRequestSerializer
    query_parameters = frozenset({"dry_run"})

    def post(self, request, pk):
        dry_run = _dry_run(request)
        data = self.validated(request)
        if dry_run:
            try:
                version = expected_version(request)
            except PreconditionRequired:
                version = None  # a dry run needs no version; a stale one still gets 412
            plan = progress.plan_drain(
                node_id=pk, policy=data["policy"], deadline=data["deadline"], expected_version=version
            )
            return Response(plan)
        version = expected_version(request)
        drain = drains.start_drain(node_id=pk, expected_version=version, actor=Actor.from_request(request), **data)
        location = reverse("drain-detail", kwargs={"pk": drain.pk})
        return Response(s.DrainSerializer(drain).data, status=status.HTTP_201_CREATED, headers={"Location": location})


class DrainViewSet(ETagMixin, viewsets.ReadOnlyModelViewSet):
    """``GET /drains`` and ``/drains/{id}``: operators see all, owners their own nodes' drains."""

    serializer_class = s.DrainSerializer
    filterset_class = DrainFilterSet

    def get_queryset(self):
        return drains_for(self.request.user)


class DrainActionView(ETagMixin, APIView):
    permission_classes = [IsAuthenticated, HasModelPermission]
    required_permission = "fleet.operate_node"


@extend_schema(request=s.ActionReasonSerializer, responses=s.DrainSerializer)
class DrainCancelView(DrainActionView):
    """``POST /drains/{id}/cancel`` with the drain's version: node back to ready without the drain's hold."""

    def post(self, request, pk):
        serializer = s.ActionReasonSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        version = expected_version(request)
        drain = drains.cancel_drain(
            drain_id=pk,
            expected_version=version,
            reason=serializer.validated_data["reason"],
            actor=Actor.from_request(request),
        )
        return Response(s.DrainSerializer(drain).data)


@extend_schema(request=s.DeadlineChangeSerializer, responses=s.DrainSerializer)
class DrainDeadlineView(DrainActionView):
    """``POST /drains/{id}/deadline`` with ``deadline`` or ``deadline_in``, a reason and the drain's version."""

    def post(self, request, pk):
        serializer = s.DeadlineChangeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        version = expected_version(request)
        drain = drains.change_drain_deadline(
            drain_id=pk,
            expected_version=version,
            deadline=serializer.validated_data["deadline"],
            reason=serializer.validated_data["reason"],
            actor=Actor.from_request(request),
        )
        return Response(s.DrainSerializer(drain).data)


class QuarantineViewSet(viewsets.ReadOnlyModelViewSet):
    """``GET /quarantines`` and ``/quarantines/{id}``: owners see their own nodes' with reason and evidence."""

    serializer_class = s.QuarantineSerializer
    filterset_class = QuarantineFilterSet

    def get_queryset(self):
        return quarantines_for(self.request.user)


class ReadForClientsWriteForOperators(BasePermission):
    message = "Only operators may change disruption budgets."

    def has_permission(self, request, view):
        if request.method in ("GET", "HEAD", "OPTIONS"):
            return is_client(request.user)
        return is_operator(request.user)


class DisruptionBudgetViewSet(
    ETagMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Disruption budgets per workload group. Changes and deletes need the budget's version."""

    serializer_class = s.DisruptionBudgetSerializer
    permission_classes = [HasRole, ReadForClientsWriteForOperators]
    filterset_fields = ["group"]

    def get_queryset(self):
        return budgets()

    def perform_create(self, serializer):
        serializer.instance = budget_services.create_budget(
            data=serializer.validated_data, actor=Actor.from_request(self.request)
        )

    def update(self, request, *args, **kwargs):
        instance = self.get_object()
        serializer = self.get_serializer(instance, data=request.data, partial=kwargs.get("partial", False))
        serializer.is_valid(raise_exception=True)
        version = expected_version(request)
        budget = budget_services.update_budget(
            budget_id=instance.pk, expected_version=version, data=serializer.validated_data
        )
        return Response(self.get_serializer(budget).data)

    def destroy(self, request, *args, **kwargs):
        instance = self.get_object()
        budget_services.delete_budget(budget_id=instance.pk, expected_version=expected_version(request))
        return Response(status=status.HTTP_204_NO_CONTENT)
