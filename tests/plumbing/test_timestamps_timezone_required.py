"""One rule for timestamps: every time the API accepts needs an offset or Z (issue 12, case 6).

A heartbeat's ``observed_at`` without an offset was refused, but a drain's ``deadline`` without
one was silently taken as UTC. Now every such time is ``400 timezone_required`` and changes nothing.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.models import BootstrapToken, NodeHold, NodeMetrics
from maintenance.models import Drain
from tests.factories import make_schedulable_node
from tests.heartbeat_support import beat
from tests.maintenance_support import act, make_lease
from tests.support import node_api

pytestmark = pytest.mark.django_db


def naive(minutes: int = 30) -> str:
    return (timezone.now() + timedelta(minutes=minutes)).replace(tzinfo=None).isoformat()


def aware(minutes: int = 30) -> str:
    return (timezone.now() + timedelta(minutes=minutes)).isoformat()


def assert_timezone_required(response, field: str):
    assert response.status_code == 400, response.json()
    assert response["Content-Type"] == "application/problem+json"
    body = response.json()
    assert body["code"] == "timezone_required"
    assert [e["field"] for e in body["errors"]] == [field]


def test_a_drain_deadline_without_an_offset_is_refused_not_taken_as_utc(operator_api):
    node, _ = make_schedulable_node()

    response = act(operator_api, node, "drain", {"reason": "rack", "deadline": naive()})

    assert_timezone_required(response, "deadline")
    node.refresh_from_db()
    assert (node.lifecycle, node.version) == ("ready", 1)
    assert not Drain.objects.exists()


def test_a_drain_deadline_with_an_offset_or_z_is_accepted(operator_api):
    first, _ = make_schedulable_node()
    second, _ = make_schedulable_node(first.pool)
    plus_two = (timezone.now() + timedelta(minutes=30)).astimezone(timezone.get_fixed_timezone(120)).isoformat()
    zulu = (timezone.now() + timedelta(minutes=30)).strftime("%Y-%m-%dT%H:%M:%SZ")

    assert act(operator_api, first, "drain", {"reason": "rack", "deadline": plus_two}).status_code == 201
    assert act(operator_api, second, "drain", {"reason": "rack", "deadline": zulu}).status_code == 201


def test_a_changed_drain_deadline_without_an_offset_is_refused(operator_api):
    node, _ = make_schedulable_node()
    make_lease(node, "job-1")  # so the drain stays active
    drain_id = act(operator_api, node, "drain", {"reason": "rack", "deadline": aware()}).json()["id"]
    before = Drain.objects.get(pk=drain_id).deadline

    response = operator_api.post(
        f"/api/v1/drains/{drain_id}/deadline",
        {"reason": "later", "deadline": naive(60)},
        format="json",
        HTTP_IF_MATCH='"1"',
    )

    assert_timezone_required(response, "deadline")
    drain = Drain.objects.get(pk=drain_id)
    assert (drain.deadline, drain.version) == (before, 1)


def test_a_hold_expiry_without_an_offset_is_refused(operator_api):
    node, _ = make_schedulable_node()

    response = act(operator_api, node, "cordon", {"reason": "check", "expires_at": naive()})

    assert_timezone_required(response, "expires_at")
    assert not NodeHold.objects.exists()


def test_a_bootstrap_token_expiry_without_an_offset_is_refused(operator_api):
    node, _ = make_schedulable_node()

    response = operator_api.post(
        "/api/v1/bootstrap-tokens", {"pool": node.pool.name, "expires_at": naive(600)}, format="json"
    )

    assert_timezone_required(response, "expires_at")
    assert not BootstrapToken.objects.exists()


def test_a_heartbeat_observed_at_without_an_offset_is_refused_with_the_same_code():
    node, secret = make_schedulable_node()

    response = node_api(secret).post(
        f"/api/v1/nodes/{node.pk}/heartbeats", {**beat(sequence=1), "observed_at": naive(0)}, format="json"
    )

    assert_timezone_required(response, "observed_at")
    node.refresh_from_db()
    assert node.sequence == -1


def test_a_metrics_observed_at_without_an_offset_is_refused_with_the_same_code():
    node, secret = make_schedulable_node()

    response = node_api(secret).post(
        f"/api/v1/nodes/{node.pk}/metrics", {"observed_at": naive(0), "metrics": {"load1": 0.5}}, format="json"
    )

    assert_timezone_required(response, "observed_at")
    assert not NodeMetrics.objects.exists()


def test_a_malformed_time_is_still_an_ordinary_validation_error(operator_api):
    node, _ = make_schedulable_node()

    response = act(operator_api, node, "drain", {"reason": "rack", "deadline": "next tuesday"})

    assert response.status_code == 400
    assert response.json()["code"] == "validation_error"


def test_a_pool_price_effective_from_without_an_offset_is_refused_with_the_same_code(operator_api):
    """Found while closing the issue: views that read a body without a serializer answered their own
    code (``invalid_datetime``, ``invalid_deadline``); they now share nodepool.api.fields.parse_aware_datetime."""
    from marketplace.models import PoolPrice

    node, _ = make_schedulable_node()
    body = {"pool": node.pool.name, "resource": "cpu", "unit_price": "0.01", "currency": "EUR"}

    response = operator_api.post("/api/v1/pool-prices", {**body, "effective_from": naive()}, format="json")

    assert_timezone_required(response, "effective_from")
    impossible = operator_api.post("/api/v1/pool-prices", {**body, "effective_from": "2026-13-01T00:00:00Z"})
    assert (impossible.status_code, impossible.json()["code"]) == (400, "invalid_datetime")
    assert not PoolPrice.objects.exists()


def test_a_preemption_deadline_without_an_offset_is_refused_with_the_same_code(operator_api):
    from operations.models import Preemption
    from operations.upgrade_plan import pool_operations

    node, secret = make_schedulable_node()
    ops = pool_operations(node.pool)
    ops.spot = True
    ops.save()

    response = node_api(secret).post(
        f"/api/v1/nodes/{node.pk}/preemption-notice", {"deadline": naive(2)}, format="json"
    )
    assert_timezone_required(response, "deadline")
    response = operator_api.post(f"/api/v1/pools/{node.pool.name}/preemption-notices",
                                 {"node_id": str(node.pk), "deadline": naive(2)}, format="json")  # fmt: skip
    assert_timezone_required(response, "deadline")
    impossible = node_api(secret).post(
        f"/api/v1/nodes/{node.pk}/preemption-notice", {"deadline": "2026-02-30T00:00:00Z"}, format="json"
    )
    assert (impossible.status_code, impossible.json()["code"]) == (400, "invalid_deadline")
    assert not Preemption.objects.exists()
