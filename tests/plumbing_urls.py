"""A test-only urlconf: small DRF views that exercise the shared API plumbing.

Used with ``@pytest.mark.urls("tests.plumbing_urls")``; the real API's routes are mounted too
so that the same tests can reach ``/api/v1/``.
"""

from __future__ import annotations

import time

from django.db import transaction
from django.shortcuts import get_object_or_404
from django.urls import include, path
from rest_framework import serializers
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from fleet.models import Pool
from nodepool.api.permissions import IsOperator
from nodepool.api.versioning import ETagMixin, expected_version, lock_for_action
from nodepool.urls import handler400, handler403, handler404, handler500  # noqa: F401
from nodepool.urls import urlpatterns as project_urlpatterns


class ItemSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=10)
    tags = serializers.ListField(child=serializers.CharField(max_length=5), required=False)


class EchoSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=10)
    count = serializers.IntegerField(min_value=0)
    items = ItemSerializer(many=True, required=False)

    def validate(self, attrs):
        if attrs.get("name") == "forbidden":
            raise serializers.ValidationError("This name is reserved.", code="reserved_name")
        return attrs


class EchoView(APIView):
    """POST only: validates its body and echoes it back."""

    permission_classes = [AllowAny]
    throttle_classes: list = []

    def post(self, request):
        serializer = EchoSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        return Response(serializer.validated_data)


class SmallBodyView(EchoView):
    max_body_bytes = 100
    max_json_depth = 3


class OperatorOnlyView(APIView):
    permission_classes = [IsOperator]

    def get(self, request):
        return Response({"ok": True})


class WhoAmIView(APIView):
    permission_classes = [IsAuthenticated]

    def get(self, request):
        authenticator = type(request.successful_authenticator).__name__
        return Response({"username": request.user.get_username(), "auth": authenticator})

    def post(self, request):
        return Response({"username": request.user.get_username(), "received": request.data})


class BurstThrottle(SimpleRateThrottle):
    scope = "plumbing-burst"
    rate = "2/min"

    def get_cache_key(self, request, view):
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


class ThrottledView(APIView):
    permission_classes = [AllowAny]
    throttle_classes = [BurstThrottle]

    def get(self, request):
        return Response({"ok": True})


class CrashView(APIView):
    """An unexpected exception: the one case that may answer 500, still as problem+json."""

    permission_classes = [AllowAny]

    def get(self, request):
        raise RuntimeError("boom")


def pool_body(pool: Pool) -> dict:
    return {"id": pool.pk, "name": pool.name, "description": pool.description, "version": pool.version}


class PoolDetailView(ETagMixin, APIView):
    permission_classes = [IsOperator]

    def get(self, request, pk):
        return Response(pool_body(get_object_or_404(Pool, pk=pk)))


class PoolDescribeView(ETagMixin, APIView):
    """An operator action in the house style: expected version, lock, check, change, bump."""

    permission_classes = [IsOperator]

    def post(self, request, pk):
        expected = expected_version(request)
        description = str(request.data.get("description", ""))
        with transaction.atomic():
            pool = lock_for_action(Pool.objects, pk=pk, expected=expected)
            # Widen the race window so that concurrent tests really overlap.
            time.sleep(float(request.query_params.get("hold", 0)))
            pool.description = description
            pool.version += 1
            pool.save(update_fields=["description", "version", "updated_at"])
        return Response(pool_body(pool))


class PoolTimeoutSerializer(serializers.Serializer):
    # No max_value on purpose: the storage layer is the last line of defence.
    benchmark_timeout = serializers.IntegerField()
    name = serializers.CharField(required=False)


class PoolSetTimeoutView(APIView):
    permission_classes = [IsOperator]

    def post(self, request, pk):
        serializer = PoolTimeoutSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        with transaction.atomic():
            pool = get_object_or_404(Pool.objects.select_for_update(), pk=pk)
            for field, value in serializer.validated_data.items():
                setattr(pool, field, value)
            pool.save()
        return Response(pool_body(pool))


urlpatterns = [
    path("plumbing/echo", EchoView.as_view()),
    path("plumbing/small", SmallBodyView.as_view()),
    path("plumbing/operators-only", OperatorOnlyView.as_view()),
    path("plumbing/whoami", WhoAmIView.as_view()),
    path("plumbing/throttled", ThrottledView.as_view()),
    path("plumbing/crash", CrashView.as_view()),
    path("plumbing/pools/<int:pk>", PoolDetailView.as_view()),
    path("plumbing/pools/<int:pk>/describe", PoolDescribeView.as_view()),
    path("plumbing/pools/<int:pk>/timeout", PoolSetTimeoutView.as_view()),
    path("", include(project_urlpatterns)),
]
