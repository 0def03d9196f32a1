"""Graceful node shutdown (issue #34 item 9): a node's own agent drains its node, and only its node."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.models import Node
from maintenance.models import Drain
from operations.models import PoolOperations
from tests.maintenance_support import make_lease
from tests.operations_support import ready_pool
from tests.support import node_api

pytestmark = pytest.mark.django_db


def shutdown(secret, node, **body):
    return node_api(secret).post(f"/api/v1/nodes/{node.pk}/shutdown-drain", body, format="json")


def test_a_node_drains_itself_with_its_pools_policy_and_then_goes_to_maintenance():
    pool, nodes = ready_pool("general", 2)
    PoolOperations.objects.create(pool=pool, drain_policy="terminate", drain_timeout=300)
    (node, secret), (idle, idle_secret) = nodes
    make_lease(node, "job-1")
    deadline = timezone.now() + timedelta(seconds=60)

    response = shutdown(secret, node, deadline=deadline.isoformat(), reason="kernel update")

    assert response.status_code == 201, response.content
    drain = Drain.objects.get(pk=response.json()["drain_id"])
    assert (drain.policy, drain.requested_by_name) == ("terminate", "system:shutdown")
    assert abs((drain.deadline - deadline).total_seconds()) < 1
    again = shutdown(secret, node)
    assert again.status_code == 200 and again.json()["drain_id"] == str(drain.pk)
    assert shutdown(idle_secret, idle).status_code == 201
    assert Node.objects.get(pk=idle.pk).lifecycle == "maintenance"  # nothing to move: drained at once


def test_the_deadline_is_capped_by_the_pools_drain_timeout_and_must_be_in_the_future():
    pool, nodes = ready_pool("general", 1)
    PoolOperations.objects.create(pool=pool, drain_timeout=120)
    node, secret = nodes[0]
    past = shutdown(secret, node, deadline=(timezone.now() - timedelta(seconds=5)).isoformat())
    assert past.status_code == 422 and past.json()["code"] == "deadline_out_of_range"
    make_lease(node, "job-1")
    late = shutdown(secret, node, deadline=(timezone.now() + timedelta(hours=5)).isoformat())
    assert late.status_code == 201
    cap = timezone.now() + timedelta(seconds=120)
    assert abs((Drain.objects.get().deadline - cap).total_seconds()) < 5


def test_a_node_cannot_drain_another_node_and_a_user_gets_403(operator_api):
    _, nodes = ready_pool("general", 2)
    (node, _), (other, other_secret) = nodes
    refused = shutdown(other_secret, node)
    assert refused.status_code == 403
    assert operator_api.post(f"/api/v1/nodes/{node.pk}/shutdown-drain", {}, format="json").status_code == 403
    assert not Drain.objects.exists()
    assert shutdown(other_secret, other, colour="red").status_code == 400
