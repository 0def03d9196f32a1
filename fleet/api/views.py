"""Fleet API views: pools, bootstrap tokens, enrollment, nodes, admission, credentials, benchmarks.

Thin: validate, call one service, shape the response. Node-credential endpoints (rotate,
benchmark results) admit only the node itself; every operator action needs the expected version.
"""

from __future__ import annotations

import math

from django.db.models import Count
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.throttling import ScopedRateThrottle
from rest_framework.views import APIView

from nodepool.api.permissions import IsOperator, IsOperatorOrReadOnlyOwner
from nodepool.api.problems import Gone, NotFound
from nodepool.api.versioning import ETagMixin, expected_version

from .. import benchmarks, liveness, pacing, services
from ..authentication import IsNodeSelf, node_from_request
from ..choices import Lifecycle
from ..errors import NODE_NOT_FOUND, NODE_RETIRED
from ..events import Actor
from ..filtersets import BootstrapTokenFilterSet, NodeFilterSet
from ..models import BootstrapToken, Node, Pool
from ..selectors import node_queryset_for
from . import schema
from .nodes import NodeSerializer
from .serializers import (
    BenchmarkResultSerializer,
    BootstrapTokenCreateSerializer,
    BootstrapTokenSerializer,
    CredentialIssueSerializer,
    CredentialRotateSerializer,
    EnrollmentSerializer,
    PoolSerializer,
    ReasonSerializer,
)


def _valid(serializer_class, request, **kwargs):
    serializer = serializer_class(data=request.data, **kwargs)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


# --- pools ---------------------------------------------------------------------------------------------


class PoolViewSet(ETagMixin, viewsets.ModelViewSet):
    """Pools: everyone signed in reads; operators create, change (If-Match) and delete (If-Match)."""

    serializer_class = PoolSerializer
    permission_classes = [IsOperatorOrReadOnlyOwner]
    lookup_field = "name"
    filterset_fields = ["kind"]

    def get_queryset(self):
        return Pool.objects.annotate(node_count=Count("nodes")).order_by("name")

    def create(self, request, *args, **kwargs):
        values = _valid(PoolSerializer, request)
        pool = services.pool_create(values=values)
        return Response(PoolSerializer(self.get_queryset().get(pk=pool.pk)).data, status=status.HTTP_201_CREATED)

    def update(self, request, *args, **kwargs):
        pool = self.get_object()
        version = expected_version(request)
        changes = _valid(PoolSerializer, request, instance=pool, partial=kwargs.get("partial", False))
        services.pool_update(
            pool_id=pool.pk, expected_version=version, changes=changes, actor=Actor.from_request(request)
        )
        return Response(PoolSerializer(self.get_queryset().get(pk=pool.pk)).data)

    def destroy(self, request, *args, **kwargs):
        pool = self.get_object()
        services.pool_delete(pool_id=pool.pk, expected_version=expected_version(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- bootstrap tokens ------------------------------------------------------------------------------------


class BootstrapTokenViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin, viewsets.GenericViewSet
):
    """Operators create (the secret is in the 201 response and nowhere else), list and revoke tokens."""

    serializer_class = BootstrapTokenSerializer
    permission_classes = [IsOperator]
    queryset = BootstrapToken.objects.select_related("pool", "owner", "created_by")
    filterset_class = BootstrapTokenFilterSet

    @extend_schema(request=BootstrapTokenCreateSerializer, responses={201: BootstrapTokenSerializer})
    def create(self, request, *args, **kwargs):
        data = _valid(BootstrapTokenCreateSerializer, request)
        token, secret = services.bootstrap_token_create(
            pool=data.get("pool"),
            node_id=data.get("node"),
            expires_at=data["expires_at"],
            max_uses=data["max_uses"],
            description=data["description"],
            owner=data.get("owner"),
            created_by=request.user,
        )
        body = {**BootstrapTokenSerializer(token).data, "token": secret}
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: BootstrapTokenSerializer})
    def revoke(self, request, pk=None):
        token = services.bootstrap_token_revoke(token_id=self.get_object().pk)
        return Response(BootstrapTokenSerializer(token).data)


# --- enrollment ------------------------------------------------------------------------------------------


