"""POST /placement-previews: a dry run of lease grants, checked against real grants; it writes nothing."""

from __future__ import annotations

import pytest

from fleet.models import NodeEvent, NodeResource
from leases.models import FencingSequence, Lease, Shape
from leases.preview import preview_pool
from leases.services import resolve_shape
from leases.spec import parse_spec
from tests.factories import PoolFactory, make_schedulable_node

GiB = 2**30
pytestmark = pytest.mark.django_db


def preview(api, **body):
    return api.post("/api/v1/placement-previews", body, format="json")


def grant(api, workload_id, **body):
    body = {"workload_id": workload_id, "pool": "general", **body}
    return api.post("/api/v1/node-leases", body, format="json")


def stored_state():
    """Everything a grant would change: leases, capacity, fencing tokens, events."""
    return (
        sorted(Lease.objects.values_list("pk", flat=True)),
        sorted(NodeResource.objects.values_list("node_id", "name", "allocated")),
        sorted(FencingSequence.objects.values_list("workload_id", "last_token")),
        NodeEvent.objects.count(),
    )


@pytest.fixture
def pool():
    return PoolFactory(name="general")


@pytest.fixture
def small_and_large(pool):
    """Two nodes whose binpack scores never tie: a 4-core and an 8-core node."""
    small, _ = make_schedulable_node(pool, hostname="small", resources={"cpu": 4000, "memory": 16 * GiB})
    large, _ = make_schedulable_node(pool, hostname="large", resources={"cpu": 8000, "memory": 32 * GiB})
    return small, large


def test_a_preview_names_the_nodes_that_real_grants_then_take_in_the_same_order(client_api, small_and_large):
    small, large = small_and_large
    answer = preview(client_api, pool="general", resources={"cpu": "2", "memory": "1Gi"}, count=6)
    assert answer.status_code == 200, answer.json()
    body = answer.json()["pools"][0]
    assert body["fits"] == 6 and body["placeable"] is True
    expected = [str(small.pk)] * 2 + [str(large.pk)] * 4
    assert [p["node_id"] for p in body["placements"] for _ in range(p["leases"])] == expected

    granted = []
    for i in range(7):
        response = grant(client_api, f"job-{i}", resources={"cpu": "2", "memory": "1Gi"})
        if response.status_code != 201:
            assert response.status_code == 409
            break
        granted.append(response.json()["node_id"])
    assert granted == expected  # the seventh grant found nothing, as the preview said


def test_a_preview_writes_nothing(client_api, small_and_large):
    before = stored_state()
    assert preview(client_api, pool="general", resources={"cpu": "1"}, count=50).status_code == 200
    assert stored_state() == before


def test_fits_counts_every_lease_the_pool_can_hold_beyond_the_requested_count(client_api, small_and_large):
    body = preview(client_api, pool="general", resources={"cpu": "1"}).json()
    assert body["pools"][0]["fits"] == 12
    assert body["pools"][0]["requested"] == 1
    assert len(body["pools"][0]["placements"]) == 1


def test_when_nothing_fits_the_preview_gives_the_409_explanation_of_a_real_grant(client_api, small_and_large):
    body = preview(client_api, pool="general", resources={"cpu": "16"}).json()["pools"][0]
    real = grant(client_api, "too-big", resources={"cpu": "16"})
    assert real.status_code == 409
    assert body["fits"] == 0 and body["placeable"] is False and body["placements"] == []
    assert body["unschedulable"]["reasons"] == real.json()["reasons"] == {"insufficient_cpu": 2}
    assert body["unschedulable"]["message"] == real.json()["detail"]


def test_anti_affinity_allows_one_lease_per_topology_domain(client_api, pool):
    for zone in ("a", "a", "b"):
        make_schedulable_node(pool, labels={"zone": zone})
    spread = {"group": "db", "topology_key": "zone", "mode": "anti-affinity"}
    body = preview(client_api, pool="general", resources={"cpu": "1"}, spread=spread, count=3).json()["pools"][0]
    assert body["fits"] == 2 and body["placeable"] is False
    granted = [grant(client_api, f"db-{i}", resources={"cpu": "1"}, spread=spread).status_code for i in range(3)]
    assert granted == [201, 201, 409]


