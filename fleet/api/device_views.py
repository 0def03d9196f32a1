"""Devices of a node: ``GET /nodes/{id}/devices`` and the operator's device actions.

``POST /nodes/{id}/devices/{device_id}/verify | taint | untaint | release`` carry the node's
expected version (``If-Match`` with the node's ETag, or ``expected_version``), like every node
action, and bump it. Thin: validate, call one service of :mod:`fleet.devices`, shape the answer.
"""

from __future__ import annotations

import copy

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from nodepool.api.permissions import IsOperator, IsOperatorOrReadOnlyOwner
from nodepool.api.problems import NotFound
from nodepool.api.versioning import ETagMixin, expected_version

from .. import devices, reverification_view
from ..errors import NODE_NOT_FOUND
from ..events import Actor
from ..models import Device, Node
from ..selectors import node_queryset_for
from .serializers import ReasonSerializer, StrictSerializer


def device_representation(row: Device) -> dict:
    """The wire shape of one device (docs/api-contract.md, "Devices")."""
    return {
        "id": row.device_id,
        "type": row.type,
        "index": row.index,
        "model": row.model,
        "memory_bytes": row.memory_bytes,
        "mig_profile": row.mig_profile or None,
        "parent": row.parent_device_id or None,
        "pci_bus_id": row.pci_bus_id or None,
        "numa_node": row.numa_node,
        "interconnect_group": row.interconnect_group or None,
        "serial": row.serial or None,
        "driver_version": row.driver_version or None,
        "cuda_version": row.cuda_version or None,
        "declared": row.declared,
        "measured": row.measured,
        "verified": row.verified,
        "verified_at": row.verified_at.isoformat() if row.verified_at else None,
        "verified_by": row.verified_by,
        "allocatable": row.allocatable,
        "health": row.health,
        "health_detail": row.health_detail,
        "last_fault_at": row.last_fault_at.isoformat() if row.last_fault_at else None,
        "held": row.held,
        "taints": row.taints,
        "first_seen_at": row.first_seen_at.isoformat(),
        "last_seen_at": row.last_seen_at.isoformat(),
        "retired_at": row.retired_at.isoformat() if row.retired_at else None,
        "retired_reason": row.retired_reason,
    }


DeviceSchema = inline_serializer(
    "Device",
    {
        "id": serializers.CharField(),
        "type": serializers.CharField(),
        "index": serializers.IntegerField(),
        "model": serializers.CharField(),
        "memory_bytes": serializers.IntegerField(allow_null=True),
        "mig_profile": serializers.CharField(allow_null=True),
        "parent": serializers.CharField(allow_null=True),
        "numa_node": serializers.IntegerField(allow_null=True),
        "interconnect_group": serializers.CharField(allow_null=True),
        "verified_at": serializers.DateTimeField(allow_null=True),
        "allocatable": serializers.BooleanField(),
        "health": serializers.CharField(),
        "held": serializers.BooleanField(),
        "taints": serializers.ListField(child=serializers.JSONField()),
    },
)


class DeviceTaintSerializer(StrictSerializer):
    key = serializers.CharField(max_length=317)
    value = serializers.CharField(max_length=63, required=False, allow_blank=True, default="")
    effect = serializers.ChoiceField(choices=["NoSchedule", "PreferNoSchedule", "NoExecute"])
    reason = serializers.CharField(max_length=1000)


class DeviceUntaintSerializer(StrictSerializer):
    key = serializers.CharField(max_length=317)
    reason = serializers.CharField(max_length=1000, required=False, allow_blank=True, default="")