class NodeEnrollmentView(APIView):
    """``POST /node-enrollments``: a bootstrap token in the body, no Authorization header."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "enrollment"
    max_body_bytes = 128 * 1024

    @extend_schema(request=EnrollmentSerializer, responses={201: schema.EnrollmentResponse}, auth=[])
    def post(self, request):
        data = _valid(EnrollmentSerializer, request)
        node, credential, secret = services.node_enroll(
            bootstrap_token=data["bootstrap_token"],
            expected_pool=data.get("pool"),
            expected_node=str(data["node"]) if data.get("node") else None,
            hostname=data["hostname"],
            display_name=data["display_name"],
            addresses=data.get("addresses") or [],
            agent_version=data["agent_version"],
            labels=data["labels"],
            capability=data["capability"],
            attestation=dict(data["attestation"]) if data.get("attestation") else None,
            request_id=getattr(request._request, "request_id", ""),
            devices=data.get("devices"),
            boot_id=data.get("boot_id") or "",
        )
        # Read, not refresh_from_db(): django-fsm's refresh lifts the protected flag on the field
        # shared by every thread, and two enrollments at once in a threaded server then fail with
        # "Direct lifecycle modification is not allowed" (seen with the live server).
        lifecycle = Node.objects.filter(pk=node.pk).values_list("lifecycle", flat=True).get()
        timings = pacing.pool_timings(node.pool_id)
        body = {
            "node_id": str(node.pk),
            "incarnation": node.incarnation,
            "credential": secret,
            "credential_expires_at": credential.expires_at,
            "lifecycle": lifecycle,
            # The interval the fleet prescribes now (the pool's own, stretched by the fleet's size),
            # in whole seconds for agents that know only this field; newer agents follow
            # next_renewal_in (aimed at the node's slot) and keep renewal_interval (docs/api-contract.md).
            "heartbeat_interval": math.ceil(timings.interval),
            "renewal_interval": timings.interval,
            "next_renewal_in": liveness.next_heartbeat_in(timings, node_id=node.pk, now=timezone.now()),
            "pool": node.pool.name,
        }
        return Response(body, status=status.HTTP_201_CREATED)


# --- nodes ----------------------------------------------------------------------------------------------


class NodeViewSet(ETagMixin, viewsets.ReadOnlyModelViewSet):
    """Nodes: operators and clients see all, marketplace owners their own (others' are 404)."""

    serializer_class = NodeSerializer
    permission_classes = [IsOperatorOrReadOnlyOwner]
    etag_ignores = ("status_report_age_seconds",)  # the clock's, not the node's: it moves at every read
    filterset_class = NodeFilterSet

    def get_queryset(self):
        return node_queryset_for(self.request.user)


class NodeAdmitView(ETagMixin, APIView):
    """``POST /nodes/{id}/admit`` (operator, If-Match): pending → admitting; checks run on Celery."""

    permission_classes = [IsOperator]

    @extend_schema(request=ReasonSerializer, responses={202: NodeSerializer})
    def post(self, request, pk):
        version = expected_version(request)
        data = _valid(ReasonSerializer, request)
        services.node_admit(
            node_id=pk, expected_version=version, actor=Actor.from_request(request), reason=data["reason"]
        )
        return _node(request, pk, status.HTTP_202_ACCEPTED)


class NodeCredentialIssueView(ETagMixin, APIView):
    """``POST /nodes/{id}/credentials`` (operator, If-Match): a new credential, shown once."""

    permission_classes = [IsOperator]

    @extend_schema(request=CredentialIssueSerializer, responses={201: schema.CredentialResponse})
    def post(self, request, pk):
        version = expected_version(request)
        data = _valid(CredentialIssueSerializer, request)
        node, credential, secret = services.node_credential_issue(
            node_id=pk,
            expected_version=version,
            actor=Actor.from_request(request),
            ttl_seconds=data.get("ttl_seconds"),
            reason=data["reason"],
        )
        body = {
            "node_id": str(node.pk),
            "credential": secret,
            "expires_at": credential.expires_at,
            "issuer": credential.issuer,
            "version": node.version,
        }
        return Response(body, status=status.HTTP_201_CREATED)


class NodeCredentialRevokeView(ETagMixin, APIView):
    """``POST /nodes/{id}/credentials/revoke`` (operator, If-Match): that node's credentials only."""

    permission_classes = [IsOperator]

    @extend_schema(request=ReasonSerializer, responses={200: schema.RevocationResponse})
    def post(self, request, pk):
        version = expected_version(request)
        data = _valid(ReasonSerializer, request)
        node, count = services.node_credentials_revoke(
            node_id=pk, expected_version=version, actor=Actor.from_request(request), reason=data["reason"]
        )
        return Response({"node_id": str(node.pk), "revoked": count, "version": node.version})


def _own_node(request):
    node = node_from_request(request)
    if node.lifecycle == Lifecycle.RETIRED:
        raise Gone("This node is retired.", NODE_RETIRED)
    return node


class NodeCredentialRotateView(APIView):
    """``POST /nodes/{id}/credentials/rotate`` (the node's own credential)."""

    permission_classes = [IsNodeSelf]
    throttle_classes: list = []

    @extend_schema(request=CredentialRotateSerializer, responses={201: schema.RotationResponse})
    def post(self, request, pk):
        node = _own_node(request)
        data = _valid(CredentialRotateSerializer, request)
        new, secret, previous_valid_until = services.node_credential_rotate(
            node=node,
            credential=request._request.node_credential,
            agent_version=data["agent_version"],
            request_id=getattr(request._request, "request_id", ""),
        )
        body = {"credential": secret, "expires_at": new.expires_at, "previous_valid_until": previous_valid_until}
        return Response(body, status=status.HTTP_201_CREATED)


class BenchmarkResultView(APIView):
    """``POST /nodes/{id}/benchmarks/{nonce}`` (the node's own credential): benchmark figures."""

    permission_classes = [IsNodeSelf]
    throttle_classes: list = []
    max_body_bytes = 16 * 1024

    @extend_schema(request=BenchmarkResultSerializer, responses={200: schema.BenchmarkResponse})
    def post(self, request, pk, nonce):
        node = _own_node(request)
        figures = _valid(BenchmarkResultSerializer, request)
        bench = benchmarks.benchmark_complete(
            node=node,
            nonce=nonce,
            figures=dict(figures),
            actor=Actor.for_node(node, getattr(request._request, "request_id", "")),
            now=timezone.now(),
        )
        return Response({"nonce": bench.nonce, "status": bench.status, "completed_at": bench.completed_at})


def _node(request, node_id, status_code=status.HTTP_200_OK) -> Response:
    node = node_queryset_for(request.user).filter(pk=node_id).first()
    if node is None:
        raise NotFound("No such node.", NODE_NOT_FOUND)
    return Response(NodeSerializer(node, context={"request": request}).data, status=status_code)
