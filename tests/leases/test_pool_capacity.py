"""GET /pools/{name}/capacity, the pool's Ready SLO field and its request classes ("can serve N now")."""

from __future__ import annotations

import pytest

from fleet.choices import Liveness
from fleet.models import Node, NodeResource, Pool
from leases.models import Shape
from tests.factories import NodeFactory, PoolFactory, make_schedulable_node, set_lifecycle

GiB = 2**30
pytestmark = pytest.mark.django_db


@pytest.fixture
def pool():
    return PoolFactory(
        name="general",
        request_classes=[{"name": "two-cores", "resources": {"cpu": 2000}}, {"name": "big", "shape": "big"}],
    )


def capacity(api, name="general"):
    return api.get(f"/api/v1/pools/{name}/capacity")


def test_capacity_sums_in_service_nodes_and_counts_free_space_on_schedulable_ones(operator_api, pool):
    busy, _ = make_schedulable_node(pool, resources={"cpu": 8000, "memory": 32 * GiB})
    NodeResource.objects.filter(node=busy, name="cpu").update(allocated=6000)
    make_schedulable_node(pool, resources={"cpu": 4000, "memory": 16 * GiB})
    silent, _ = make_schedulable_node(pool, resources={"cpu": 16000, "memory": 64 * GiB})
    Node.objects.filter(pk=silent.pk).update(liveness=Liveness.UNREACHABLE)
    NodeFactory(pool=pool)  # pending: not capacity yet

    body = capacity(operator_api).json()
    assert body["resources"]["cpu"] == {
        "allocatable": 28000,
        "allocated": 6000,
        "free": 6000,  # 2000 on the busy node + 4000 on the small one; the silent node is not schedulable
        "largest_free_block": 4000,
    }
    assert body["nodes"]["total"] == 4
    assert body["nodes"]["in_service"] == 3
    assert body["nodes"]["schedulable"] == 2
    assert body["nodes"]["lifecycle"] == {"pending": 1, "ready": 3}
    assert body["nodes"]["liveness"] == {"alive": 2, "unknown": 1, "unreachable": 1}
    assert body["ready_ratio"] == pytest.approx(2 / 3, abs=1e-6)
    assert body["ready_ratio_objective"] == 0.99


def test_request_classes_say_how_many_leases_the_pool_can_serve_now(operator_api, pool):
    make_schedulable_node(pool, resources={"cpu": 8000, "memory": 32 * GiB})
    make_schedulable_node(pool, resources={"cpu": 3000, "memory": 32 * GiB})
    assert capacity(operator_api).json()["request_classes"] == [
        {"name": "two-cores", "fits": 5},
        {"name": "big", "fits": None},  # the shape does not exist (yet)
    ]
    Shape.objects.create(name="big", version=1, resources={"cpu": 6000})
    assert capacity(operator_api).json()["request_classes"][1] == {"name": "big", "fits": 1}


def test_retired_nodes_are_not_counted(operator_api, pool):
    node, _ = make_schedulable_node(pool)
    set_lifecycle(node, "retired")
    body = capacity(operator_api).json()
    assert body["nodes"]["total"] == 0
    assert body["ready_ratio"] is None
    assert body["resources"] == {}


def test_an_unknown_pool_is_a_404_problem(operator_api, pool):
    response = capacity(operator_api, "nope")
    assert response.status_code == 404
    assert response.json()["code"] == "pool_not_found"


def test_owners_and_clients_read_capacity_but_anonymous_users_do_not(owner_api, client_api, anon_api, pool):
    assert capacity(owner_api).status_code == 200
    assert capacity(client_api).status_code == 200
    assert capacity(anon_api).status_code == 401


def test_operators_set_the_ready_objective_and_request_classes(operator_api, pool):
    etag = operator_api.get("/api/v1/pools/general")["ETag"]
    response = operator_api.patch(
        "/api/v1/pools/general",
        {"ready_ratio_objective": 0.995, "request_classes": [{"name": "gpu", "resources": {"nvidia.com/gpu": 1}}]},
        format="json",
        HTTP_IF_MATCH=etag,
    )
    assert response.status_code == 200, response.json()
    pool.refresh_from_db()
    assert pool.ready_ratio_objective == 0.995
    assert pool.request_classes == [{"name": "gpu", "resources": {"nvidia.com/gpu": 1}}]


@pytest.mark.parametrize(
    "change",
    [
        {"ready_ratio_objective": 1.0},
        {"ready_ratio_objective": 0.2},
        {"ready_ratio_objective": "high"},
        {"request_classes": {"name": "x"}},
        {"request_classes": [{"name": "Bad Name", "resources": {"cpu": "1"}}]},
        {"request_classes": [{"name": "x"}]},
        {"request_classes": [{"name": "x", "shape": "s", "resources": {"cpu": "1"}}]},
        {"request_classes": [{"name": "x", "resources": {"cpu": "lots"}}]},
        {"request_classes": [{"name": "x", "shape": "s"}, {"name": "x", "shape": "t"}]},
        {"request_classes": [{"name": f"c{i}", "shape": "s"} for i in range(33)]},
    ],
)
def test_bad_pool_observability_settings_are_refused_and_change_nothing(operator_api, pool, change):
    etag = operator_api.get("/api/v1/pools/general")["ETag"]
    response = operator_api.patch("/api/v1/pools/general", change, format="json", HTTP_IF_MATCH=etag)
    assert response.status_code == 400, response.json()
    assert response["Content-Type"].startswith("application/problem+json")
    fresh = Pool.objects.get(pk=pool.pk)
    assert (fresh.ready_ratio_objective, fresh.request_classes, fresh.version) == (
        0.99,
        pool.request_classes,
        pool.version,
    )


def test_the_refresh_task_stores_each_pools_can_serve_numbers(pool):
    from leases.preview import refresh_request_class_fits

    make_schedulable_node(pool, resources={"cpu": 8000, "memory": 32 * GiB})
    PoolFactory(name="bare")
    assert refresh_request_class_fits() == 2
    pool.refresh_from_db()
    assert pool.request_class_fits == {"two-cores": 4, "big": None}
    assert pool.request_class_fits_at is not None
    assert Pool.objects.get(name="bare").request_class_fits == {}
