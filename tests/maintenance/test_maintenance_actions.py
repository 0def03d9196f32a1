"""Operator actions on a node: each transition allowed and refused, versions, permissions, bad input, races."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from rest_framework.test import APIClient

from fleet import event_types as fleet_events
from fleet.choices import Lifecycle
from fleet.credentials import issue_credential
from fleet.models import AdmissionCheck, Node, NodeEvent, NodeHold
from leases.models import Lease
from maintenance import event_types as maintenance_events
from nodepool.api.versioning import etag_for
from tests.factories import NodeFactory, PoolFactory, make_schedulable_node, set_lifecycle
from tests.maintenance_support import act, allocated, make_lease
from tests.races import race

pytestmark = pytest.mark.django_db


@pytest.fixture
def node():
    node, _ = make_schedulable_node()
    return node


def node_in(state: str) -> Node:
    node, _ = make_schedulable_node()
    return set_lifecycle(node, state)


def test_cordon_places_the_callers_hold_and_records_who_when_and_why(operator_api, node):
    response = act(operator_api, node, "cordon", {"reason": "kernel upgrade tonight"})

    assert response.status_code == 200
    body = response.json()
    assert (body["lifecycle"], body["cordoned"]) == ("ready", True)
    assert [(h["owner"], h["reason"]) for h in body["holds"]] == [("user:olivia-operator", "kernel upgrade tonight")]
    assert body["version"] == 2
    assert response["ETag"] == etag_for(2, body)
    assert body["allowed_actions"] == ["cordon", "uncordon", "drain", "quarantine", "retire"]
    node.refresh_from_db()
    assert (node.lifecycle, node.cordoned) == ("ready", True)
    event = NodeEvent.objects.get(node=node, type=maintenance_events.HOLD)
    assert (event.to_state, event.actor_name, event.reason, event.data["owner"]) == (
        "held",
        "olivia-operator",
        "kernel upgrade tonight",
        "user:olivia-operator",
    )


def test_cordon_leaves_existing_leases_untouched(operator_api, node):
    lease = make_lease(node, "job-1")

    act(operator_api, node, "cordon")

    lease.refresh_from_db()
    assert lease.state == "active"
    assert allocated(node) == 1000


def test_uncordon_removes_the_callers_hold_and_the_node_is_schedulable_again(operator_api, node):
    act(operator_api, node, "cordon", {"reason": "check"})

    response = act(operator_api, node, "uncordon", {"reason": "done"})

    assert response.status_code == 200
    assert (response.json()["lifecycle"], response.json()["cordoned"], response.json()["holds"]) == ("ready", False, [])


@pytest.mark.parametrize(
    ("source", "action", "target"),
    [
        ("maintenance", "return-to-service", "admitting"),
        ("pending", "quarantine", "quarantined"),
        ("ready", "quarantine", "quarantined"),
        ("draining", "quarantine", "quarantined"),
        ("maintenance", "quarantine", "quarantined"),
        ("rejected", "quarantine", "quarantined"),
        ("quarantined", "release", "pending"),
        ("rejected", "release", "pending"),
        ("pending", "retire", "retired"),
        ("ready", "retire", "retired"),
        ("quarantined", "retire", "retired"),
        ("maintenance", "retire", "retired"),
    ],
)
def test_each_action_is_allowed_from_its_source_states(operator_api, source, action, target):
    node = node_in(source)

    response = act(operator_api, node, action, {"reason": "because"})

    assert response.status_code == 200, response.json()
    node.refresh_from_db()
    assert node.lifecycle == target
    events = NodeEvent.objects.filter(node=node, type=fleet_events.LIFECYCLE)
    assert events.filter(from_state=source, to_state=target).exists()


@pytest.mark.parametrize(
    ("source", "action", "allowed"),
    [
        ("ready", "return-to-service", ["cordon", "drain", "quarantine", "retire"]),
        ("draining", "drain", ["cordon", "repair-drain", "quarantine", "retire"]),
        ("ready", "release", ["cordon", "drain", "quarantine", "retire"]),
        ("quarantined", "quarantine", ["cordon", "release", "retire"]),
        ("retired", "quarantine", []),
        ("retired", "retire", []),
        ("retired", "release", []),
        ("retired", "cordon", []),
        ("admitting", "drain", ["cordon", "quarantine", "retire"]),
    ],
)
def test_a_refused_transition_is_409_listing_the_allowed_actions_and_changes_nothing(
    operator_api, source, action, allowed
):
    node = node_in(source)
    body = {"reason": "because"}
    if action == "drain":
        body.update(deadline_in=600)

    response = act(operator_api, node, action, body)

    assert response.status_code == 409
    problem = response.json()
    assert response["Content-Type"] == "application/problem+json"
    assert problem["code"] == "transition_not_allowed"
    assert problem["lifecycle"] == source
    assert problem["allowed_actions"] == allowed
    node.refresh_from_db()
    assert (node.lifecycle, node.version) == (source, 1)
    assert not NodeEvent.objects.filter(node=node).exists()


def test_a_stale_if_match_is_412_and_changes_nothing(operator_api, node):
    response = act(operator_api, node, "cordon", version=7)

    assert response.status_code == 412
    assert response.json()["code"] == "version_mismatch"
    assert response.json()["current_version"] == 1
    node.refresh_from_db()
    assert node.lifecycle == "ready"


def test_a_missing_version_is_428(operator_api, node):
    response = operator_api.post(f"/api/v1/nodes/{node.pk}/cordon", {"reason": "x"}, format="json")

    assert response.status_code == 428
    assert response.json()["code"] == "version_required"


def test_expected_version_in_the_body_works_like_if_match(operator_api, node):
    ok = operator_api.post(f"/api/v1/nodes/{node.pk}/cordon", {"reason": "x", "expected_version": 1}, format="json")
    stale = operator_api.post(
        f"/api/v1/nodes/{node.pk}/uncordon", {"reason": "x", "expected_version": 1}, format="json"
    )

    assert ok.status_code == 200
    assert stale.status_code == 412


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        ({}, {"HTTP_IF_MATCH": '"1"'}, 400, "validation_error"),
        ({"reason": ""}, {"HTTP_IF_MATCH": '"1"'}, 400, "validation_error"),
        ({"reason": "x" * 2001}, {"HTTP_IF_MATCH": '"1"'}, 400, "validation_error"),
        ({"reason": "x"}, {"HTTP_IF_MATCH": "banana"}, 400, "invalid_if_match"),
        ({"reason": "x", "expected_version": "one"}, {}, 400, "validation_error"),
        ({"reason": "x"}, {"HTTP_IF_MATCH": "*"}, 428, "version_required"),  # RFC 9110: * is no version
    ],
)
def test_bad_input_to_an_action_is_a_4xx_problem_and_changes_nothing(operator_api, node, body, headers, status, code):
    response = operator_api.post(f"/api/v1/nodes/{node.pk}/cordon", body, format="json", **headers)

    assert response.status_code == status
    assert response.json()["code"] == code
    node.refresh_from_db()
    assert (node.lifecycle, node.version) == ("ready", 1)


def test_malformed_json_is_400(operator_api, node):
    response = operator_api.post(
        f"/api/v1/nodes/{node.pk}/cordon", "{not json", content_type="application/json", HTTP_IF_MATCH='"1"'
    )

    assert response.status_code == 400
    assert response.json()["code"] == "malformed_body"


def test_an_unknown_node_is_404(operator_api):
    response = operator_api.post(
        "/api/v1/nodes/00000000-0000-0000-0000-000000000000/cordon", {"reason": "x"}, HTTP_IF_MATCH='"1"'
    )

    assert response.status_code == 404
    assert response.json()["code"] == "node_not_found"


def test_anonymous_users_owners_and_clients_may_not_act(anon_api, owner_api, client_api, owner, node):
    Node.objects.filter(pk=node.pk).update(owner=owner)

    assert act(anon_api, node, "cordon").status_code == 401
    assert act(owner_api, node, "cordon").status_code == 403
    assert act(client_api, node, "cordon").status_code == 403
    node.refresh_from_db()
    assert node.lifecycle == "ready"


def test_a_node_credential_may_not_cordon_its_own_node(node):
    _, secret = issue_credential(node=node, issuer="test")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Node {secret}")

    response = act(api, node, "cordon")

    assert (response.status_code, response.json()["code"]) == (403, "forbidden")
    node.refresh_from_db()
    assert (node.lifecycle, node.cordoned, node.version) == ("ready", False, 1)
    assert not NodeHold.objects.filter(node=node).exists()


def test_release_needs_the_release_permission():
    node = node_in(Lifecycle.QUARANTINED)
    junior = User.objects.create_user("junior")
    junior.user_permissions.add(Permission.objects.get(codename="operate_node"))
    api = APIClient()
    api.force_authenticate(junior)

    refused = act(api, node, "release", {"reason": "fixed"})
    junior.user_permissions.add(Permission.objects.get(codename="release_node"))
    junior = User.objects.get(pk=junior.pk)  # drop the permission cache
    api.force_authenticate(junior)
    allowed = act(api, node, "release", {"reason": "fixed"})

    assert refused.status_code == 403
    assert "fleet.release_node" in refused.json()["detail"]
    assert allowed.status_code == 200


def test_retire_refuses_a_node_with_live_leases_unless_forced(operator_api, node):
    lease = make_lease(node, "job-1")

    refused = act(operator_api, node, "retire", {"reason": "decommissioned"})
    forced = act(operator_api, node, "retire", {"reason": "decommissioned", "force": True})

    assert refused.status_code == 409
    assert refused.json()["code"] == "node_has_live_leases"
    assert refused.json()["live_leases"] == 1
    assert forced.status_code == 200
    assert forced.json()["allowed_actions"] == []
    lease.refresh_from_db()
    assert lease.state == "revoked"
    assert allocated(node) == 0


def test_retire_keeps_identity_history_and_credentials(operator_api, node):
    act(operator_api, node, "cordon")
    act(operator_api, node, "retire", {"reason": "end of life"})

    node.refresh_from_db()
    assert Node.objects.filter(pk=node.pk, lifecycle="retired").exists()
    assert NodeEvent.objects.filter(node=node).count() == 2
    assert node.holds.filter(removed_at__isnull=True).count() == 1  # retire leaves holds alone
    # Left valid on purpose: the retired node's calls get 410 node_retired, not 401.
    assert node.credentials.filter(revoked_at__isnull=True).exists()


def test_return_to_service_moves_maintenance_to_admitting_never_ready(operator_api):
    node = node_in(Lifecycle.MAINTENANCE)

    response = act(operator_api, node, "return-to-service", {"reason": "disk replaced"})  # on commit: no task here

    assert response.status_code == 200
    assert response.json()["lifecycle"] == "admitting"
    assert NodeEvent.objects.get(node=node, to_state="admitting").data["admission_queued"] is True


def test_return_to_service_starts_a_new_admission_attempt_whose_checks_run(
    operator_api, django_capture_on_commit_callbacks
):
    node = node_in(Lifecycle.MAINTENANCE)
    attempt = node.admission_attempt

    with django_capture_on_commit_callbacks(execute=True):  # fleet.run_admission, eager
        act(operator_api, node, "return-to-service", {"reason": "disk replaced"})

    node.refresh_from_db()
    assert node.admission_attempt == attempt + 1
    assert AdmissionCheck.objects.filter(node=node, attempt=attempt + 1).exists()
    assert node.lifecycle != Lifecycle.MAINTENANCE


def test_return_to_service_queues_admission_when_fleet_services_lacks_queue_admission(operator_api, monkeypatch):
    """The fallback path: maintenance looked fleet's entry point up by name when it was called, and
    without ``queue_admission`` fell back to ``fleet.services.start_admission``, which never existed
    (start_admission is the model's pending → admitting transition). The node was left admitting
    with no attempt queued, and the stalled-admission sweep would then re-run its previous attempt,
    whose checks had all passed. fleet.services.queue_admission is the one entry point, imported once."""
    import fleet.services

    node = node_in(Lifecycle.MAINTENANCE)
    attempt = node.admission_attempt
    monkeypatch.delattr(fleet.services, "queue_admission")

    act(operator_api, node, "return-to-service", {"reason": "disk replaced"})

    node.refresh_from_db()
    assert (node.lifecycle, node.admission_attempt) == (Lifecycle.ADMITTING, attempt + 1)
    assert NodeEvent.objects.get(node=node, to_state="admitting").data["admission_queued"] is True


def _race(requests: list) -> list[int]:
    """Run each zero-argument callable in its own thread at once; return their HTTP statuses."""
    outcome = race(lambda index: requests[index]().status_code, len(requests))
    assert not outcome.errors, outcome.errors
    return sorted(outcome.results)


def _operator_client(name: str) -> APIClient:
    from django.contrib.auth.models import Group

    user = User.objects.create_user(name)
    user.groups.add(Group.objects.get_or_create(name="operators")[0])
    api = APIClient()
    api.force_authenticate(user)
    return api


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_operators_cordoning_the_same_version_exactly_one_wins():
    node, _ = make_schedulable_node()
    apis = [_operator_client(f"op-{i}") for i in range(4)]
    url = f"/api/v1/nodes/{node.pk}/cordon"

    statuses = _race([lambda api=api: api.post(url, {"reason": "r"}, HTTP_IF_MATCH='"1"') for api in apis])

    assert statuses == [200, 412, 412, 412]
    node.refresh_from_db()
    assert (node.lifecycle, node.cordoned, node.version) == ("ready", True, 2)
    assert node.holds.count() == 1
    assert NodeEvent.objects.filter(node=node, type=maintenance_events.HOLD).count() == 1


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_quarantine_and_drain_racing_on_the_same_version_exactly_one_wins():
    node, _ = make_schedulable_node()
    make_lease(node, "job-1")
    first, second = _operator_client("op-a"), _operator_client("op-b")
    base = f"/api/v1/nodes/{node.pk}"

    statuses = _race(
        [
            lambda: first.post(f"{base}/quarantine", {"reason": "incident"}, HTTP_IF_MATCH='"1"'),
            lambda: second.post(f"{base}/drain", {"reason": "window", "deadline_in": 600}, HTTP_IF_MATCH='"1"'),
        ]
    )

    assert sorted(statuses) in ([200, 412], [201, 412])
    node.refresh_from_db()
    assert node.version == 2
    assert node.lifecycle in ("quarantined", "draining")
    assert Lease.objects.filter(node=node).count() == 1


def test_a_pending_node_made_by_the_factory_can_be_quarantined_without_credentials(operator_api):
    node = NodeFactory()

    response = act(operator_api, node, "quarantine", {"reason": "suspicious enrollment"})

    assert response.status_code == 200
    assert response.json()["quarantine"]["credentials_revoked"] == 0


@pytest.mark.parametrize(
    ("action", "body"),
    [
        ("cordon", {"reason": "k", "expires_in": 60}),  # expires_at, misspelt: a hold that never ends
        ("cordon", {"reason": "k", "dry_run": True}),
        ("quarantine", {"reason": "k", "evidnce": {}}),
        ("retire", {"reason": "k", "force": "yes"}),  # a string never switches an option on
        ("retire", {"reason": "k", "force": 1}),
    ],
)
def test_an_unknown_member_or_a_non_boolean_option_is_refused_and_changes_nothing(operator_api, action, body):
    node, _ = make_schedulable_node(PoolFactory())
    response = operator_api.post(f"/api/v1/nodes/{node.pk}/{action}", body, format="json", HTTP_IF_MATCH='"1"')
    assert response.status_code == 400
    assert response.json()["code"] in ("unknown_field", "validation_error")
    node.refresh_from_db()
    assert (node.lifecycle, node.cordoned, node.version) == ("ready", False, 1)
