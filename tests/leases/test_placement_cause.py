"""The headline of a 409 tells the truth (issue 33 item 3): "fragmented" only when freeing a node
would let the request in, "too_large" when no node could ever hold it, alike in the 409, the queued
request's 422 and the preview. Hypothesis checks the cause against a node-by-node brute force."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from fleet.choices import Lifecycle
from fleet.models import Node, NodeResource
from fleet.selectors import unschedulable_reasons, valid_credential_exists
from leases import impossible, placement
from leases.spec import parse_spec
from tests.factories import PoolFactory, make_schedulable_node
from tests.leases.test_placement_diagnose import build, nodes_strategy, request_body, request_strategy
from tests.maintenance_support import make_lease

pytestmark = pytest.mark.django_db
GiB = 2**30


def brute_force_cause(pool, spec, exclude=()) -> str:
    """The cause from its definition, one node at a time."""
    nodes = list(
        Node.objects.filter(pool=pool)
        .exclude(lifecycle=Lifecycle.RETIRED)
        .annotate(has_valid_credential=valid_credential_exists())
    )

    def allocatable(node):
        return {r.name: r.allocatable for r in NodeResource.objects.filter(node=node)}

    def free(node):
        return {r.name: max(0, r.allocatable - r.allocated) for r in NodeResource.objects.filter(node=node)}

    def shapes(node):  # a node in admission may also bring what it declared
        yield allocatable(node)
        if node.lifecycle in (Lifecycle.PENDING, Lifecycle.ADMITTING):
            yield impossible.declared_allocatable(node.declared, pool.reserved_totals())

    if nodes and not any(
        impossible.holds(shape, spec.resources)
        for n in nodes
        if n.lifecycle != Lifecycle.REJECTED
        for shape in shapes(n)
    ):
        return "too_large"
    if not nodes:
        return "no_nodes"
    counts = placement.group_counts(spec, pool)
    schedulable = [n for n in nodes if n.pk not in exclude and not unschedulable_reasons(n)]
    if not schedulable:
        return "no_ready_nodes"
    candidates = [n for n in schedulable if placement.constraint_failure(n, pool, spec, counts) is None]
    short = [n for n in candidates if placement.resource_failure(free(n), spec)]
    if not short:
        return "constraints"
    pooled = {name: sum(free(n).get(name, 0) for n in candidates) for name in spec.resources}
    if all(pooled[name] >= amount for name, amount in spec.resources.items()) and any(
        impossible.holds(allocatable(n), spec.resources) for n in candidates
    ):
        return "fragmented"
    return "insufficient_capacity"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(descriptions=nodes_strategy, request=request_strategy)
def test_the_cause_is_what_a_node_by_node_walk_of_its_definition_says(descriptions, request):
    pool = PoolFactory(trust_node_labels=request["trust_node_labels"])
    nodes = build(pool, descriptions)
    spec = parse_spec(request_body(pool, nodes, request))
    exclude = (nodes[0].pk,) if request["exclude_first"] and nodes else ()
    explanation = placement.diagnose(pool, spec, exclude_node_ids=exclude)
    expected = brute_force_cause(pool, spec, exclude)
    if expected == "constraints" and not explanation["reasons"]:
        return  # the request fits a node: diagnose is only asked when nothing does
    assert explanation["cause"] == expected, explanation
    assert explanation["fragmented"] == (expected == "fragmented")
    assert (explanation["too_large"] is not None) == (expected == "too_large")


def ask(api, pool, **body):
    body.setdefault("workload_id", "job-1")
    body.setdefault("pool", pool.name)
    return api.post("/api/v1/node-leases", body, format="json")


def test_a_request_larger_than_every_node_is_said_to_be_so_in_human_units(client_api):
    pool = PoolFactory(name="general")
    for cpu in (8000, 32000, 16000):
        make_schedulable_node(pool, resources={"cpu": cpu, "memory": 64 * GiB})
    response = ask(client_api, pool, resources={"cpu": "64"})
    body = response.json()
    assert response.status_code == 409
    assert body["code"] == "unschedulable"
    assert body["cause"] == "too_large"
    assert body["fragmented"] is False
    assert "fragmented" not in body["detail"]
    assert "No node in pool 'general' is that large: the largest allocatable cpu is 32 (requested 64)" in body["detail"]
    assert body["too_large"] == {
        "requested": {"cpu": 64000},
        "largest": {"cpu": 32000},
        "exceeds": ["cpu"],
        "nodes_considered": 3,
        "templates_considered": 0,
    }


def test_fragmented_means_a_node_would_hold_the_request_once_freed(client_api):
    pool = PoolFactory(name="general")
    for i in range(3):
        node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 8 * GiB})
        make_lease(node, f"other-{i}", resources={"cpu": 3000})
    response = ask(client_api, pool, resources={"cpu": "2500m"})
    body = response.json()
    assert response.status_code == 409
    assert body["cause"] == "fragmented"
    assert body["fragmented"] is True
    assert body["too_large"] is None
    assert "fragmented" in body["detail"]


def test_no_node_with_all_resources_together_is_too_large_too(client_api):
    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 32000, "memory": 4 * GiB})
    make_schedulable_node(pool, resources={"cpu": 4000, "memory": 64 * GiB})
    body = ask(client_api, pool, resources={"cpu": "16", "memory": "32Gi"}).json()
    assert body["cause"] == "too_large"
    assert body["too_large"]["exceeds"] == []
    assert "has cpu 16 and memory 32Gi allocatable together" in body["detail"]


def test_a_cordoned_big_node_is_not_too_large_but_not_ready(client_api):
    from tests.factories import place_test_hold

    pool = PoolFactory(name="general")
    big, _ = make_schedulable_node(pool, resources={"cpu": 64000, "memory": 64 * GiB})
    place_test_hold(big)
    body = ask(client_api, pool, resources={"cpu": "64"}).json()
    assert body["cause"] == "no_ready_nodes"
    assert body["too_large"] is None


def test_a_rejected_node_does_not_count_as_one_that_could_hold_it(client_api):
    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 4000})
    rejected, _ = make_schedulable_node(pool, resources={"cpu": 64000})
    Node.objects.filter(pk=rejected.pk).update(lifecycle=Lifecycle.REJECTED)
    body = ask(client_api, pool, resources={"cpu": "64"}).json()
    assert body["cause"] == "too_large"
    assert body["too_large"]["largest"] == {"cpu": 4000}


def test_the_queued_request_is_refused_with_the_same_family(client_api):
    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 32000})
    response = ask(client_api, pool, resources={"cpu": "64"}, queue=True)
    body = response.json()
    assert response.status_code == 422
    assert body["code"] == "impossible_request"
    assert body["cause"] == "too_large"
    assert body["too_large"]["largest"] == {"cpu": 32000}
    assert body["detail"].startswith("No node in pool 'general' is that large: the largest allocatable cpu is 32")
    assert body["field"] == "resources.cpu"


def test_a_template_that_could_hold_the_request_makes_it_queueable(client_api):
    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 4000})
    impossible.register_growth_source("test", lambda p: [{"cpu": 64000}] if p.pk == pool.pk else [])
    try:
        response = ask(client_api, pool, resources={"cpu": "64"}, queue=True)
        assert response.status_code == 202, response.json()
        impossible.register_growth_source("test", lambda p: [{"cpu": 16000}])
        body = ask(client_api, pool, workload_id="job-2", resources={"cpu": "64"}).json()
        assert body["cause"] == "too_large"
        assert "No node nor node template in pool 'general' is that large" in body["detail"]
        assert body["too_large"]["largest"] == {"cpu": 16000}
        assert body["too_large"]["templates_considered"] == 1
    finally:
        impossible._growth_sources.pop("test", None)


def test_the_preview_gives_the_same_cause(client_api):
    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 32000})
    body = {"pool": pool.name, "resources": {"cpu": "64"}}
    response = client_api.post("/api/v1/placement-previews", body, format="json")
    assert response.status_code == 200, response.json()
    answer = response.json()["pools"][0]["unschedulable"]
    assert answer["cause"] == "too_large"
    assert answer["too_large"]["largest"] == {"cpu": 32000}


def test_the_verdict_is_pure_for_the_scale_up_preview():
    assert impossible.verdict("p", {"cpu": 8000}, [{"cpu": 4000}], [{"cpu": 8000}]) is None
    answer = impossible.verdict("p", {"cpu": 8000}, [{"cpu": 4000}], [{"cpu": 6000}])
    assert answer.largest == {"cpu": 6000}
    assert answer.message == (
        "no node nor node template in pool 'p' is that large: the largest allocatable cpu is 6 (requested 8)"
    )


def test_the_autoscalers_template_counts_as_a_node_the_pool_can_grow(client_api):
    from operations.models import PoolOperations

    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 4000})
    PoolOperations.objects.create(
        pool=pool, provider="simulated", max_nodes=3, node_template={"resources": {"cpu": 64000}}
    )
    assert ask(client_api, pool, resources={"cpu": "64"}, queue=True).status_code == 202
    PoolOperations.objects.filter(pool=pool).update(max_nodes=0)
    assert ask(client_api, pool, workload_id="job-2", resources={"cpu": "64"}, queue=True).status_code == 422


@pytest.mark.parametrize(("nobody_has", "one_has"), [("*B200*", "*H100*"), ("*[B]200*", "*[H]100*")])  # SQL / Python
def test_nodes_whose_devices_could_never_serve_make_no_capacity_cause(nobody_has, one_has):
    """A GPU nobody has: the node short of cpu would not take the request once freed either (its
    GPUs do not match), so the cause is the constraints, not insufficient capacity, and never
    "fragmented"; a model one of the nodes has keeps the capacity cause."""
    from leases.services import resolve_shape
    from tests.device_support import make_gpu_node

    pool = PoolFactory(name="gpu")
    busy, _ = make_gpu_node(pool, tag="busy", count=4)
    make_gpu_node(pool, tag="idle", count=4)
    NodeResource.objects.filter(node=busy, name="cpu").update(allocated=63000)  # 1 cpu free of 64

    def explain(glob):
        devices = [{"type": "nvidia.com/gpu", "count": 1, "constraints": [
            {"attribute": "model", "operator": "glob", "value": glob}]}]  # fmt: skip
        spec = resolve_shape(
            parse_spec({"workload_id": "w", "pool": "gpu", "resources": {"cpu": "2"}, "devices": devices})
        )
        return placement.diagnose(pool, spec[0])

    nobody = explain(nobody_has)
    assert nobody["reasons"] == {"insufficient_cpu": 1, "device_unmatched": 1}
    assert nobody["cause"] == "constraints" and nobody["fragmented"] is False
    assert "fragmented" not in nobody["message"]
    # The idle node's H100s taken: the busy node would hold an H100 request once freed.
    NodeResource.objects.filter(name="nvidia.com/gpu").exclude(node=busy).update(allocated=4)
    some = explain(one_has)
    assert some["reasons"] == {"insufficient_cpu": 1, "insufficient_nvidia_com_gpu": 1}
    assert some["cause"] == "fragmented"
