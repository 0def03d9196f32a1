import pytest
from django.utils import timezone

from fleet import event_types as fleet_events
from fleet.choices import Lifecycle, PoolKind
from fleet.models import BootstrapToken, Node, NodeCredential, NodeEvent
from tests.fleet_support import ENROLL, enroll, enrollment, make_pool, make_token

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fresh_throttles")]
from tests.fleet_support import fresh_throttles  # noqa: E402,F401


def test_enrollment_creates_a_pending_node_with_a_credential(anon_api):
    pool = make_pool(
        name="general", labels={"tier": "gold"}, taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}]
    )
    token = make_token(pool)

    response = enroll(anon_api, token)

    assert response.status_code == 201, response.json()
    body = response.json()
    node = Node.objects.get(pk=body["node_id"])
    assert body["incarnation"] == 1
    assert body["lifecycle"] == "pending"
    assert body["heartbeat_interval"] == 10
    assert body["credential"].startswith("npn_")
    assert node.lifecycle == Lifecycle.PENDING
    assert node.declared["resources"] == {"cpu": 8000, "memory": 32 * 2**30, "ephemeral-storage": 100 * 2**30}
    assert node.node_labels == {"zone": "a"}
    assert node.labels == {"tier": "gold"}
    assert node.taints == [{"key": "gpu", "value": "true", "effect": "NoSchedule"}]
    assert node.verified == {}
    credential = NodeCredential.objects.get(node=node)
    assert credential.issuer == "enrollment" and credential.agent_version == "1.0.0"
    assert body["credential"] not in credential.secret_hash
    assert NodeEvent.objects.filter(node=node, type=fleet_events.ENROLLED).count() == 1
    assert BootstrapToken.objects.get().uses == 1


def test_every_enrollment_gets_a_new_identity_even_with_the_same_hostname(anon_api):
    token = make_token(make_pool())
    first = enroll(anon_api, token).json()["node_id"]
    second = enroll(anon_api, token).json()["node_id"]
    assert first != second
    assert Node.objects.count() == 2


def test_marketplace_node_is_owned_by_the_tokens_owner(anon_api, owner):
    pool = make_pool(kind=PoolKind.MARKETPLACE)
    token = make_token(pool, owner=owner)
    node_id = enroll(anon_api, token).json()["node_id"]
    assert Node.objects.get(pk=node_id).owner == owner


@pytest.mark.parametrize(
    "field, value",
    [
        ("id", "3bf81f79-014d-4ecb-b215-55f7a712fd84"),
        ("node_id", "cf4dde32-cd4d-4ced-a181-81c11582002d"),
        ("lifecycle", "ready"),
        ("verified", {"resources": {"cpu": 64000}}),
        ("owner", 1),
        ("incarnation", 9),
        ("allocatable", {"cpu": 1}),
        ("taints", []),
    ],
)
def test_protected_attributes_in_enrollment_are_refused_and_nothing_is_created(anon_api, field, value):
    pool = make_pool()
    token = make_token(pool)
    response = enroll(anon_api, token, **{field: value})
    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == "protected_field"
    assert Node.objects.count() == 0
    assert BootstrapToken.objects.get().uses == 0


def test_unknown_member_is_refused(anon_api):
    token = make_token(make_pool())
    response = enroll(anon_api, token, favourite_colour="blue")
    assert response.status_code == 400
    assert response.json()["code"] == "unknown_field"
    assert Node.objects.count() == 0


def test_enrollment_naming_another_pool_is_refused(anon_api):
    make_pool(name="other")
    token = make_token(make_pool(name="general"))
    response = enroll(anon_api, token, pool="other")
    assert response.status_code == 403
    assert response.json()["code"] == "bootstrap_token_wrong_pool"
    assert Node.objects.count() == 0
    assert enroll(anon_api, token, pool="general").status_code == 201


def test_unknown_and_malformed_tokens_are_refused(anon_api):
    pool = make_pool()
    real = make_token(pool)
    forged = real[: real.index(".") + 1] + "x" * 40
    for token in ["npb_nothing", "npb_0123456789ab.secret", forged, "npn_" + real[4:]]:
        response = enroll(anon_api, token)
        assert (response.status_code, response.json()["code"]) == (403, "bootstrap_token_invalid"), token
    empty = enroll(anon_api, "")  # no token at all is a malformed body, not a refused token
    assert (empty.status_code, empty.json()["code"]) == (400, "validation_error")
    assert Node.objects.count() == 0
    assert BootstrapToken.objects.get().uses == 0, "no use spent by a refused enrollment"


