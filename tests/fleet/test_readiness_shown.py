"""Stale is never shown as healthy (issue 33 item 2): once a node is unreachable, lost or never heard
from, its readiness and health are shown as unknown, in the API, /metrics, the overview data and the
CLI, while the last reported values (and their time) are kept beside them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.choices import Health, Liveness
from fleet.fleet_state import refresh as refresh_fleet_state
from fleet.models import Node
from fleet.readiness import readiness_state
from leases.overview import fleet_overview
from nodepoolctl.describe import describe_node
from nodepoolctl.render import health, ready
from tests.factories import NodeFactory, PoolFactory, make_schedulable_node
from tests.metrics_support import samples, scrape

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet():
    """general: one alive node, one stale (within grace), one unreachable, one lost, one never heard from."""
    pool = PoolFactory(name="general")
    nodes = {}
    for name, liveness in (
        ("alive", Liveness.ALIVE),
        ("stale", Liveness.STALE),
        ("unreachable", Liveness.UNREACHABLE),
        ("lost", Liveness.LOST),
    ):
        node, _ = make_schedulable_node(pool, hostname=name)
        heard = timezone.now() - timedelta(minutes=5)
        Node.objects.filter(pk=node.pk).update(liveness=liveness, last_status_report_at=heard, last_heartbeat_at=heard)
        nodes[name] = node
    nodes["silent"] = NodeFactory(pool=pool, hostname="silent")  # enrolled, never heard from
    return nodes


def node_json(api, node) -> dict:
    response = api.get(f"/api/v1/nodes/{node.pk}")
    assert response.status_code == 200
    return response.json()


@pytest.mark.parametrize(
    ("name", "readiness", "health_state"),
    [
        ("alive", "ready", "healthy"),
        ("stale", "ready", "healthy"),
        ("unreachable", "unknown", "unknown"),
        ("lost", "unknown", "unknown"),
        ("silent", "unknown", "unknown"),
    ],
)
def test_the_api_shows_unknown_beside_the_reported_values(operator_api, fleet, name, readiness, health_state):
    body = node_json(operator_api, fleet[name])
    assert body["readiness"] == readiness
    assert body["health_state"] == health_state
    if name != "silent":  # the reported values keep their meaning
        assert body["ready"] is True
        assert body["health"] == "healthy"
        assert body["reported_readiness"]["ready"] is True
        assert body["reported_health"]["health"] == "healthy"
        assert body["reported_health"]["reported_at"] is not None


def test_a_node_that_reports_not_ready_is_not_ready_while_alive():
    assert readiness_state(liveness=Liveness.ALIVE, ready=False) == "not_ready"
    assert readiness_state(liveness=Liveness.UNREACHABLE, ready=False) == "unknown"


def test_metrics_count_readiness_and_health_as_shown(client, fleet):
    refresh_fleet_state()
    found = samples(scrape(client))

    def count(name, **labels):
        return found.get((name, frozenset({"pool": "general", **labels}.items())), 0)

    assert count("nodepool_nodes_readiness", readiness="ready") == 2
    assert count("nodepool_nodes_readiness", readiness="unknown") == 3
    assert count("nodepool_nodes_readiness", readiness="not_ready") == 0
    assert count("nodepool_nodes_health", health="healthy") == 2
    assert count("nodepool_nodes_health", health="unknown") == 3


def test_the_overview_counts_silent_nodes_as_unknown_not_healthy(fleet):
    refresh_fleet_state()
    entry = next(e for e in fleet_overview() if e["pool"].name == "general")
    assert entry["health"] == {Health.HEALTHY: 2, Health.UNKNOWN: 3}
    assert entry["readiness"] == {"ready": 2, "unknown": 3}


def test_the_cli_prints_ready_unknown_with_the_last_reported_value(operator_api, fleet):
    from rich.console import Console

    body = node_json(operator_api, fleet["unreachable"])
    assert ready(body) == "Unknown"
    assert health(body) == "unknown"
    assert ready(node_json(operator_api, fleet["alive"])) == "True"
    assert ready({"ready": True}) == "True"  # a server without readiness: the boolean
    console = Console(width=200, record=True)
    console.print(describe_node(body, [], []))
    text = console.export_text()
    assert "Unknown (last reported True 5m ago)" in text
    assert "unknown (last reported healthy 5m ago)" in text
