import pytest
from django.utils import timezone

from fleet import event_types as fleet_events
from fleet.models import Node, NodeCredential, NodeEvent
from tests.factories import NodeFactory, set_lifecycle
from tests.fleet_support import enroll, fresh_throttles, make_pool, make_token, node_api  # noqa: F401

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fresh_throttles")]


@pytest.fixture
def enrolled(anon_api):
    """Enroll a node; returns ``(node, credential_secret)``."""
    token = make_token(make_pool(name="general"), max_uses=10)

    def make(**overrides):
        body = enroll(anon_api, token, **overrides).json()
        return Node.objects.get(pk=body["node_id"]), body["credential"]

    return make


def _rotate(secret, node, body=None):
    return node_api(secret).post(f"/api/v1/nodes/{node.pk}/credentials/rotate", body or {}, format="json")


def test_rotation_issues_a_new_credential_and_the_old_one_overlaps_briefly(enrolled, time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    node, old = enrolled()
    response = _rotate(old, node, {"agent_version": "1.1.0"})
    assert response.status_code == 201, response.json()
    body = response.json()
    new = body["credential"]
    assert new != old
    previous = NodeCredential.objects.get(node=node, issuer="enrollment")
    fresh = NodeCredential.objects.get(node=node, issuer="rotation")
    assert previous.rotated_at is not None
    assert (previous.expires_at - timezone.now()).total_seconds() == 300
    assert fresh.agent_version == "1.1.0"
    assert NodeEvent.objects.filter(node=node, type=fleet_events.CREDENTIAL).count() == 1
    # The old one still authenticates during the overlap, but only the newest may rotate.
    assert _rotate(old, node).json()["code"] == "credential_superseded"
    assert _rotate(new, node).status_code == 201


def test_a_node_cannot_rotate_another_nodes_credential(enrolled):
    node, secret = enrolled()
    other, _ = enrolled(hostname="other")
    response = _rotate(secret, other)
    assert response.status_code == 403
    assert NodeCredential.objects.filter(node=other).count() == 1


def test_rotation_refuses_bad_input(enrolled):
    node, secret = enrolled()
    assert _rotate(secret, node, {"lifecycle": "ready"}).json()["code"] == "protected_field"
    assert _rotate(secret, node, {"agent_version": "x" * 100}).status_code == 400
    assert NodeCredential.objects.filter(node=node).count() == 1
    garbage = node_api("npn_garbage").post(f"/api/v1/nodes/{node.pk}/credentials/rotate", {}, format="json")
    assert garbage.status_code == 401


def test_users_cannot_rotate_node_credentials(enrolled, operator_api):
    node, _ = enrolled()
    assert operator_api.post(f"/api/v1/nodes/{node.pk}/credentials/rotate", {}, format="json").status_code == 403


def test_a_retired_node_cannot_rotate(enrolled):
    node, secret = enrolled()
    set_lifecycle(node, "retired")
    response = _rotate(secret, node)
    assert response.status_code == 410 and response.json()["code"] == "node_retired"


def test_operator_revokes_one_nodes_credentials_only(enrolled, operator_api):
    node, secret = enrolled()
    other, other_secret = enrolled(hostname="other")
    url = f"/api/v1/nodes/{node.pk}/credentials/revoke"
    assert operator_api.post(url, {}, format="json").status_code == 428
    response = operator_api.post(url, {"reason": "stolen laptop"}, format="json", HTTP_IF_MATCH='"1"')
    assert response.status_code == 200, response.json()
    assert response.json()["revoked"] == 1
    assert _rotate(secret, node).status_code == 401
    assert _rotate(other_secret, other).status_code == 201
    assert Node.objects.get(pk=node.pk).version == 2
    event = NodeEvent.objects.get(node=node, type=fleet_events.CREDENTIAL)
    assert event.reason == "stolen laptop" and event.actor_name == "olivia-operator"


def test_operator_issues_a_credential_shown_once(enrolled, operator_api):
    node, _ = enrolled()
    url = f"/api/v1/nodes/{node.pk}/credentials"
    response = operator_api.post(url, {"ttl_seconds": 3600, "reason": "lost state file"}, format="json",
                                 HTTP_IF_MATCH='"1"')  # fmt: skip
    assert response.status_code == 201, response.json()
    secret = response.json()["credential"]
    assert response.json()["issuer"] == "operator:olivia-operator"
    issued = NodeCredential.objects.get(node=node, issuer="operator:olivia-operator")
    assert secret.startswith(f"npn_{issued.prefix}.") and issued.secret_hash and secret not in issued.secret_hash
    assert (issued.expires_at - issued.issued_at).total_seconds() == 3600
    assert Node.objects.get(pk=node.pk).version == 2
    assert _rotate(secret, node).status_code == 201
    detail = operator_api.get(f"/api/v1/nodes/{node.pk}").json()
    assert secret not in str(detail)
    assert {c["issuer"] for c in detail["credentials"]} >= {"enrollment", "operator:olivia-operator"}


@pytest.mark.parametrize(
    "body, status",
    [({"ttl_seconds": 5}, 400), ({"ttl_seconds": "long"}, 400), ({"scope": "all"}, 400)],
)
def test_operator_issue_bad_input(enrolled, operator_api, body, status):
    node, _ = enrolled()
    response = operator_api.post(f"/api/v1/nodes/{node.pk}/credentials", body, format="json", HTTP_IF_MATCH='"1"')
    assert response.status_code == status
    assert NodeCredential.objects.filter(node=node).count() == 1


def test_quarantined_and_retired_nodes_get_no_operator_credential(operator_api):
    quarantined = set_lifecycle(NodeFactory(), "quarantined")
    retired = set_lifecycle(NodeFactory(), "retired")
    q = operator_api.post(f"/api/v1/nodes/{quarantined.pk}/credentials", {}, format="json", HTTP_IF_MATCH='"1"')
    r = operator_api.post(f"/api/v1/nodes/{retired.pk}/credentials", {}, format="json", HTTP_IF_MATCH='"1"')
    assert (q.status_code, q.json()["code"]) == (409, "node_quarantined")
    assert (r.status_code, r.json()["code"]) == (410, "node_retired")
    assert NodeCredential.objects.count() == 0


def test_non_operators_cannot_issue_or_revoke(enrolled, client_api, owner_api):
    node, secret = enrolled()
    for api in (client_api, owner_api, node_api(secret)):
        for action in ("credentials", "credentials/revoke"):
            response = api.post(f"/api/v1/nodes/{node.pk}/{action}", {}, format="json", HTTP_IF_MATCH='"1"')
            assert response.status_code == 403, (api, action)
    assert NodeCredential.objects.filter(node=node, revoked_at__isnull=True).count() == 1


def test_a_node_credential_is_refused_everywhere_else(enrolled):
    node, secret = enrolled()
    api = node_api(secret)
    assert api.get("/api/v1/nodes").status_code == 403
    assert api.get(f"/api/v1/nodes/{node.pk}").status_code == 403
    assert api.post(f"/api/v1/nodes/{node.pk}/admit", {}, format="json", HTTP_IF_MATCH='"1"').status_code == 403
    assert api.get("/api/v1/pools").status_code == 403
    assert api.patch("/api/v1/pools/general", {"reservations": {}}, format="json",
                     HTTP_IF_MATCH='"1"').status_code == 403  # fmt: skip
    assert api.post("/api/v1/bootstrap-tokens", {"pool": "general"}, format="json").status_code == 403
    assert Node.objects.get().lifecycle == "pending"
