"""OpenAPI (drf-spectacular) shapes of lease request bodies.

The services validate the raw JSON themselves (leases.spec, leases.fencing) so that every bad
field gets a stable problem code; these serializers only describe the bodies for the docs.
"""

from drf_spectacular.utils import inline_serializer
from rest_framework import serializers

_quantities = serializers.DictField(child=serializers.CharField(), help_text='Kubernetes quantities: {"cpu": "500m"}')

LeaseCreateRequest = inline_serializer(
    "LeaseCreateRequest",
    {
        "workload_id": serializers.CharField(max_length=200),
        "pool": serializers.CharField(required=False),
        "resources": _quantities,
        "shape": serializers.CharField(required=False, help_text="a shape name, or name@version"),
        "node_selector": serializers.DictField(child=serializers.CharField(), required=False),
        "affinity": serializers.JSONField(required=False, help_text="{required: [terms], preferred: [{weight, term}]}"),
        "tolerations": serializers.ListField(child=serializers.JSONField(), required=False),
        "spread": serializers.JSONField(required=False, help_text="{group, topology_key, mode: spread|anti-affinity}"),
        "ttl_seconds": serializers.IntegerField(required=False),
        "priority": serializers.IntegerField(required=False),
        "queue": serializers.BooleanField(required=False),
        "command": serializers.ListField(child=serializers.CharField(), required=False),
    },
)
_fence = {
    "fencing_token": serializers.IntegerField(),
    "node_incarnation": serializers.IntegerField(),
}
LeaseRenewRequest = inline_serializer(
    "LeaseRenewRequest", {**_fence, "ttl_seconds": serializers.IntegerField(required=False)}
)
LeaseReleaseRequest = inline_serializer(
    "LeaseReleaseRequest", {**_fence, "outcome": serializers.CharField(required=False)}
)
LeaseEventRequest = inline_serializer(
    "LeaseEventRequest",
    {
        **_fence,
        "state": serializers.ChoiceField(choices=["running", "checkpointed", "succeeded", "failed"]),
        "message": serializers.CharField(required=False),
    },
)
ExpectedVersionRequest = inline_serializer(
    "ExpectedVersionRequest", {"expected_version": serializers.IntegerField(required=False)}
)
FencingValidateRequest = inline_serializer(
    "FencingValidateRequest", {"workload_id": serializers.CharField(), "fencing_token": serializers.IntegerField()}
)
FencingValidateResponse = inline_serializer(
    "FencingValidateResponse", {"valid": serializers.BooleanField(), "current_token": serializers.IntegerField()}
)
ShapeCreateRequest = inline_serializer(
    "ShapeCreateRequest",
    {
        "name": serializers.SlugField(),
        "resources": _quantities,
        "features": serializers.JSONField(required=False),
        "description": serializers.CharField(required=False),
    },
)
