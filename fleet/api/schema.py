"""OpenAPI (drf-spectacular) descriptions for fleet: the node credential scheme and response shapes."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import inline_serializer
from rest_framework import serializers


class NodeCredentialScheme(OpenApiAuthenticationExtension):
    target_class = "fleet.authentication.NodeCredentialAuthentication"
    name = "nodeCredential"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": "Node credentials: `Authorization: Node npn_<prefix>.<secret>`.",
        }


EnrollmentResponse = inline_serializer(
    "EnrollmentResponse",
    {
        "node_id": serializers.UUIDField(),
        "incarnation": serializers.IntegerField(),
        "credential": serializers.CharField(),
        "credential_expires_at": serializers.DateTimeField(),
        "lifecycle": serializers.CharField(),
        "heartbeat_interval": serializers.IntegerField(),
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
