"""OpenAPI (drf-spectacular) response shapes of the fleet endpoints (the node credential scheme is
registered once, in nodepool/api/schema.py)."""

from drf_spectacular.utils import inline_serializer
from rest_framework import serializers

EnrollmentResponse = inline_serializer(
    "EnrollmentResponse",
    {
        "node_id": serializers.UUIDField(),
        "incarnation": serializers.IntegerField(),
        "credential": serializers.CharField(),
        "credential_expires_at": serializers.DateTimeField(),
        "lifecycle": serializers.CharField(),
        "heartbeat_interval": serializers.IntegerField(),
        "renewal_interval": serializers.FloatField(),
        "next_renewal_in": serializers.FloatField(),
        "pool": serializers.CharField(),
    },
)
CredentialResponse = inline_serializer(
    "CredentialResponse",
    {
        "node_id": serializers.UUIDField(),
        "credential": serializers.CharField(),
        "expires_at": serializers.DateTimeField(),
        "issuer": serializers.CharField(),
        "version": serializers.IntegerField(),
    },
)
RotationResponse = inline_serializer(
    "RotationResponse",
    {
        "credential": serializers.CharField(),
        "expires_at": serializers.DateTimeField(),
        "previous_valid_until": serializers.DateTimeField(),
    },
)
RevocationResponse = inline_serializer(
    "RevocationResponse",
    {"node_id": serializers.UUIDField(), "revoked": serializers.IntegerField(), "version": serializers.IntegerField()},
)
BenchmarkResponse = inline_serializer(
    "BenchmarkResponse",
    {"nonce": serializers.CharField(), "status": serializers.CharField(), "completed_at": serializers.DateTimeField()},
)
