"""Helpers shared by the heartbeat and liveness tests (not fixtures: plain functions)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from rest_framework.test import APIClient

from tests.support import node_api  # noqa: F401  (re-exported: the heartbeat tests import it from here)

T0 = datetime(2026, 11, 29, 9, 0, 0, tzinfo=UTC)


def beat(sequence: int = 0, incarnation: int = 1, observed_at: datetime | None = None, **fields) -> dict:
    """A realistic heartbeat body (docs/api-contract.md); ``observed_at`` defaults to the server's now."""
    from django.utils import timezone

    body = {
        "incarnation": incarnation,
        "sequence": sequence,
        "observed_at": (observed_at or timezone.now()).isoformat(),
        "agent_version": "1.0.0",
        "ready": True,
        "ready_reason": "",
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "AgentReady", "message": ""},
            {"type": "MemoryPressure", "status": "False", "reason": "", "message": ""},
            {"type": "DiskPressure", "status": "False", "reason": "", "message": ""},
        ],
        "usage": {"cpu": 1200, "memory": 4 * 2**30},
        "leases": [],
        "benchmark": None,
    }
    body.update(fields)
    return body


def post_beat(api: APIClient, node, **fields):
    return api.post(f"/api/v1/nodes/{node.pk}/heartbeats", beat(**fields), format="json")


def seconds(n: float) -> timedelta:
    return timedelta(seconds=n)


def send(node, sequence: int, incarnation: int = 1, **fields):
    """Apply a heartbeat through the service (no HTTP), at the current (travelled) time."""
    from django.utils import timezone

    from fleet.events import Actor
    from fleet.heartbeats import HeartbeatReport, apply_heartbeat
    from fleet.models import Node

    fresh = Node.objects.select_related("pool").get(pk=node.pk)
    report = HeartbeatReport(
        incarnation=incarnation,
        sequence=sequence,
        observed_at=fields.pop("observed_at", timezone.now()),
        ready=fields.pop("ready", True),
        **fields,
    )
    return apply_heartbeat(node=fresh, report=report, actor=Actor.for_node(fresh))
