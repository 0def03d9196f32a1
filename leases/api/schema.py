"""OpenAPI (drf-spectacular) shapes of lease request bodies.

The services validate the raw JSON themselves (leases.spec, leases.fencing) so that every bad
field gets a stable problem code; these serializers only describe the bodies for the docs. The lease
request's (and a placement preview's) is stated in full in leases.api.spec_schema and tested for
equivalence with leases.spec.parse_spec.
"""

from drf_spectacular.utils import inline_serializer
from rest_framework import serializers

from ..device_requests import MAX_DEVICE_REQUESTS
from .spec_schema import DeviceRequestSerializer, LeaseCreateRequestSerializer, PlacementPreviewRequestSerializer

_quantities = serializers.DictField(child=serializers.CharField(), help_text='Kubernetes quantities: {"cpu": "500m"}')

LeaseCreateRequest = LeaseCreateRequestSerializer
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
    "FencingValidateRequest",
    {
        "workload_id": serializers.CharField(required=False),
        "fencing_token": serializers.IntegerField(min_value=0, required=False),
        "lease_secret": serializers.CharField(
            required=False,
            help_text="the lease's own secret: with workload_id and fencing_token, the right to see that lease; "
            "alone, a self-contained check of the secret (docs/marketplace.md)",
        ),
    },
)
FencingValidateResponse = inline_serializer(
    "FencingValidateResponse",
    {
        "valid": serializers.BooleanField(),
        "current_token": serializers.IntegerField(allow_null=True, help_text="null when no lease is live"),
        "last_issued_token": serializers.IntegerField(allow_null=True, required=False),
        "lease_id": serializers.UUIDField(allow_null=True),
        "code": serializers.CharField(required=False, help_text="the lease-secret check's verdict"),
    },
)
ShapeCreateRequest = inline_serializer(
    "ShapeCreateRequest",
    {
        "name": serializers.SlugField(),
        "resources": _quantities,
        "features": serializers.JSONField(required=False),
        "devices": serializers.ListField(
            child=DeviceRequestSerializer(), required=False, max_length=MAX_DEVICE_REQUESTS
        ),
        "description": serializers.CharField(required=False),
    },
)

PlacementPreviewRequest = PlacementPreviewRequestSerializer
PlacementPreviewResponse = inline_serializer(
    "PlacementPreviewResponse",
    {
        "count": serializers.IntegerField(),
        "fits": serializers.IntegerField(help_text="such leases that fit now, summed over the pools"),
        "pools": serializers.ListField(
            child=serializers.JSONField(),
            help_text="[{pool, requested, fits, placeable, placements: [{node_id, hostname, leases}], unschedulable, "
            "after_scale_up: null | {max_nodes, nodes_to_add, per_node, fits, placeable, cause, reason, message, "
            "too_large?}}]",
        ),
    },
)
PoolCapacityResponse = inline_serializer(
    "PoolCapacityResponse",
    {
        "pool": serializers.CharField(),
        "resources": serializers.JSONField(help_text="{name: {allocatable, allocated, free, largest_free_block}}"),
        "devices": serializers.JSONField(
            help_text="{type: {model: {total, allocatable, allocated, free, health: {state: n}}}}: live devices "
            "by type and normalised model (a known model or other)"
        ),
        "nodes": serializers.JSONField(
            help_text="{total, schedulable, ready, in_service, lifecycle, liveness, health}"
        ),
        "ready_ratio": serializers.FloatField(allow_null=True),
        "ready_ratio_objective": serializers.FloatField(),
        "request_classes": serializers.JSONField(help_text='[{"name", "fits"}]: can serve N now'),
    },
)