def test_a_named_shape_is_previewed_in_every_pool_when_no_pool_is_named(client_api, small_and_large):
    other = PoolFactory(name="other")
    make_schedulable_node(other, resources={"cpu": 16000, "memory": 64 * GiB})
    Shape.objects.create(name="big", version=1, resources={"cpu": 6000, "memory": GiB})
    body = preview(client_api, shape="big").json()
    assert [(p["pool"], p["fits"]) for p in body["pools"]] == [("general", 1), ("other", 2)]
    assert body["fits"] == 3


def test_excluded_nodes_are_left_out_of_the_internal_preview(small_and_large):
    small, large = small_and_large
    spec, _ = resolve_shape(parse_spec({"workload_id": "x", "pool": "general", "resources": {"cpu": "2"}}))
    answer = preview_pool(small.pool, spec, count=2, exclude_node_ids=[small.pk])
    assert answer["fits"] == 4
    assert answer["placements"] == [{"node_id": str(large.pk), "hostname": "large", "leases": 2}]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"pool": "general", "resources": {"cpu": "1"}, "count": 0}, "invalid_count"),
        ({"pool": "general", "resources": {"cpu": "1"}, "count": 1001}, "invalid_count"),
        ({"pool": "general", "resources": {"cpu": "1"}, "count": "3"}, "invalid_count"),
        ({"pool": "general", "resources": {"cpu": "1"}, "count": True}, "invalid_count"),
        ({"pool": "nope", "resources": {"cpu": "1"}}, "unknown_pool"),
        ({"pool": "general", "shape": "missing"}, "unknown_shape"),
        ({"pool": "general"}, "empty_request"),
        ({"pool": "general", "resources": {"cpu": "lots"}}, "invalid_quantity"),
        ({"pool": "general", "resources": {"cpu": "1"}, "surprise": 1}, "validation_error"),
    ],
)
def test_bad_previews_are_refused_with_a_stable_code_and_change_nothing(client_api, small_and_large, body, code):
    before = stored_state()
    response = preview(client_api, **body)
    assert response.status_code == 400, response.json()
    assert response["Content-Type"].startswith("application/problem+json")
    assert response.json()["code"] == code
    assert stored_state() == before


def test_a_json_array_body_is_refused(client_api, pool):
    response = client_api.post("/api/v1/placement-previews", [1, 2], format="json")
    assert response.status_code == 400


def test_owners_and_anonymous_users_may_not_preview(owner_api, anon_api, pool):
    assert preview(owner_api, pool="general", resources={"cpu": "1"}).status_code == 403
    assert preview(anon_api, pool="general", resources={"cpu": "1"}).status_code == 401


def test_the_quick_count_of_request_classes_agrees_with_the_full_filter_path(pool):
    from leases import placement
    from leases.preview import fits_count, quick_fits
    from leases.spec import PlacementSpec, Toleration

    for cpu, memory in ((8000, 32 * GiB), (3000, 4 * GiB), (16000, 64 * GiB)):
        make_schedulable_node(pool, resources={"cpu": cpu, "memory": memory, "example.com/fpga": 2})
    make_schedulable_node(
        pool, resources={"cpu": 8000, "memory": 8 * GiB}, taints=[{"key": "gpu", "effect": "NoSchedule"}]
    )
    tolerate = (Toleration(key="gpu", operator="Exists"),)
    for resources in (
        {"cpu": 2000},
        {"cpu": 1500, "memory": 3 * GiB},
        {"cpu": 1000, "memory": GiB, "example.com/fpga": 1},
        {"memory": 5 * GiB},
    ):
        for tolerations in ((), tolerate):
            spec = PlacementSpec(workload_id="w", pool="general", resources=resources, tolerations=tolerations)
            full = fits_count(list(placement.candidate_query(pool, spec)), pool, spec, placement.GroupCounts())
            assert quick_fits(pool, spec) == full, (resources, tolerations)
            assert full > 0
