"""``POST /api/v1/nodes/{id}/heartbeats`` and ``POST /api/v1/nodes/{id}/metrics`` (node credential only).

Thin views: authenticate (``fleet.authentication``: the credential lookup also loads the node
and its pool), validate (heartbeat_serializers), call one service, shape the response.
"""

from __future__ import annotations

from django.db import connections, router
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from nodepool.api.authentication import UserTokenAuthentication
from nodepool.api.problems import Gone

from .. import conf, metrics
from .. import heartbeats as hb
from ..authentication import IsNodeSelf, NodeCredentialAuthentication, node_from_request
from ..choices import Lifecycle
from ..errors import NODE_RETIRED
from ..events import Actor
from ..models import Node, NodeCredential, NodeMetrics, Pool
from .heartbeat_serializers import parse_heartbeat, parse_metrics


class HeartbeatAuthentication(NodeCredentialAuthentication):
    """The node credential check of :class:`NodeCredentialAuthentication`, with a cheaper lookup.

    The heartbeat is the hottest path of the control plane, and the ORM lookup of the credential
    with its node and pool (~100 columns, a dozen JSON) cost more CPU than the rest of the
    heartbeat together, most of it compiling the same query again on every request. This loads
    only the columns a heartbeat reads with one fixed SQL statement and builds the instances as
    the ORM does (``Model.from_db`` after the fields' and the backend's converters). Every other
    field is deferred: Django loads it with one query on access, so callees stay correct. The
    checks (secret digest, revocation, expiry) are the base class's, unchanged.
    """

    CREDENTIAL_FIELDS = ("id", "node", "prefix", "secret_hash", "issued_at", "expires_at", "revoked_at")
    NODE_FIELDS = (
        "id", "pool", "lifecycle", "liveness", "liveness_changed_at", "last_heartbeat_at", "next_liveness_check_at",
        "ready", "ready_reason", "conditions", "health", "health_reasons", "incarnation", "sequence",
        "restart_count", "agent_version", "usage", "version", "instructions", "interval_given",
        "status_report_not_before", "status_report_overdue",
    )  # fmt: skip
    POOL_FIELDS = (
        "id", "name", "heartbeat_interval", "status_report_interval", "heartbeat_grace", "loss_threshold",
        "unhealthy_conditions", "degraded_conditions", "trust_node_labels", "allowed_agent_versions",
        "allowed_undeclared_resources",
    )  # fmt: skip
    _statements: dict = {}

    @classmethod
    def _statement(cls, alias: str):
        """``(sql, [(model, attnames, [(column, converters)])])`` for a database alias, built once."""
        if alias not in cls._statements:
            conn = connections[alias]
            quote = conn.ops.quote_name
            parts, columns = [], []
            for table, model, names in (
                ("c", NodeCredential, cls.CREDENTIAL_FIELDS),
                ("n", Node, cls.NODE_FIELDS),
                ("p", Pool, cls.POOL_FIELDS),
            ):
                # In the model's own field order: Model.from_db() fills the given values in that order.
                wanted = {model._meta.get_field(name).attname for name in names}
                fields = [field for field in model._meta.concrete_fields if field.attname in wanted]
                columns += [f"{table}.{quote(field.column)}" for field in fields]
                converted = [
                    (field.get_col(table), [*conn.ops.get_db_converters(field.get_col(table)),
                                            *field.get_db_converters(conn)])
                    for field in fields
                ]  # fmt: skip
                parts.append((model, [field.attname for field in fields], converted))
            sql = (
                f"SELECT {', '.join(columns)} FROM {quote(NodeCredential._meta.db_table)} c "  # noqa: S608
                f"JOIN {quote(Node._meta.db_table)} n ON n.{quote('id')} = c.{quote('node_id')} "
                f"JOIN {quote(Pool._meta.db_table)} p ON p.{quote('id')} = n.{quote('pool_id')} "
                f"WHERE c.{quote('prefix')} = %s"
            )
            cls._statements[alias] = (sql, parts)
        return cls._statements[alias]

    def find_credential(self, prefix: str) -> NodeCredential | None:
        alias = router.db_for_read(NodeCredential)
        sql, parts = self._statement(alias)
        with connections[alias].cursor() as cursor:
            cursor.execute(sql, [prefix])
            row = cursor.fetchone()
        if row is None:
            return None
        instances, offset = [], 0
        for model, attnames, converted in parts:
            values = []
            for (column, converters), value in zip(converted, row[offset : offset + len(attnames)], strict=True):
                for converter in converters:
                    value = converter(value, column, connections[alias])
                values.append(value)
            instances.append(model.from_db(alias, attnames, values))
            offset += len(attnames)
        credential, node, pool = instances
        Node._meta.get_field("pool").set_cached_value(node, pool)
        NodeCredential._meta.get_field("node").set_cached_value(credential, node)
        return credential


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
