"""Pool capacity and placement previews: read-only answers to "can this pool serve X now?"."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet.errors import POOL_NOT_FOUND
from fleet.models import Pool
from fleet.selectors import pool_capacity
from nodepool.api.permissions import IsClientOrOperator, IsOperatorOrReadOnlyOwner
from nodepool.api.problems import NotFound

from .. import preview
from . import schema


class PoolCapacity(APIView):
    """``GET /pools/{name}/capacity``: allocatable, allocated and free per resource, the largest free
    block (fragmentation), node counts per state, the Node Ready ratio and each request class's
    "can serve N now"."""

    permission_classes = [IsOperatorOrReadOnlyOwner]

    @extend_schema(responses=schema.PoolCapacityResponse)
    def get(self, request, name: str):
        pool = Pool.objects.filter(name=name).first()
        if pool is None:
            raise NotFound(f"No pool named {name!r}.", POOL_NOT_FOUND)
        capacity = pool_capacity(pool)
        return Response(
            {
                "pool": pool.name,
                **capacity,
                "ready_ratio_objective": pool.ready_ratio_objective,
                "request_classes": preview.request_class_fits(pool),
            }
        )


class PlacementPreviews(APIView):
    """``POST /placement-previews``: a dry run of lease grants. Writes nothing; answers 200 per pool,
    with the 409 ``unschedulable`` explanation of each pool where none fits."""

    permission_classes = [IsClientOrOperator]

    @extend_schema(request=schema.PlacementPreviewRequest, responses=schema.PlacementPreviewResponse)
    def post(self, request):
        return Response(preview.placement_preview(data=request.data))
