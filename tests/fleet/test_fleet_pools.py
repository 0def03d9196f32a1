import pytest

from fleet import event_types as fleet_events
from fleet.models import NodeEvent, NodeResource, Pool
from nodepool.api.versioning import etag_for
from tests.factories import NodeFactory, set_capacity
from tests.fleet_support import Signer, make_pool

pytestmark = pytest.mark.django_db
POOLS = "/api/v1/pools"


def test_operator_creates_a_pool_with_reservations_in_quantities(operator_api):
    body = {
        "name": "general",
        "kind": "standard",
        "labels": {"tier": "gold"},
        "taints": [{"key": "gpu", "value": "true", "effect": "NoSchedule"}],
        "reservations": {"system": {"cpu": "500m", "memory": "1Gi"}, "monitoring": {"cpu": "100m"}},
        "required_capabilities": {"resources": {"memory": "8Gi"}, "features": {"arch": "amd64"}},
        "allowed_agent_versions": ">=1.0,<2",
    }
    response = operator_api.post(POOLS, body, format="json")
    assert response.status_code == 201, response.json()
    data = response.json()
    assert data["reservations"] == {"system": {"cpu": 500, "memory": 2**30}, "monitoring": {"cpu": 100}}
    assert data["required_capabilities"]["resources"] == {"memory": 8 * 2**30}
    assert data["version"] == 1
    assert Pool.objects.get(name="general").reserved_totals() == {"cpu": 600, "memory": 2**30}


def test_reading_a_pool_gives_its_etag(client_api):
    make_pool(name="general")
    response = client_api.get(f"{POOLS}/general")
    assert response.status_code == 200
    assert response["ETag"] == etag_for(1, response.json())


@pytest.mark.parametrize(
    "body, field",
    [
        ({"heartbeat_interval": 10, "heartbeat_grace": 15}, "heartbeat_grace"),
        ({"heartbeat_grace": 40, "loss_threshold": 30}, "loss_threshold"),
        ({"heartbeat_interval": 0}, "heartbeat_interval"),
        ({"benchmark_tolerance": 1.5}, "benchmark_tolerance"),
        ({"attestation_required": True}, "attestation_public_key"),
        ({"attestation_public_key": "not a key"}, "attestation_public_key"),
    ],
)
def test_inconsistent_pool_policy_is_refused(operator_api, body, field):
    response = operator_api.post(POOLS, {"name": "p", **body}, format="json")
    assert response.status_code == 400, response.json()
    errors = response.json().get("errors") or []
    assert any(e["field"] == field for e in errors), response.json()
    assert Pool.objects.count() == 0


@pytest.mark.parametrize(
    "body, code",
    [
        ({"reservations": {"system": {"cpu": "lots"}}}, "invalid_quantity"),
        ({"reservations": {"party": {"cpu": "1"}}}, "validation_error"),
        ({"labels": {"bad key!": "x"}}, "validation_error"),
        ({"taints": [{"key": "gpu", "effect": "Sometimes"}]}, "validation_error"),
        ({"allowed_agent_versions": "~~1"}, "validation_error"),
        ({"required_capabilities": {"resources": {"cpu": "-1"}}}, "invalid_quantity"),
        ({"kind": "timeshare"}, "validation_error"),
        ({"version": 7}, "unknown_field"),
        ({"id": 7}, "unknown_field"),
        ({"unhealthy_conditions": "MemoryPressure"}, "validation_error"),
    ],
)
def test_bad_pool_input_is_refused(operator_api, body, code):
    response = operator_api.post(POOLS, {"name": "p", **body}, format="json")
    assert response.status_code == 400, response.json()
    assert response.json()["code"] == code
    assert Pool.objects.count() == 0


def test_duplicate_pool_name_conflicts(operator_api):
    make_pool(name="general")
    response = operator_api.post(POOLS, {"name": "general", "description": "another"}, format="json")
    assert (response.status_code, response.json()["code"]) == (400, "validation_error")
    assert Pool.objects.count() == 1
    assert Pool.objects.get().description == "a test pool"


def test_attestation_pool_accepts_an_ed25519_key(operator_api):
    body = {"name": "secure", "attestation_required": True, "attestation_public_key": Signer().public_pem}
    assert operator_api.post(POOLS, body, format="json").status_code == 201


def test_changing_a_pool_needs_the_version(operator_api):
    make_pool(name="general")
    url = f"{POOLS}/general"
    missing = operator_api.patch(url, {"description": "x"}, format="json")
    assert missing.status_code == 428
    stale = operator_api.patch(url, {"description": "x"}, format="json", HTTP_IF_MATCH='"7"')
    assert stale.status_code == 412
    ok = operator_api.patch(url, {"description": "x"}, format="json", HTTP_IF_MATCH='"1"')
    assert ok.status_code == 200
    assert ok.json()["version"] == 2 and ok["ETag"] == etag_for(2, ok.json())
    again = operator_api.patch(url, {"description": "y", "expected_version": 1}, format="json")
    assert again.status_code == 412
    assert Pool.objects.get().description == "x"


