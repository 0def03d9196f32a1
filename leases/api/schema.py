"""OpenAPI (drf-spectacular) shapes of lease request bodies.

The services validate the raw JSON themselves (leases.spec, leases.fencing) so that every bad
field gets a stable problem code; these serializers only describe the bodies for the docs.
"""

import copy

from drf_spectacular.utils import inline_serializer
from rest_framework import serializers

_quantities = serializers.DictField(child=serializers.CharField(), help_text='Kubernetes quantities: {"cpu": "500m"}')

_device_constraint = inline_serializer(
    "DeviceConstraint",
    {
        "attribute": serializers.ChoiceField(
            choices=["memory", "numa_node", "index", "model", "mig_profile", "interconnect_group", "driver_version",
                     "cuda_version", "pci_bus_id"]),
        "operator": serializers.ChoiceField(choices=["=", "!=", ">", ">=", "<", "<=", "glob"]),
        "value": serializers.JSONField(help_text='a number, a quantity ("40Gi") or a string / glob pattern'),
    },
)  # fmt: skip
_device_request = inline_serializer(
    "DeviceRequest",
    {
        "type": serializers.CharField(help_text="a device type '<domain>/<name>', e.g. nvidia.com/gpu"),
        "count": serializers.IntegerField(min_value=1, max_value=64, required=False, default=1),
        "constraints": serializers.ListField(child=copy.deepcopy(_device_constraint), required=False, max_length=16),
        "colocate": serializers.ChoiceField(choices=["interconnect_group", "numa_node"], required=False),
    },
)
_node_constraint = inline_serializer(
    "NodeConstraint",
    {
        "attribute": serializers.CharField(help_text="reliability (the only node attribute so far)"),
        "operator": serializers.CharField(help_text="one of =, !=, >, >=, <, <="),
        "value": serializers.JSONField(help_text='a number from 0 to 1 (or a numeric string such as "0.99")'),
    },
)
_node_preference = inline_serializer(
    "NodePreference",
    {
        "weight": serializers.IntegerField(min_value=1, max_value=100),
        "attribute": serializers.CharField(help_text="reliability (the only node attribute so far)"),
        "operator": serializers.CharField(help_text="one of =, !=, >, >=, <, <="),
        "value": serializers.JSONField(help_text="a number from 0 to 1"),
    },
)
_placement_fields = {
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
        "devices": serializers.ListField(
            child=copy.deepcopy(_device_request), required=False, max_length=8,
            help_text="device requests (docs/leases.md, Devices); their counts join resources",
        ),
        "node_constraints": serializers.ListField(
            child=copy.deepcopy(_node_constraint), required=False, max_length=8,
            help_text="node attribute filters, e.g. reliability >= 0.99 (docs/leases.md, Reliability)",
        ),
        "node_preferences": serializers.ListField(
            child=copy.deepcopy(_node_preference), required=False, max_length=8,
            help_text="weighted node attribute preferences that score (docs/leases.md, Reliability)",
        ),
}  # fmt: skip
LeaseCreateRequest = inline_serializer(
    "LeaseCreateRequest",
    {
        "workload_id": serializers.CharField(max_length=200),
        "pool": serializers.CharField(required=False),
        **copy.deepcopy(_placement_fields),
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
        "devices": serializers.ListField(child=copy.deepcopy(_device_request), required=False, max_length=8),
        "description": serializers.CharField(required=False),
    },
)

PlacementPreviewRequest = inline_serializer(
    "PlacementPreviewRequest",
    {
        **copy.deepcopy(_placement_fields),
        "workload_id": serializers.CharField(max_length=200, required=False),
        "pool": serializers.CharField(required=False, help_text="one pool; omitted: every pool"),
        "count": serializers.IntegerField(required=False, min_value=1, max_value=1000, default=1),
    },
)
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
