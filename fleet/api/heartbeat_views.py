"""``POST /api/v1/nodes/{id}/heartbeats`` and ``POST /api/v1/nodes/{id}/metrics`` (node credential only).

Thin views: authenticate (``fleet.authentication``: the credential lookup also loads the node
and its pool), validate (heartbeat_serializers), call one service, shape the response.
"""

from __future__ import annotations

from django.conf import settings
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from nodepool.api.problems import Gone

from .. import heartbeats as hb
from ..authentication import IsNodeSelf, NodeCredentialAuthentication, node_from_request
from ..choices import Lifecycle
from ..events import Actor
from ..models import NodeMetrics
from .heartbeat_serializers import parse_heartbeat, parse_metrics


class NodeCredentialScheme(OpenApiAuthenticationExtension):
    """OpenAPI: ``Authorization: Node npn_<prefix>.<secret>`` (for every node-credential view)."""

    target_class = "fleet.authentication.NodeCredentialAuthentication"
    name = "nodeCredential"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "header", "name": "Authorization",
                "description": "Node credential: `Node npn_<prefix>.<secret>`"}  # fmt: skip


class HeartbeatAuthentication(NodeCredentialAuthentication):
    """The node credential check, loading only the columns a heartbeat reads.

    The credential, node and pool rows have ~100 columns, a dozen of them JSON; decoding them all
    cost more CPU than the rest of the heartbeat together. Any other field is still there on
    access (Django loads a deferred field with one query), so callees stay correct.
    """

    FIELDS = (
        *("prefix", "secret_hash", "issued_at", "expires_at", "revoked_at"),
        *(
            f"node__{name}"
            for name in (
                "pool",
                "lifecycle",
                "liveness",
                "liveness_changed_at",
                "last_heartbeat_at",
                "next_liveness_check_at",
                "ready",
                "ready_reason",
                "conditions",
                "health",
                "health_reasons",
                "incarnation",
                "sequence",
                "restart_count",
                "agent_version",
                "usage",
                "version",
            )
        ),  # fmt: skip
        *(
            f"node__pool__{name}"
            for name in (
                "name",
                "heartbeat_interval",
                "heartbeat_grace",
                "loss_threshold",
                "unhealthy_conditions",
                "degraded_conditions",
                "trust_node_labels",
            )
        ),  # fmt: skip
    )

    def credential_queryset(self):
        return super().credential_queryset().only(*self.FIELDS)


class HeartbeatView(APIView):
    """Apply a heartbeat; 200 whether applied or not (``applied`` and ``code`` say which).

    Limits: body ≤ 64 KiB (413), ≤ 32 conditions, ≤ 256 leases, ≤ 32 usage entries, bounded strings
    (422). No throttle: ordering makes floods harmless to state, and the interval the response
    gives keeps the fleet under ``NODEPOOL["MAX_HEARTBEATS_PER_SECOND"]``.
    """

    authentication_classes = [HeartbeatAuthentication]
    permission_classes = [IsNodeSelf]
    throttle_classes: list = []
    max_body_bytes = hb.MAX_BODY_BYTES

    @extend_schema(
        request=OpenApiTypes.OBJECT,
        responses={200: OpenApiTypes.OBJECT},
        summary="Send a heartbeat (node credential)",
        auth=[{"nodeCredential": []}],
        description="Body and response: docs/api-contract.md and docs/heartbeats.md.",
    )
    def post(self, request, pk):
        report = parse_heartbeat(request.data)
        node = node_from_request(request)
        outcome = hb.apply_heartbeat(
            node=node,
            report=report,
            actor=Actor.for_node(node, request_id=getattr(request._request, "request_id", "")),
            credential=getattr(request._request, "node_credential", None),
        )
        return Response(heartbeat_response(outcome))


def heartbeat_response(outcome: hb.HeartbeatOutcome) -> dict:
    """The heartbeat response body of docs/api-contract.md."""
    node = outcome.node
    return {
        "applied": outcome.applied,
        "code": outcome.code,
        "server_time": outcome.received_at,
        "next_heartbeat_in": outcome.next_heartbeat_in,
        "incarnation": node.incarnation,
        "sequence": node.sequence,
        "liveness": node.liveness,
        "lifecycle": node.lifecycle,
        "desired_lifecycle": outcome.desired_lifecycle,
        "instructions": {
            "stop_leases": outcome.stop_leases,
            "checkpoint_leases": outcome.checkpoint_leases,
            "run_benchmark": outcome.run_benchmark,
            "rotate_credential": outcome.rotate_credential,
        },
    }


class NodeMetricsThrottle(SimpleRateThrottle):
    """Per-node rate for detailed metrics: ``NODEPOOL["METRICS_RATE"]`` (default 12/min)."""

    scope = "node_metrics"

    def get_rate(self):
        return settings.NODEPOOL.get("METRICS_RATE", "12/min")

    def get_cache_key(self, request, view):
        node = node_from_request(request)
        return self.cache_format % {"scope": self.scope, "ident": node.pk} if node else None


class NodeMetricsView(APIView):
    """Store the node's latest detailed metrics (202). Its own limits: body ≤ 128 KiB (413),
    ≤ 512 series (422), ``NODEPOOL["METRICS_RATE"]`` per node (429)."""

    authentication_classes = [NodeCredentialAuthentication]
    permission_classes = [IsNodeSelf]
    throttle_classes = [NodeMetricsThrottle]

    @property
    def max_body_bytes(self):
        return settings.NODEPOOL.get("METRICS_MAX_BODY_BYTES", 128 * 1024)

    @extend_schema(
        request=OpenApiTypes.OBJECT,
        responses={202: OpenApiTypes.OBJECT},
        summary="Report detailed metrics (node credential)",
    )
    def post(self, request, pk):
        node = node_from_request(request)
        if node.lifecycle == Lifecycle.RETIRED:
            raise Gone("This node is retired.", "node_retired")
        observed_at, metrics = parse_metrics(request.data)
        now = timezone.now()
        NodeMetrics.objects.update_or_create(
            node_id=node.pk, defaults={"received_at": now, "observed_at": observed_at, "metrics": metrics}
        )
        return Response({"accepted": True, "series": len(metrics), "received_at": now}, status=202)
