"""Lease API: thin views over leases.services (validation and rules live there)."""

from __future__ import annotations

from django.db import transaction
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, generics, status
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet.authentication import node_from_request
from fleet.events import Actor
from nodepool.api.permissions import IsClientOrOperator, IsOperator, is_client, is_fencing_validator, is_operator
from nodepool.api.problems import NotFound
from nodepool.api.strict import refuse_unknown_members
from nodepool.api.versioning import ETagMixin, expected_version, lock_for_action

from .. import fencing, services
from ..errors import LEASE_NOT_FOUND
from ..filtersets import ConsistencyReportFilterSet, LeaseFilterSet, LeaseRequestFilterSet, ShapeFilterSet
from ..models import ConsistencyReport, Lease, LeaseRequest, Shape
from . import schema
from .serializers import ConsistencyReportSerializer, LeaseRequestSerializer, LeaseSerializer, ShapeSerializer


class IsNode(BasePermission):
    """A node credential (``Authorization: Node …``); which lease it may touch is checked by the service."""

    message = "Only the lease's node may report job events (send its node credential)."

    def has_permission(self, request, view):
        return node_from_request(request) is not None


class MayValidateFencing(BasePermission):
    """Nodes, lease clients, operators, ``fencing-validators``, or a caller presenting a lease secret.

    Which lease each of them may learn about is decided per lease by :func:`_may_see_for_fencing`.
    """

    message = "Only lease clients, operators, nodes and fencing validators may validate fencing tokens."

    def has_permission(self, request, view):
        if node_from_request(request) is not None or is_client(request.user) or is_fencing_validator(request.user):
            return True
        data = request.data
        return isinstance(data, dict) and isinstance(data.get("lease_secret"), str)


def _may_see_for_fencing(request):
    """The caller's rights over one lease: its client, operators, its node, fencing validators, or
    whoever presents the lease's own secret (issue 12 registers the verifier)."""
    node = node_from_request(request)
    user = request.user
    secret = request.data.get("lease_secret") if isinstance(request.data, dict) else None

    def may_see(lease) -> bool:
        if is_operator(user) or is_fencing_validator(user):
            return True
        if node is not None and lease.node_id == node.pk:
            return True
        if getattr(user, "is_authenticated", False) and lease.client_id == user.pk:
            return True
        return secret is not None and fencing.lease_secret_matches(lease, secret)

    return may_see


def _visible_leases(user):
    queryset = Lease.objects.select_related("pool", "shape", "client")
    return queryset if is_operator(user) else queryset.filter(client=user)


def _lease_response(lease: Lease, code: int = 200) -> Response:
    return Response(LeaseSerializer(lease).data, status=code)


class LeaseListCreate(ETagMixin, generics.ListAPIView):
    """``GET /node-leases`` (own leases; operators all) and ``POST /node-leases`` (place work)."""

    permission_classes = [IsClientOrOperator]
    serializer_class = LeaseSerializer
    filterset_class = LeaseFilterSet

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation has no user
            return Lease.objects.none()
        return _visible_leases(self.request.user)

    @extend_schema(
        request=schema.LeaseCreateRequest,
        responses={201: LeaseSerializer, 200: LeaseSerializer, 202: LeaseRequestSerializer},
    )
    def post(self, request):
        result, code = services.lease_create(
            data=request.data,
            client=request.user,
            actor=Actor.from_request(request),
            idempotency_key=request.headers.get("Idempotency-Key", "").strip(),
        )
        if isinstance(result, LeaseRequest):
            body = LeaseRequestSerializer(result).data
            if result.lease_id:
                body["lease"] = LeaseSerializer(result.lease).data
            return Response(body, status=status.HTTP_202_ACCEPTED if code == 202 else code)
        response = _lease_response(result, code)
        if code == 200:
            response["Idempotent-Replayed"] = "true"
        return response


class LeaseDetail(ETagMixin, generics.RetrieveAPIView):
    permission_classes = [IsClientOrOperator]
    serializer_class = LeaseSerializer

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return Lease.objects.none()
        return _visible_leases(self.request.user)


class LeaseRenew(ETagMixin, APIView):
    """``POST /node-leases/{id}/renew`` ``{fencing_token, node_incarnation, ttl_seconds}``."""

    permission_classes = [IsClientOrOperator]

    @extend_schema(request=schema.LeaseRenewRequest, responses=LeaseSerializer)
    def post(self, request, pk):
        lease = fencing.lease_renew(
            lease_id=pk, data=request.data, user=request.user, actor=Actor.from_request(request)
        )
        return _lease_response(lease)


class LeaseRelease(ETagMixin, APIView):
    """``POST /node-leases/{id}/release`` ``{fencing_token, node_incarnation, outcome}``."""

    permission_classes = [IsClientOrOperator]

    @extend_schema(request=schema.LeaseReleaseRequest, responses=LeaseSerializer)
    def post(self, request, pk):
        lease = fencing.lease_release(
            lease_id=pk, data=request.data, user=request.user, actor=Actor.from_request(request)
        )
        return _lease_response(lease)


