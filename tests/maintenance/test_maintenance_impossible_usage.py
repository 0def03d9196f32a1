"""Usage of a resource the node does not have is impossible (issue 12, case 5).

Capacity 0 means any use is impossible; a pool may allow resources that legitimately appear
without being declared. The evidence names the resource.
"""

from __future__ import annotations

import pytest

from fleet.choices import Lifecycle
from fleet.models import Pool
from maintenance.models import Quarantine
from tests.factories import make_schedulable_node, set_lifecycle
from tests.heartbeat_support import post_beat
from tests.support import node_api

pytestmark = pytest.mark.django_db


def test_a_node_without_gpus_reporting_gpus_in_use_is_quarantined_naming_the_resource():
    node, secret = make_schedulable_node()  # inventory: cpu and memory, no GPUs

    response = post_beat(node_api(secret), node, sequence=1, usage={"cpu": 1000, "nvidia.com/gpu": 4})

    assert response.status_code == 200
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.QUARANTINED
    quarantine = Quarantine.objects.get(node=node)
    assert quarantine.rule == "impossible_usage"
    assert "nvidia.com/gpu 4 > capacity 0 (not in the inventory)" in quarantine.reason
    assert quarantine.evidence["over_capacity"] == {
        "nvidia.com/gpu": {"usage": 4, "capacity": 0, "in_inventory": False}
    }


def test_a_resource_on_the_pools_allow_list_may_be_used_without_being_declared():
    node, secret = make_schedulable_node()
    Pool.objects.filter(pk=node.pool_id).update(allowed_undeclared_resources=["example.com/scratch"])

    response = post_beat(node_api(secret), node, sequence=1, usage={"cpu": 1000, "example.com/scratch": 2**30})

    assert response.status_code == 200
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.READY
    assert not Quarantine.objects.exists()


def test_zero_use_of_an_absent_resource_is_not_impossible():
    node, secret = make_schedulable_node()

    post_beat(node_api(secret), node, sequence=1, usage={"cpu": 1000, "nvidia.com/gpu": 0})

    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.READY


def test_a_node_still_being_admitted_has_no_inventory_to_judge_against():
    node, secret = make_schedulable_node()
    set_lifecycle(node, Lifecycle.ADMITTING)

    post_beat(node_api(secret), node, sequence=1, usage={"cpu": 1000, "nvidia.com/gpu": 4})

    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.ADMITTING


@pytest.mark.parametrize(
    "value", ["example.com/scratch", [1, 2], [""], ["r"] * 33], ids=["string", "numbers", "empty-name", "too-many"]
)
def test_a_malformed_allow_list_is_refused_and_changes_nothing(operator_api, value):
    node, _ = make_schedulable_node()
    pool = node.pool

    response = operator_api.patch(
        f"/api/v1/pools/{pool.name}",
        {"allowed_undeclared_resources": value},
        format="json",
        HTTP_IF_MATCH=f'"{pool.version}"',
    )

    assert 400 <= response.status_code < 500, response.json()
    assert response["Content-Type"] == "application/problem+json"
    pool.refresh_from_db()
    assert pool.allowed_undeclared_resources == [] and pool.version == 1


def test_the_allow_list_is_set_through_the_pool_api(operator_api):
    node, _ = make_schedulable_node()
    pool = node.pool

    response = operator_api.patch(
        f"/api/v1/pools/{pool.name}",
        {"allowed_undeclared_resources": ["example.com/scratch"]},
        format="json",
        HTTP_IF_MATCH=f'"{pool.version}"',
    )

    assert response.status_code == 200, response.json()
    assert response.json()["allowed_undeclared_resources"] == ["example.com/scratch"]