def test_patch_that_breaks_timings_changes_nothing(operator_api):
    make_pool(name="general")
    response = operator_api.patch(f"{POOLS}/general", {"heartbeat_grace": 5}, format="json", HTTP_IF_MATCH='"1"')
    assert response.status_code == 400
    pool = Pool.objects.get()
    assert pool.heartbeat_grace == 40 and pool.version == 1


def test_changing_reservations_recomputes_allocatable(operator_api):
    pool = make_pool(name="general")
    node = NodeFactory(pool=pool)
    set_capacity(node, {"cpu": 8000, "memory": 32 * 2**30})
    NodeResource.objects.filter(node=node, name="cpu").update(allocated=1000)
    response = operator_api.patch(
        f"{POOLS}/general",
        {"reservations": {"system": {"cpu": "1"}, "failure_margin": {"cpu": "500m", "memory": "2Gi"}}},
        format="json",
        HTTP_IF_MATCH='"1"',
    )
    assert response.status_code == 200, response.json()
    cpu = NodeResource.objects.get(node=node, name="cpu")
    memory = NodeResource.objects.get(node=node, name="memory")
    assert (cpu.capacity, cpu.reserved, cpu.allocatable, cpu.allocated) == (8000, 1500, 6500, 1000)
    assert (memory.reserved, memory.allocatable) == (2 * 2**30, 30 * 2**30)
    assert NodeEvent.objects.filter(node=node, type=fleet_events.POLICY).count() == 1
    operator_api.patch(f"{POOLS}/general", {"reservations": {}}, format="json", HTTP_IF_MATCH='"2"')
    cpu.refresh_from_db()
    assert (cpu.reserved, cpu.allocatable) == (0, 8000)


def test_reservations_larger_than_capacity_leave_zero_allocatable(operator_api):
    pool = make_pool(name="general")
    node = NodeFactory(pool=pool)
    set_capacity(node, {"cpu": 1000, "memory": 2**30})
    operator_api.patch(
        f"{POOLS}/general", {"reservations": {"system": {"cpu": "2"}}}, format="json", HTTP_IF_MATCH='"1"'
    )
    assert NodeResource.objects.get(node=node, name="cpu").allocatable == 0


def test_only_operators_change_pools(client_api, owner_api):
    make_pool(name="general")
    for api in (client_api, owner_api):
        assert api.post(POOLS, {"name": "x"}, format="json").status_code == 403
        assert (
            api.patch(f"{POOLS}/general", {"description": "x"}, format="json", HTTP_IF_MATCH='"1"').status_code == 403
        )
        assert api.delete(f"{POOLS}/general", HTTP_IF_MATCH='"1"').status_code == 403
    assert Pool.objects.get().description == "a test pool"
    assert Pool.objects.get().version == 1


def test_deleting_a_pool_with_nodes_conflicts(operator_api):
    pool = make_pool(name="general")
    NodeFactory(pool=pool)
    response = operator_api.delete(f"{POOLS}/general", HTTP_IF_MATCH='"1"')
    assert response.status_code == 409 and response.json()["code"] == "pool_has_nodes"
    assert Pool.objects.filter(name="general").exists(), "a refused delete keeps the pool"
    make_pool(name="empty")
    assert operator_api.delete(f"{POOLS}/empty").status_code == 428
    assert Pool.objects.filter(name="empty").exists()
    assert operator_api.delete(f"{POOLS}/empty", HTTP_IF_MATCH='"1"').status_code == 204
    assert not Pool.objects.filter(name="empty").exists()


def test_unknown_pool_is_404(operator_api):
    assert operator_api.get(f"{POOLS}/nope").status_code == 404
    assert operator_api.patch(f"{POOLS}/nope", {}, format="json", HTTP_IF_MATCH='"1"').status_code == 404


def test_changing_pool_labels_and_taints_reaches_members_but_keeps_operator_changes(operator_api):
    gpu = {"key": "gpu", "value": "true", "effect": "NoSchedule"}
    pool = make_pool(name="general", labels={"tier": "gold", "team": "a"}, taints=[gpu])
    node = NodeFactory(pool=pool, labels={"tier": "gold", "team": "b", "rack": "4"}, taints=[gpu])
    response = operator_api.patch(
        f"{POOLS}/general",
        {"labels": {"tier": "silver"}, "taints": [{"key": "spot", "value": "", "effect": "PreferNoSchedule"}]},
        format="json",
        HTTP_IF_MATCH='"1"',
    )
    assert response.status_code == 200, response.json()
    node.refresh_from_db()
    assert node.labels == {"tier": "silver", "team": "b", "rack": "4"}
    assert node.taints == [{"key": "spot", "value": "", "effect": "PreferNoSchedule"}]
    assert node.version == 2
    assert NodeEvent.objects.filter(node=node, type=fleet_events.POLICY).count() == 1
