"""POST /api/v1/nodes/{id}/metrics: detailed metrics with their own limits, off the heartbeat path."""

from __future__ import annotations

import pytest
from django.core.cache import cache

from fleet.models import NodeMetrics
from tests.factories import PoolFactory, make_schedulable_node, set_lifecycle
from tests.heartbeat_support import node_api

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_throttle():
    cache.clear()


@pytest.fixture
def node_secret():
    return make_schedulable_node(PoolFactory())


def post(api, node, body, **kwargs):
    return api.post(f"/api/v1/nodes/{node.pk}/metrics", body, format="json", **kwargs)


def test_metrics_are_stored_apart_from_the_heartbeat(node_secret):
    node, secret = node_secret
    body = {"observed_at": "2026-11-29T09:00:00Z", "metrics": {"gpu_temp_c": {"0": 61.5, "1": 63}, "load1": 0.7}}
    response = post(node_api(secret), node, body)
    assert response.status_code == 202 and response.json()["series"] == 2
    assert NodeMetrics.objects.get(node=node).metrics == body["metrics"]
    node.refresh_from_db()
    assert node.sequence == -1  # not a heartbeat


def test_metrics_beyond_their_limits_are_refused_and_nothing_is_stored(node_secret):
    node, secret = node_secret
    api = node_api(secret)
    too_many = {"metrics": {f"m{i}": i for i in range(513)}}
    response = post(api, node, too_many)
    assert response.status_code == 422 and response.json()["code"] == "metrics_limit_exceeded"
    huge = {"metrics": {"blob": {str(i): i for i in range(20_000)}}}
    assert post(api, node, huge).status_code == 413
    assert post(api, node, {"metrics": {"x": "hot"}}).status_code == 400
    assert post(api, node, {"metrics": [1]}).status_code == 400
    assert not NodeMetrics.objects.exists()


def test_metrics_have_their_own_rate_per_node(node_secret, settings):
    settings.NODEPOOL = {**settings.NODEPOOL, "METRICS_RATE": "2/min"}
    node, secret = node_secret
    api = node_api(secret)
    codes = [post(api, node, {"metrics": {"load1": 1}}).status_code for _ in range(3)]
    assert codes == [202, 202, 429]
    other, other_secret = make_schedulable_node(node.pool)
    assert post(node_api(other_secret), other, {"metrics": {"load1": 1}}).status_code == 202


def test_metrics_of_another_node_or_a_retired_node_are_refused(node_secret):
    node, secret = node_secret
    other, _ = make_schedulable_node(node.pool)
    assert post(node_api(secret), other, {"metrics": {}}).status_code == 403
    set_lifecycle(node, "retired")
    response = post(node_api(secret), node, {"metrics": {}})
    assert response.status_code == 410 and response.json()["code"] == "node_retired"
