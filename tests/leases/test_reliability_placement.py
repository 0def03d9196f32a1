"""Reliability as a placement constraint and preference (leases.reliability, docs/leases.md)."""

from __future__ import annotations

import pytest

from fleet.models import Node
from leases.models import Lease, LeaseRequest
from tests.factories import PoolFactory, make_schedulable_node
from tests.races import race
from tests.support import grant_status

pytestmark = pytest.mark.django_db

AT_LEAST_99 = [{"attribute": "reliability", "operator": ">=", "value": 0.99}]


def reliable_pool(name="rel", *, scores=(0.995, 0.9, None), cpu=4000):
    pool = PoolFactory(name=name)
    nodes = []
    for index, score in enumerate(scores):
        node, _ = make_schedulable_node(pool, resources={"cpu": cpu, "memory": 2**34}, hostname=f"{name}-{index}")
        Node.objects.filter(pk=node.pk).update(reliability=score)
        nodes.append(node)
    return pool, nodes


def ask(api, workload_id, *, pool="rel", cpu="2", **extra):
    body = {"workload_id": workload_id, "pool": pool, "resources": {"cpu": cpu}, **extra}
    return api.post("/api/v1/node-leases", body, format="json")


def test_a_client_asking_reliability_at_least_099_gets_the_node_with_that_record(client_api):
    _, (good, _mediocre, _new) = reliable_pool()
    for index in range(2):  # two leases fit the good node (4 cpu), every time on it
        response = ask(client_api, f"job-{index}", node_constraints=AT_LEAST_99)
        assert response.status_code == 201, response.json()
        assert response.json()["node_id"] == str(good.pk)


def test_when_no_node_has_the_record_the_409_says_so_by_count(client_api):
    reliable_pool(scores=(0.995, 0.9, 0.95, None))
    assert ask(client_api, "fill", cpu="4", node_constraints=AT_LEAST_99).status_code == 201
    response = ask(client_api, "job", node_constraints=AT_LEAST_99)
    assert response.status_code == 409
    body = response.json()
    assert body["code"] == "unschedulable"
    assert body["reasons"] == {"reliability_not_met": 2, "reliability_unrated": 1, "insufficient_cpu": 1}
    assert "2 node(s) had reliability below 0.99" in body["detail"]
    assert "1 node(s) had no reliability record yet" in body["detail"]
    assert Lease.objects.filter(workload_id="job").count() == 0


def test_without_the_constraint_unrated_and_weaker_nodes_still_take_work(client_api):
    _, nodes = reliable_pool(scores=(0.5, None))
    placed = {ask(client_api, f"job-{i}").json()["node_id"] for i in range(4)}
    assert placed == {str(n.pk) for n in nodes}


def test_other_operators_compare_the_same_way(client_api):
    _, (good, mediocre, _new) = reliable_pool()
    below = [{"attribute": "reliability", "operator": "<", "value": "0.95"}]
    assert ask(client_api, "low", node_constraints=below).json()["node_id"] == str(mediocre.pk)
    exact = [{"attribute": "reliability", "operator": "=", "value": 0.995}]
    assert ask(client_api, "eq", node_constraints=exact).json()["node_id"] == str(good.pk)
    other = [{"attribute": "reliability", "operator": "!=", "value": 0.995}]
    assert ask(client_api, "ne", node_constraints=other).json()["node_id"] == str(mediocre.pk)  # unrated never


def test_a_preference_puts_the_reliable_node_first(client_api):
    _, (good, _mediocre, _new) = reliable_pool()
    prefer = [{"weight": 100, "attribute": "reliability", "operator": ">=", "value": 0.99}]
    for index in range(2):
        response = ask(client_api, f"job-{index}", cpu="1", node_preferences=prefer)
        assert response.json()["node_id"] == str(good.pk)
        assert response.json()["decision"]["score_parts"]["reliability"] == 100.0


def test_the_placement_preview_names_reliability(client_api):
    reliable_pool(scores=(0.9, None))
    body = {"pool": "rel", "resources": {"cpu": "1"}, "node_constraints": AT_LEAST_99}
    response = client_api.post("/api/v1/placement-previews", body, format="json")
    assert response.status_code == 200, response.json()
    answer = response.json()["pools"][0]
    assert answer["fits"] == 0
    assert "1 node(s) had reliability below 0.99" in answer["unschedulable"]["message"]


BAD_CONSTRAINTS = [
    ([{"attribute": "reliability", "operator": ">=", "value": 1.5}], "node_constraints[0].value"),
    ([{"attribute": "reliability", "operator": ">=", "value": -0.1}], "node_constraints[0].value"),
    ([{"attribute": "reliability", "operator": ">=", "value": "high"}], "node_constraints[0].value"),
    ([{"attribute": "reliability", "operator": ">=", "value": True}], "node_constraints[0].value"),
    ([{"attribute": "reliability", "operator": ">=", "value": None}], "node_constraints[0].value"),
    ([{"attribute": "reliability", "operator": "~", "value": 0.9}], "node_constraints[0].operator"),
    ([{"attribute": "uptime", "operator": ">=", "value": 0.9}], "node_constraints[0].attribute"),
    ([{"attribute": "reliability", "operator": ">=", "value": 0.9, "x": 1}], "node_constraints[0]"),
    ({"attribute": "reliability"}, "node_constraints"),
]


def test_a_bad_reliability_constraint_is_a_400_naming_the_field_and_stores_nothing(client_api):
    reliable_pool(scores=(0.999,))
    for constraints, field in BAD_CONSTRAINTS:
        response = ask(client_api, "bad", node_constraints=constraints)
        assert response.status_code == 400, constraints
        assert response["Content-Type"].startswith("application/problem+json")
        body = response.json()
        assert (body["code"], body["errors"][0]["field"]) == ("invalid_node_constraint", field), constraints
    for weight in (0, 101, "5", True):
        prefer = [{"weight": weight, "attribute": "reliability", "operator": ">=", "value": 0.9}]
        response = ask(client_api, "bad", node_preferences=prefer)
        assert response.status_code == 400
        assert response.json()["errors"][0]["field"] == "node_preferences[0].weight"
    assert not Lease.objects.exists() and not LeaseRequest.objects.exists()


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_clients_racing_for_the_last_reliable_slot_get_one_grant_and_one_409(client_user):
    reliable_pool("race", scores=(0.999, 0.5), cpu=1000)
    outcome = race(lambda i: grant_status(client_user, f"job-{i}", pool="race", node_constraints=AT_LEAST_99), 2)
    assert not outcome.errors
    assert sorted(outcome.results) == [201, 409]
    assert Lease.objects.filter(state="granted").count() == 1