def _valid(serializer_class, request) -> dict:
    serializer = serializer_class(data=request.data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


class NodeDeviceList(APIView):
    """``GET /nodes/{id}/devices``: the node's devices, retired ones last (``?retired=false`` hides them)."""

    permission_classes = [IsOperatorOrReadOnlyOwner]

    @extend_schema(responses={200: serializers.ListSerializer(child=copy.deepcopy(DeviceSchema))})
    def get(self, request, pk):
        if not node_queryset_for(request.user).filter(pk=pk).exists():
            raise NotFound("No such node.", NODE_NOT_FOUND)
        rows = Device.objects.filter(node_id=pk).order_by("retired_at", "type", "index", "device_id")
        if request.query_params.get("retired") == "false":
            rows = rows.filter(retired_at__isnull=True)
        return Response([device_representation(row) for row in rows[:1024]])


class NodeVerificationView(APIView):
    """``GET /nodes/{id}/verification``: whether the node is verified now, and if not why and what to
    do, with its re-verification history (fleet.reverification_view.verification_view). Operators and the
    node's owner; never the next check's due time (the node must not learn it in advance)."""

    permission_classes = [IsOperatorOrReadOnlyOwner]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, pk):
        if not node_queryset_for(request.user).filter(pk=pk).exists():
            raise NotFound("No such node.", NODE_NOT_FOUND)
        return Response(reverification_view.verification_view(Node.objects.select_related("pool").get(pk=pk)))


class _DeviceAction(ETagMixin, APIView):
    permission_classes = [IsOperator]
    serializer_class = ReasonSerializer

    def act(self, request, pk, device_id, data, version):  # pragma: no cover - overridden
        raise NotImplementedError

    def post(self, request, pk, device_id):
        version = expected_version(request)
        data = _valid(self.serializer_class, request)
        row = self.act(request, pk, device_id, data, version)
        return Response(device_representation(row), status=status.HTTP_200_OK)


class DeviceVerifyView(_DeviceAction):
    """``POST /nodes/{id}/devices/{device_id}/verify`` (operator): accept the device as it is now."""

    @extend_schema(request=ReasonSerializer, responses={200: DeviceSchema})
    def post(self, request, pk, device_id):
        return super().post(request, pk, device_id)

    def act(self, request, pk, device_id, data, version):
        return devices.device_verify(
            node_id=pk, device_id=device_id, actor=Actor.from_request(request), reason=data["reason"],
            expected_version=version,
        )  # fmt: skip


class DeviceTaintView(_DeviceAction):
    """``POST /nodes/{id}/devices/{device_id}/taint`` (operator): taint one device, with a reason."""

    serializer_class = DeviceTaintSerializer

    @extend_schema(request=DeviceTaintSerializer, responses={200: DeviceSchema})
    def post(self, request, pk, device_id):
        return super().post(request, pk, device_id)

    def act(self, request, pk, device_id, data, version):
        return devices.device_taint(
            node_id=pk, device_id=device_id, key=data["key"], value=data["value"], effect=data["effect"],
            reason=data["reason"], actor=Actor.from_request(request), expected_version=version,
        )  # fmt: skip


class DeviceUntaintView(_DeviceAction):
    """``POST /nodes/{id}/devices/{device_id}/untaint`` (operator): remove one taint by key."""

    serializer_class = DeviceUntaintSerializer

    @extend_schema(request=DeviceUntaintSerializer, responses={200: DeviceSchema})
    def post(self, request, pk, device_id):
        return super().post(request, pk, device_id)

    def act(self, request, pk, device_id, data, version):
        return devices.device_untaint(
            node_id=pk, device_id=device_id, key=data["key"], reason=data["reason"],
            actor=Actor.from_request(request), expected_version=version,
        )  # fmt: skip


class DeviceReleaseView(_DeviceAction):
    """``POST /nodes/{id}/devices/{device_id}/release`` (operator): release a device held for flapping."""

    @extend_schema(request=ReasonSerializer, responses={200: DeviceSchema})
    def post(self, request, pk, device_id):
        return super().post(request, pk, device_id)

    def act(self, request, pk, device_id, data, version):
        return devices.device_release(
            node_id=pk, device_id=device_id, reason=data["reason"], actor=Actor.from_request(request),
            expected_version=version,
        )  # fmt: skip