def test_expired_token_is_refused(anon_api, time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    token = make_token(make_pool(), ttl=60)
    time_machine.shift(120)
    response = enroll(anon_api, token)
    assert response.status_code == 403
    assert response.json()["code"] == "bootstrap_token_expired"
    assert Node.objects.count() == 0


def test_exhausted_token_is_refused(anon_api):
    token = make_token(make_pool(), max_uses=1)
    assert enroll(anon_api, token).status_code == 201
    response = enroll(anon_api, token)
    assert response.status_code == 403
    assert response.json()["code"] == "bootstrap_token_exhausted"
    assert Node.objects.count() == 1


def test_revoked_token_is_refused(anon_api, operator_api):
    token = make_token(make_pool())
    token_id = BootstrapToken.objects.get().pk
    assert operator_api.post(f"/api/v1/bootstrap-tokens/{token_id}/revoke").status_code == 200
    response = enroll(anon_api, token)
    assert response.status_code == 403
    assert response.json()["code"] == "bootstrap_token_revoked"


@pytest.mark.parametrize(
    "capability, field",
    [
        ({"resources": {"cpu": "eight"}}, "capability.resources.cpu"),
        ({"resources": {"memory": "-4Gi"}}, "capability.resources.memory"),
        ({"resources": {"nvidia.com/gpu": "0.5"}}, "capability.resources.nvidia.com/gpu"),
        ({"resources": {"cpu": "1e400"}}, "capability.resources.cpu"),
        ({"resources": {"Bad Name!": "1"}}, "capability.resources.Bad Name!"),
        ({"resources": {"cpu": True}}, "capability.resources.cpu"),
        ({"features": {"colour": "blue"}}, "capability.features.colour"),
        ({"accelerators": [{"type": "gpu", "count": -1}]}, "capability.accelerators[0].count"),
        ({"cpu": "8"}, "capability.cpu"),
        ("8 cores", "capability"),
    ],
)
def test_malformed_capability_is_a_validation_error(anon_api, capability, field):
    token = make_token(make_pool())
    response = enroll(anon_api, token, capability=capability)
    assert response.status_code == 400, response.json()
    body = response.json()
    # Anything the quantity parser refuses has one code on every endpoint (issue 11).
    assert body["code"] == ("invalid_quantity" if ".resources." in field else "validation_error")
    assert body["errors"][0]["field"] == field
    assert Node.objects.count() == 0
    assert BootstrapToken.objects.get().uses == 0


@pytest.mark.parametrize(
    "override",
    [
        {"labels": {"bad key!": "x"}},
        {"labels": {"zone": "x" * 64}},
        {"labels": ["zone"]},
        {"addresses": ["not-an-ip"]},
        {"addresses": "10.0.0.1"},
        {"agent_version": ""},
        {"hostname": "h" * 300},
        {"attestation": {"document": "x"}},
        {"attestation": {"document": "x", "signature": "y", "extra": 1}},
    ],
)
def test_bad_metadata_is_refused(anon_api, override):
    token = make_token(make_pool())
    response = enroll(anon_api, token, **override)
    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    assert Node.objects.count() == 0


def test_missing_token_and_non_object_bodies_are_refused(anon_api):
    body = enrollment("x")
    del body["bootstrap_token"]
    assert anon_api.post(ENROLL, body, format="json").status_code == 400
    assert anon_api.post(ENROLL, [1, 2], format="json").json()["code"] == "malformed_body"
    response = anon_api.post(ENROLL, "{not json", content_type="application/json")
    assert response.status_code == 400 and response.json()["code"] == "malformed_body"


def test_oversized_and_deeply_nested_enrollments_are_refused(anon_api):
    token = make_token(make_pool())
    huge = enroll(
        anon_api,
        token,
        display_name="x" * 200,
        hostname="h",
        labels={},
        attestation=None,
        capability={"resources": {"cpu": "1"}, "features": {"services": ["s" * 199] * 32}},
        addresses=["10.0.0.1"] * 32,
    )
    assert huge.status_code == 201, huge.json()  # within every limit: handled normally
    assert Node.objects.get(pk=huge.json()["node_id"]).display_name == "x" * 200
    deep: dict = {}
    cursor = deep
    for _ in range(30):
        cursor["a"] = {}
        cursor = cursor["a"]
    response = enroll(anon_api, token, capability=deep)
    assert response.status_code == 422
    assert response.json()["code"] == "json_too_deep"
    big = enrollment(token, display_name="x" * (200 * 1024))
    response = anon_api.post(ENROLL, big, format="json")
    assert response.status_code == 413
    assert response.json()["code"] == "payload_too_large"


def test_a_user_token_header_is_ignored_by_enrollment(operator_api):
    token = make_token(make_pool())
    assert enroll(operator_api, token).status_code == 201


def test_the_pools_taints_reach_the_new_node_stamped_with_the_enrollment_time(anon_api, time_machine):
    time_machine.move_to("2026-11-30T06:00:00Z", tick=False)
    taint = {"key": "dedicated", "value": "batch", "effect": "NoExecute"}
    pool = make_pool(name="tainted", taints=[taint])

    response = enroll(anon_api, make_token(pool))

    assert response.status_code == 201
    node = Node.objects.get(pk=response.json()["node_id"])
    assert node.taints == [taint]
    assert node.taints_added_at == {"dedicated:NoExecute": "2026-11-30T06:00:00+00:00"}
