"""POST /node-leases: placement, decision, idempotency, unschedulable explanations, bad input."""

from __future__ import annotations

import pytest

from fleet.models import NodeResource
from leases.models import Lease, Shape
from tests.factories import NodeFactory, PoolFactory, make_schedulable_node, place_test_hold

GiB = 2**30
pytestmark = pytest.mark.django_db


@pytest.fixture
def pool():
    return PoolFactory(name="general")


def ask(api, **body):
    body.setdefault("workload_id", "job-1")
    body.setdefault("pool", "general")
    if "shape" not in body:
        body.setdefault("resources", {"cpu": "2", "memory": "4Gi"})
    headers = {}
    if "key" in body:
        headers["HTTP_IDEMPOTENCY_KEY"] = body.pop("key")
    return api.post("/api/v1/node-leases", body, format="json", **headers)


def allocated(node, name="cpu"):
    return NodeResource.objects.get(node=node, name=name).allocated


def test_a_client_gets_a_lease_with_node_token_and_decision(client_api, pool):
    node, _ = make_schedulable_node(pool)
    response = ask(client_api)
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["node_id"] == str(node.pk)
    assert body["node_incarnation"] == node.incarnation
    assert body["fencing_token"] == 1
    assert body["state"] == "granted"
    assert body["resources"] == {"cpu": 2000, "memory": 4 * GiB}
    assert body["decision"]["policy_version"] == "placement/1"
    assert body["decision"]["reasons"]
    assert allocated(node) == 2000
    assert allocated(node, "memory") == 4 * GiB


def test_binpack_pool_fills_the_fullest_node_first(client_api, pool):
    empty, _ = make_schedulable_node(pool)
    busy, _ = make_schedulable_node(pool)
    NodeResource.objects.filter(node=busy, name="cpu").update(allocated=4000)
    assert ask(client_api).json()["node_id"] == str(busy.pk)


def test_spread_pool_prefers_the_emptiest_node(client_api):
    pool = PoolFactory(name="general", scheduling_policy="spread")
    empty, _ = make_schedulable_node(pool)
    busy, _ = make_schedulable_node(pool)
    NodeResource.objects.filter(node=busy, name="cpu").update(allocated=4000)
    assert ask(client_api).json()["node_id"] == str(empty.pk)


def test_retry_with_the_same_idempotency_key_returns_the_same_lease(client_api, pool):
    make_schedulable_node(pool)
    first = ask(client_api, key="k-1")
    again = ask(client_api, key="k-1")
    assert first.status_code == 201
    assert again.status_code == 200
    assert again["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert Lease.objects.count() == 1


def test_same_idempotency_key_with_another_body_is_refused(client_api, pool):
    make_schedulable_node(pool)
    assert ask(client_api, key="k-1").status_code == 201
    response = ask(client_api, key="k-1", resources={"cpu": "1"})
    assert response.status_code == 422
    assert response.json()["code"] == "idempotency_key_reused"
    assert Lease.objects.count() == 1


def test_a_workload_never_gets_two_live_leases(client_api, pool):
    make_schedulable_node(pool)
    assert ask(client_api).status_code == 201
    response = ask(client_api)
    assert response.status_code == 409
    assert response.json()["code"] == "workload_has_live_lease"


def test_unschedulable_accounts_for_every_node_once(client_api, pool):
    make_schedulable_node(pool, resources={"cpu": 500, "memory": 8 * GiB})
    make_schedulable_node(pool, resources={"cpu": 500, "memory": 8 * GiB})
    make_schedulable_node(pool, taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}])
    cordoned, _ = make_schedulable_node(pool)
    place_test_hold(cordoned)
    response = ask(client_api)
    assert response.status_code == 409
    body = response.json()
    assert body["code"] == "unschedulable"
    assert body["nodes_considered"] == 4
    assert body["reasons"] == {"insufficient_cpu": 2, "untolerated_taint": 1, "cordoned": 1}
    assert sum(body["reasons"].values()) == body["nodes_considered"]
    assert body["detail"].startswith("0/4 nodes are available: 2 Insufficient cpu")
    assert body["fragmented"] is False
    assert body["cause"] == "insufficient_capacity"


