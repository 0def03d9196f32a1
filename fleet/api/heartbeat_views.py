"""``POST /api/v1/nodes/{id}/heartbeats`` and ``POST /api/v1/nodes/{id}/metrics`` (node credential only).

Thin views: authenticate (``fleet.authentication``: the credential lookup also loads the node
and its pool), validate (heartbeat_serializers), call one service, shape the response.
"""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from nodepool.api.authentication import UserTokenAuthentication
from nodepool.api.problems import Gone

from .. import conf, metrics, sql
from .. import heartbeats as hb
from ..authentication import IsNodeSelf, NodeCredentialAuthentication, node_from_request
from ..choices import Lifecycle
from ..errors import NODE_RETIRED
from ..events import Actor
from ..models import NodeCredential, NodeMetrics
from .heartbeat_serializers import parse_heartbeat, parse_metrics
from .schema import HeartbeatSerializer


class HeartbeatAuthentication(NodeCredentialAuthentication):
    """The node credential check of :class:`NodeCredentialAuthentication`, with a cheaper lookup.

    The heartbeat is the hottest path of the control plane, and the ORM lookup of the credential
    with its node and pool (~100 columns, a dozen JSON) cost more CPU than the rest of the
    heartbeat together, most of it compiling the same query again on every request. This loads
    only the columns a heartbeat reads with one fixed statement (``fleet.sql``); every other field
    is deferred. The checks (secret digest, revocation, expiry) are the base class's, unchanged.
    """

    def find_credential(self, prefix: str) -> NodeCredential | None:
        return sql.credential_with_node_and_pool(prefix)


class HeartbeatView(APIView):
    """Apply a heartbeat (the status report); 200 whether applied or not (``applied`` and ``code``).

    Limits: body ≤ 64 KiB (413), ≤ 32 conditions, ≤ 256 leases, ≤ 32 usage entries, bounded strings
    (422). No DRF throttle: the flood guard is the service's (429 with ``Retry-After`` sooner than
    half the interval told, fleet.heartbeats), checked against the row the UPDATE compares with.
    """

    # A user token is recognised only to be refused with 403 (a user with no role, issue 11).
    authentication_classes = [HeartbeatAuthentication, UserTokenAuthentication]
    permission_classes = [IsNodeSelf]
    throttle_classes: list = []
    max_body_bytes = hb.MAX_BODY_BYTES

    @extend_schema(
        request=HeartbeatSerializer,  # parse_heartbeat's rules (tests/fleet/test_validator_equivalence.py)
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
        metrics.count(metrics.STATUS_REPORT, outcome.code)
        metrics.prescribed(outcome.next_heartbeat_in)
        return Response(heartbeat_response(outcome))

    def handle_exception(self, exc):
        response = super().handle_exception(exc)
        code = response.data.get("code", "error") if isinstance(response.data, dict) else "error"
        metrics.count(metrics.STATUS_REPORT, code)
        return response


def heartbeat_response(outcome: hb.HeartbeatOutcome) -> dict:
    """The heartbeat response body of docs/api-contract.md."""
    node = outcome.node
    body = {
        "applied": outcome.applied,
        "code": outcome.code,
        "server_time": outcome.received_at,
        "next_heartbeat_in": outcome.next_heartbeat_in,
        # Agents that renew (POST /nodes/{id}/renewals) read these; older agents ignore them.
        "next_renewal_in": outcome.next_heartbeat_in,
        "renewal_interval": outcome.renewal_interval,
        "status_report_interval": outcome.status_report_interval,
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
            **outcome.instructions,
        },
    }
    if outcome.assigned_leases is not None:
        # Omitted (not []) when the server does not say, e.g. for a heartbeat not applied.
        body["leases"] = outcome.assigned_leases
    return body


class NodeMetricsThrottle(SimpleRateThrottle):
    """Per-node rate for detailed metrics: ``NODEPOOL["METRICS_RATE"]`` (default 12/min)."""

    scope = "node_metrics"

    def get_rate(self):
        return conf.get("METRICS_RATE")

    def get_cache_key(self, request, view):
        node = node_from_request(request)
        return self.cache_format % {"scope": self.scope, "ident": node.pk} if node else None


class NodeMetricsView(APIView):
    """Store the node's latest detailed metrics (202). Its own limits: body ≤ 128 KiB (413),
    ≤ 512 series (422), ``NODEPOOL["METRICS_RATE"]`` per node (429)."""

    authentication_classes = [NodeCredentialAuthentication, UserTokenAuthentication]
    permission_classes = [IsNodeSelf]
    throttle_classes = [NodeMetricsThrottle]

    @property
    def max_body_bytes(self):
        return conf.get("METRICS_MAX_BODY_BYTES")

    @extend_schema(
        request=OpenApiTypes.OBJECT,
        responses={202: OpenApiTypes.OBJECT},
        summary="Report detailed metrics (node credential)",
    )
    def post(self, request, pk):
        node = node_from_request(request)
        if node.lifecycle == Lifecycle.RETIRED:
            raise Gone("This node is retired.", NODE_RETIRED)
        observed_at, metrics = parse_metrics(request.data)
        now = timezone.now()
        NodeMetrics.objects.update_or_create(
            node_id=node.pk, defaults={"received_at": now, "observed_at": observed_at, "metrics": metrics}
        )
        return Response({"accepted": True, "series": len(metrics), "received_at": now}, status=202)