class LeaseCheckpoint(ETagMixin, APIView):
    """``POST /node-leases/{id}/checkpoint`` (operators, ``If-Match`` or ``expected_version``):
    ask the node to checkpoint the job in its next heartbeat."""

    permission_classes = [IsOperator]

    @extend_schema(request=schema.ExpectedVersionRequest, responses=LeaseSerializer)
    def post(self, request, pk):
        refuse_unknown_members(request.data, ())  # the version is its only member
        expected = expected_version(request)  # 428 without, 412 when stale
        if not Lease.objects.filter(pk=pk).exists():
            raise NotFound("No such lease.", LEASE_NOT_FOUND)
        with transaction.atomic():
            # The version is checked under the row lock: of two operators on one version, one wins.
            lease = lock_for_action(Lease.objects, expected=expected, pk=pk)
            fencing.request_checkpoint(lease=lease, actor=Actor.from_request(request))
        lease.refresh_from_db()
        return _lease_response(lease)


class LeaseEvents(ETagMixin, APIView):
    """``POST /node-leases/{lease_id}/events`` (node credential): the job's state on the node."""

    permission_classes = [IsNode]
    throttle_classes: list = []  # nodes are anonymous users; the anon rate is meant for strangers

    @extend_schema(request=schema.LeaseEventRequest, responses=LeaseSerializer)
    def post(self, request, lease_id):
        node = node_from_request(request)
        lease = fencing.lease_report_event(
            lease_id=lease_id, data=request.data, node=node, actor=Actor.for_node(node, request.request_id)
        )
        return _lease_response(lease)


# Answers to a lease secret that is not one this control plane issued (its HMAC does not verify).
UNVERIFIED_SECRET_CODES = frozenset({"malformed_lease_secret", "bad_lease_secret"})


class FencingValidate(APIView):
    """``POST /fencing/validate`` ``{workload_id, fencing_token}`` → ``{valid, current_token}``."""

    permission_classes = [MayValidateFencing]
    throttle_classes: list = []

    @extend_schema(request=schema.FencingValidateRequest, responses=schema.FencingValidateResponse)
    def post(self, request):
        answer = fencing.fencing_validate(data=request.data, may_see=_may_see_for_fencing(request))
        anonymous = node_from_request(request) is None and not request.user.is_authenticated
        if anonymous and answer.get("code") in UNVERIFIED_SECRET_CODES:
            # A caller with no credential is answered only when the secret itself proves who it is
            # (a genuine secret, current or stale); anything else is an unauthenticated request.
            raise exceptions.NotAuthenticated("Present a lease secret this control plane issued, or authenticate.")
        return Response(answer)


class LeaseRequestVisibility:
    """Who sees which lease requests: operators all, a client its own."""

    permission_classes = [IsClientOrOperator]
    serializer_class = LeaseRequestSerializer

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return LeaseRequest.objects.none()
        queryset = LeaseRequest.objects.select_related("pool")
        return queryset if is_operator(self.request.user) else queryset.filter(client=self.request.user)


class LeaseRequestList(LeaseRequestVisibility, generics.ListAPIView):
    """``GET /lease-requests`` (``?state=``, ``?pool=``, ``?workload_id=``)."""

    filterset_class = LeaseRequestFilterSet


class LeaseRequestDetail(ETagMixin, LeaseRequestVisibility, generics.RetrieveAPIView):
    """``GET /lease-requests/{id}`` (current reasons, pending time); ``DELETE`` cancels a pending one."""

    etag_ignores = ("pending_seconds",)  # the clock's, not the request's: it moves at every read

    @extend_schema(operation_id="v1_lease_requests_retrieve")
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    def delete(self, request, pk):
        lease_request = services.lease_request_cancel(
            request_id=pk, user=request.user, actor=Actor.from_request(request)
        )
        return Response(LeaseRequestSerializer(lease_request).data)


class ShapePermission(BasePermission):
    message = "Only operators may publish shapes."

    def has_permission(self, request, view):
        if request.method in ("GET", "HEAD", "OPTIONS"):
            return is_client(request.user)
        return is_operator(request.user)


SHAPE_MEMBERS = frozenset({"name", "resources", "features", "devices", "description"})


class ShapeListCreate(generics.ListAPIView):
    """``GET /shapes`` (every version; ``?name=``) and ``POST /shapes`` (a new version)."""

    permission_classes = [ShapePermission]
    serializer_class = ShapeSerializer
    filterset_class = ShapeFilterSet
    queryset = Shape.objects.all()

    @extend_schema(request=schema.ShapeCreateRequest, responses={201: ShapeSerializer})
    def post(self, request):
        data = refuse_unknown_members(request.data, SHAPE_MEMBERS)
        shape = services.shape_create(
            name=data.get("name"),
            resources=data.get("resources"),
            features=data.get("features"),
            devices=data.get("devices"),
            description=data.get("description"),
            actor=Actor.from_request(request),
        )
        return Response(ShapeSerializer(shape).data, status=status.HTTP_201_CREATED)


class ShapeDetail(generics.RetrieveAPIView):
    permission_classes = [ShapePermission]
    serializer_class = ShapeSerializer
    queryset = Shape.objects.all()


class ConsistencyReportList(generics.ListAPIView):
    """``GET /lease-consistency-reports`` (operators): results of the capacity consistency check."""

    permission_classes = [IsOperator]
    serializer_class = ConsistencyReportSerializer
    filterset_class = ConsistencyReportFilterSet
    queryset = ConsistencyReport.objects.all()