def test_fragmented_pool_is_named(client_api, pool):
    from tests.maintenance_support import make_lease

    for i in range(3):  # 1 cpu free on each of three 4-cpu nodes: freeing one would fit 2.5
        node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 8 * GiB})
        make_lease(node, f"other-{i}", resources={"cpu": 3000})
    response = ask(client_api, resources={"cpu": "2500m"})
    body = response.json()
    assert response.status_code == 409
    assert body["fragmented"] is True
    assert body["cause"] == "fragmented"
    assert "fragmented" in body["detail"]


def test_no_ready_nodes_is_told_apart_with_pending_admission(client_api, pool):
    NodeFactory(pool=pool)
    NodeFactory(pool=pool)
    response = ask(client_api)
    body = response.json()
    assert response.status_code == 409
    assert body["cause"] == "no_ready_nodes"
    assert body["pending_admission"] == 2
    assert "No ready nodes (2 pending admission)" in body["detail"]


def test_tolerated_taint_allows_placement(client_api, pool):
    node, _ = make_schedulable_node(pool, taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}])
    tolerations = [{"key": "gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}]
    response = ask(client_api, tolerations=tolerations)
    assert response.status_code == 201
    assert response.json()["node_id"] == str(node.pk)


def test_exists_toleration_with_empty_key_tolerates_everything(client_api, pool):
    make_schedulable_node(pool, taints=[{"key": "a", "value": "b", "effect": "NoExecute"}])
    assert ask(client_api, tolerations=[{"operator": "Exists"}]).status_code == 201


def test_prefer_no_schedule_taint_only_lowers_the_score(client_api):
    pool = PoolFactory(name="general", scheduling_policy="spread")
    tainted, _ = make_schedulable_node(pool, taints=[{"key": "spot", "value": "1", "effect": "PreferNoSchedule"}])
    clean, _ = make_schedulable_node(pool)
    assert ask(client_api).json()["node_id"] == str(clean.pk)
    tainted_only = PoolFactory(name="tainted")
    make_schedulable_node(tainted_only, taints=[{"key": "spot", "value": "1", "effect": "PreferNoSchedule"}])
    assert ask(client_api, workload_id="job-2", pool="tainted").status_code == 201


def test_node_selector_and_affinity_operators(client_api, pool):
    a, _ = make_schedulable_node(pool, labels={"zone": "a", "gen": "3"})
    b, _ = make_schedulable_node(pool, labels={"zone": "b", "gen": "5", "cache": "warm"})
    assert ask(client_api, workload_id="w1", node_selector={"zone": "a"}).json()["node_id"] == str(a.pk)
    gt = {"required": [{"key": "gen", "operator": "Gt", "values": ["4"]}]}
    assert ask(client_api, workload_id="w2", affinity=gt).json()["node_id"] == str(b.pk)
    not_in = {"required": [{"key": "zone", "operator": "NotIn", "values": ["b"]}]}
    assert ask(client_api, workload_id="w3", affinity=not_in).json()["node_id"] == str(a.pk)
    missing = {"required": [{"key": "cache", "operator": "DoesNotExist"}]}
    assert ask(client_api, workload_id="w4", affinity=missing).json()["node_id"] == str(a.pk)
    lt = {"required": [{"key": "gen", "operator": "Lt", "values": ["1"]}]}
    response = ask(client_api, workload_id="w5", affinity=lt)
    assert response.status_code == 409
    assert response.json()["reasons"] == {"node_affinity_mismatch": 2}


def test_preferred_affinity_breaks_ties(client_api):
    pool = PoolFactory(name="general", scheduling_policy="spread")
    make_schedulable_node(pool, labels={"cache": "cold"})
    warm, _ = make_schedulable_node(pool, labels={"cache": "warm"})
    affinity = {"preferred": [{"weight": 50, "term": {"key": "cache", "operator": "In", "values": ["warm"]}}]}
    assert ask(client_api, affinity=affinity).json()["node_id"] == str(warm.pk)


def test_node_declared_labels_count_only_in_pools_that_trust_them(client_api, pool):
    make_schedulable_node(pool, node_labels={"zone": "a"})
    assert ask(client_api, node_selector={"zone": "a"}).status_code == 409
    trusting = PoolFactory(name="trusting", trust_node_labels=True)
    make_schedulable_node(trusting, node_labels={"zone": "a"})
    assert ask(client_api, pool="trusting", node_selector={"zone": "a"}).status_code == 201


def test_features_come_from_verified_capability(client_api, pool):
    make_schedulable_node(pool)  # verified arch amd64 (factory)
    response = ask(client_api, features={"arch": "arm64"})
    assert response.json()["reasons"] == {"missing_feature": 1}
    assert ask(client_api, features={"arch": "amd64"}).status_code == 201
    arch = {"required": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}
    assert ask(client_api, workload_id="job-2", affinity=arch).status_code == 201


def test_anti_affinity_puts_one_lease_per_zone(client_api, pool):
    make_schedulable_node(pool, labels={"topology.kubernetes.io/zone": "a"})
    make_schedulable_node(pool, labels={"topology.kubernetes.io/zone": "a"})
    make_schedulable_node(pool, labels={"topology.kubernetes.io/zone": "b"})
    spread = {"group": "db", "topology_key": "zone", "mode": "anti-affinity"}
    first = ask(client_api, workload_id="db-1", spread=spread, resources={"cpu": "1"})
    second = ask(client_api, workload_id="db-2", spread=spread, resources={"cpu": "1"})
    third = ask(client_api, workload_id="db-3", spread=spread, resources={"cpu": "1"})
    assert first.status_code == second.status_code == 201
    zones = {Lease.objects.get(pk=r.json()["id"]).node.labels["topology.kubernetes.io/zone"] for r in (first, second)}
    assert zones == {"a", "b"}
    assert third.status_code == 409
    assert third.json()["reasons"] == {"anti_affinity_conflict": 3}


def test_soft_spread_prefers_the_emptier_host(client_api, pool):
    one, _ = make_schedulable_node(pool)
    two, _ = make_schedulable_node(pool)
    spread = {"group": "web", "topology_key": "host"}
    nodes = {ask(client_api, workload_id=f"web-{i}", spread=spread).json()["node_id"] for i in range(2)}
    assert nodes == {str(one.pk), str(two.pk)}


def test_a_shape_fills_the_resources_and_the_lease_records_its_version(client_api, operator_api, pool):
    make_schedulable_node(pool)
    assert (
        operator_api.post("/api/v1/shapes", {"name": "large", "resources": {"cpu": "4"}}, format="json").status_code
        == 201
    )
    created = operator_api.post(
        "/api/v1/shapes", {"name": "large", "resources": {"cpu": "2", "memory": "8Gi"}}, format="json"
    )
    assert created.status_code == 201
    assert created.json()["version"] == 2
    assert created.json()["quantities"] == {"cpu": "2", "memory": "8Gi"}
    body = ask(client_api, shape="large").json()
    assert body["shape"] == "large"
    assert body["shape_version"] == 2
    assert body["resources"] == {"cpu": 2000, "memory": 8 * GiB}
    old = ask(client_api, workload_id="job-2", shape="large", shape_version=1).json()
    assert old["resources"] == {"cpu": 4000}


def test_clients_cannot_publish_shapes(client_api, pool):
    response = client_api.post("/api/v1/shapes", {"name": "large", "resources": {"cpu": "4"}}, format="json")
    assert response.status_code == 403
    assert not Shape.objects.exists()


@pytest.mark.parametrize(
    ("body", "status", "code", "field"),
    [
        ({"resources": {"cpu": "-1"}}, 400, "invalid_quantity", "resources.cpu"),
        ({"resources": {"cpu": "two"}}, 400, "invalid_quantity", "resources.cpu"),
        ({"resources": {"memory": "4Gb"}}, 400, "invalid_quantity", "resources.memory"),
        ({"resources": {"bananas": "1"}}, 400, "unknown_resource", "resources.bananas"),
        ({"resources": {"nvidia.com/gpu": "0.5"}}, 400, "invalid_quantity", "resources.nvidia.com/gpu"),
        # The field is the whole name, colon and all (it was cut at the first ":").
        ({"resources": {"a:b": "1"}}, 400, "invalid_quantity", "resources.a:b"),
        ({"resources": {}}, 400, "empty_request", "resources"),
        ({"resources": None, "devices": []}, 400, "empty_request", "resources"),
        # A malformed devices member is named, not taken for a request of nothing.
        ({"resources": None, "devices": {}}, 400, "invalid_device_request", "devices"),
        ({"pool": "nowhere"}, 400, "unknown_pool", "pool"),
        ({"shape": "huge", "resources": None}, 400, "unknown_shape", "shape"),
        ({"workload_id": ""}, 400, "validation_error", "workload_id"),
        # "$" alone also matches before a trailing newline: every name pattern must match whole.
        ({"workload_id": "job-1\n"}, 400, "validation_error", "workload_id"),
        ({"node_selector": {"zone\n": "a"}}, 400, "invalid_selector", "node_selector.zone\n"),
        ({"ttl_seconds": 0}, 400, "validation_error", "ttl_seconds"),
        ({"node_selector": {"zone": 3}}, 400, "invalid_selector", "node_selector.zone"),
        ({"node_selector": ["zone"]}, 400, "invalid_selector", "node_selector"),
        (
            {"affinity": {"required": [{"key": "a", "operator": "Near"}]}},
            400,
            "invalid_affinity",
            "affinity.required[0].operator",
        ),
        (
            {"affinity": {"required": [{"key": "a", "operator": "In"}]}},
            400,
            "invalid_affinity",
            "affinity.required[0].values",
        ),
        (
            {"affinity": {"required": [{"key": "a", "operator": "Gt", "values": ["x"]}]}},
            400,
            "invalid_affinity",
            "affinity.required[0].values",
        ),
        (
            {"affinity": {"required": [{"key": "a", "operator": "Exists", "values": ["x"]}]}},
            400,
            "invalid_affinity",
            "affinity.required[0].values",
        ),
        (
            {"affinity": {"preferred": [{"weight": 500, "term": {"key": "a", "operator": "Exists"}}]}},
            400,
            "invalid_affinity",
            "affinity.preferred[0].weight",
        ),
        (  # an unknown member of a preferred term, as anywhere else in the request (it was ignored)
            {"affinity": {"preferred": [{"weight": 5, "term": {"key": "a", "operator": "Exists"}, "preference": {}}]}},
            400,
            "invalid_affinity",
            "affinity.preferred[0]",
        ),
        (
            {"tolerations": [{"key": "a", "operator": "Sometimes"}]},
            400,
            "invalid_toleration",
            "tolerations[0].operator",
        ),
        (
            {"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]},
            400,
            "invalid_toleration",
            "tolerations[0].value",
        ),
        ({"tolerations": [{"key": "a", "effect": "NoRun"}]}, 400, "invalid_toleration", "tolerations[0].effect"),
        ({"tolerations": [{"value": "b"}]}, 400, "invalid_toleration", "tolerations[0].operator"),
        ({"spread": {"group": "g", "mode": "clump"}}, 400, "invalid_spread", "spread.mode"),
        (  # beyond a datetime's reach: it stopped the NoExecute sweep for every lease
            {"tolerations": [{"operator": "Exists", "effect": "NoExecute", "toleration_seconds": 10**15}]},
            400,
            "invalid_toleration",
            "tolerations[0].toleration_seconds",
        ),
        ({"surprise": 1}, 400, "validation_error", "surprise"),
        # An unhashable attribute was looked up in a dict: a TypeError, answered 500.
        (
            {"node_constraints": [{"attribute": [], "operator": ">=", "value": 0.5}]},
            400,
            "invalid_node_constraint",
            "node_constraints[0].attribute",
        ),
        (
            {"node_preferences": [{"weight": 1, "attribute": {}, "operator": ">=", "value": 0.5}]},
            400,
            "invalid_node_constraint",
            "node_preferences[0].attribute",
        ),
        # A falsy value of the wrong type is refused, not read as the member left out.
        ({"shape": 0}, 400, "validation_error", "shape"),
        ({"features": []}, 400, "validation_error", "features"),
        ({"command": {}}, 400, "validation_error", "command"),
        ({"command": False}, 400, "validation_error", "command"),
        ({"affinity": {"required": {}}}, 400, "invalid_affinity", "affinity.required"),
        ({"affinity": {"preferred": 0}}, 400, "invalid_affinity", "affinity.preferred"),
        ({"tolerations": [{"key": False, "operator": "Exists"}]}, 400, "invalid_toleration", "tolerations[0].key"),
        ({"tolerations": [{"key": "a", "operator": 0}]}, 400, "invalid_toleration", "tolerations[0].operator"),
        ({"tolerations": [{"key": "a", "value": []}]}, 400, "invalid_toleration", "tolerations[0].value"),
        ({"tolerations": [{"key": "a", "effect": False}]}, 400, "invalid_toleration", "tolerations[0].effect"),
        ({"spread": {"group": "g", "topology_key": {}}}, 400, "invalid_spread", "spread.topology_key"),
        ({"spread": {"group": "g", "mode": False}}, 400, "invalid_spread", "spread.mode"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_changes_nothing(client_api, pool, body, status, code, field):
    node, _ = make_schedulable_node(pool)
    response = ask(client_api, **body)
    assert response.status_code == status, response.json()
    problem = response.json()
    assert response["Content-Type"] == "application/problem+json"
    assert problem["code"] == code
    assert problem["errors"][0]["field"] == field
    assert field in problem["detail"]
    assert not Lease.objects.exists()
    assert allocated(node) == 0


def test_a_request_larger_than_any_node_cannot_be_queued(client_api, pool):
    make_schedulable_node(pool)
    response = ask(client_api, resources={"cpu": "64"}, queue=True)
    assert response.status_code == 422
    assert response.json()["code"] == "impossible_request"


def test_nodes_and_strangers_cannot_ask_for_leases(anon_api, owner_api, pool):
    node, secret = make_schedulable_node(pool)
    assert ask(anon_api).status_code == 401
    assert ask(owner_api).status_code == 403
    from rest_framework.test import APIClient

    node_api = APIClient()
    node_api.credentials(HTTP_AUTHORIZATION=f"Node {secret}")
    as_node = ask(node_api)
    assert (as_node.status_code, as_node.json()["code"]) == (403, "forbidden")  # a node is no client
    assert not Lease.objects.exists()


def test_clients_see_only_their_own_leases(client_api, operator_api, pool):
    make_schedulable_node(pool)
    lease_id = ask(operator_api, workload_id="ops-job").json()["id"]
    assert client_api.get(f"/api/v1/node-leases/{lease_id}").status_code == 404
    assert client_api.get("/api/v1/node-leases").json()["count"] == 0
    assert operator_api.get(f"/api/v1/node-leases/{lease_id}").status_code == 200


def test_a_node_whose_credential_expired_gets_no_new_work(client_api, pool):
    from datetime import timedelta

    import time_machine
    from django.utils import timezone

    make_schedulable_node(pool)
    assert ask(client_api, workload_id="before", resources={"cpu": "1"}).status_code == 201
    with time_machine.travel(timezone.now() + timedelta(days=2)):
        response = ask(client_api, workload_id="after", resources={"cpu": "1"})
    assert response.status_code == 409
    assert response.json()["reasons"] == {"no_valid_credential": 1}


@pytest.mark.parametrize("body", [["not", "an", "object"], "text", 42])
def test_a_body_that_is_not_an_object_is_a_400(client_api, pool, body):
    response = client_api.post("/api/v1/node-leases", body, format="json")
    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"


@pytest.mark.parametrize("field", ["renew", "release"])
def test_lease_actions_with_a_non_object_body_are_400(client_api, pool, field):
    make_schedulable_node(pool)
    lease = ask(client_api).json()
    response = client_api.post(f"/api/v1/node-leases/{lease['id']}/{field}", [1, 2], format="json")
    assert response.status_code == 400
    assert Lease.objects.get(pk=lease["id"]).state == "granted"


def test_an_overlong_idempotency_key_is_a_400(client_api, pool):
    make_schedulable_node(pool)
    response = ask(client_api, key="k" * 201)
    assert response.status_code == 400
    assert not Lease.objects.exists()


def test_unknown_lease_ids_are_404(client_api):
    response = client_api.post(
        "/api/v1/node-leases/00000000-0000-0000-0000-000000000000/renew",
        {"fencing_token": 1, "node_incarnation": 1},
        format="json",
    )
    assert response.status_code == 404
    assert response.json()["code"] == "lease_not_found"


def test_a_lease_shows_the_placement_it_asked_for(client_api, pool):
    make_schedulable_node(pool, labels={"zone": "a"}, taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}])
    tolerations = [{"key": "gpu", "operator": "Exists"}]
    response = ask(client_api, node_selector={"zone": "a"}, tolerations=tolerations)
    assert response.status_code == 201, response.json()
    placement = response.json()["placement"]
    assert placement["node_selector"] == {"zone": "a"}
    assert placement["tolerations"][0]["key"] == "gpu"
    assert "affinity" not in placement
    assert client_api.get(f"/api/v1/node-leases/{response.json()['id']}").json()["placement"] == placement
