"""Placement previews after scale-up (issue 34 item 10): ``POST /placement-previews`` also says
whether a request would fit once the pool added nodes of its template up to ``max_nodes``, in
the reason-code family of requests no node nor template could ever take (``too_large``)."""

from __future__ import annotations

import pytest

from fleet.models import Node
from operations.models import PoolOperations
from tests.factories import PoolFactory, make_schedulable_node

pytestmark = pytest.mark.django_db


def autoscaled(api, *, nodes: int, template=None, max_nodes=3):
    pool = PoolFactory(name="general")
    for _ in range(nodes):
        make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    ops = PoolOperations.objects.get_or_create(pool=pool)[0]
    body = {"provider": "simulated", "min_nodes": 0, "max_nodes": max_nodes,
            "node_template": template or {"resources": {"cpu": "4", "memory": "16Gi"}}}  # fmt: skip
    response = api.patch("/api/v1/pools/general/operations", body, format="json", HTTP_IF_MATCH=f'"{ops.version}"')
    assert response.status_code == 200, response.content
    return pool


def preview(api, cpu: str, count: int = 1, **extra) -> dict:
    body = {"pool": "general", "resources": {"cpu": cpu}, "count": count, **extra}
    response = api.post("/api/v1/placement-previews", body, format="json")
    assert response.status_code == 200, response.content
    return response.json()["pools"][0]


def test_a_request_that_does_not_fit_now_fits_after_the_pool_scales_up_to_its_maximum(client_api, operator_api):
    autoscaled(operator_api, nodes=1)
    answer = preview(client_api, "3", count=3)
    assert (answer["fits"], answer["placeable"]) == (1, False)
    after = answer["after_scale_up"]
    assert (after["max_nodes"], after["nodes_to_add"], after["per_node"]) == (3, 2, 1)
    assert (after["fits"], after["placeable"], after["cause"]) == (3, True, None)
    assert Node.objects.count() == 1  # a preview writes nothing


def test_beyond_max_nodes_it_says_the_pool_runs_out_of_room(client_api, operator_api):
    autoscaled(operator_api, nodes=1)
    after = preview(client_api, "3", count=4)["after_scale_up"]
    assert (after["fits"], after["placeable"], after["cause"]) == (3, False, "insufficient_capacity")
    assert "max_nodes 3" in after["message"]


def test_an_empty_pool_would_fit_from_zero(client_api, operator_api):
    autoscaled(operator_api, nodes=0)
    answer = preview(client_api, "2", count=6)
    assert answer["fits"] == 0
    assert (answer["after_scale_up"]["per_node"], answer["after_scale_up"]["fits"]) == (2, 6)
    assert answer["after_scale_up"]["placeable"] is True


def test_a_request_no_node_nor_template_could_hold_is_too_large_in_the_same_family(client_api, operator_api):
    autoscaled(operator_api, nodes=1)
    answer = preview(client_api, "8")
    assert answer["unschedulable"]["cause"] == "too_large"
    after = answer["after_scale_up"]
    assert (after["placeable"], after["cause"], after["reason"]) == (False, "too_large", "insufficient_cpu")
    assert after["too_large"]["templates_considered"] == 1
    assert after["too_large"]["exceeds"] == ["cpu"]


def test_a_template_whose_taint_the_request_does_not_tolerate_names_the_constraint(client_api, operator_api):
    tainted = {"resources": {"cpu": "4"}, "taints": [{"key": "gpu", "value": "yes", "effect": "NoSchedule"}]}
    autoscaled(operator_api, nodes=1, template=tainted)
    after = preview(client_api, "3", count=2)["after_scale_up"]
    assert (after["placeable"], after["cause"], after["reason"]) == (False, "constraints", "untolerated_taint")
    tolerated = preview(client_api, "3", count=2,
                        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}])  # fmt: skip
    assert tolerated["after_scale_up"]["placeable"] is True


def test_a_pool_that_does_not_autoscale_has_no_answer_after_scale_up(client_api):
    make_schedulable_node(PoolFactory(name="general"), resources={"cpu": 4000})
    assert preview(client_api, "3")["after_scale_up"] is None
