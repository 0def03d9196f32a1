"""Cordon holds: each actor owns its cordon; uncordon removes only the caller's; force is recorded.

Issue 12, case 3: an operator's cordon must survive an automation's cordon and uncordon.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.utils import timezone
from rest_framework.test import APIClient

from fleet.choices import Lifecycle
from fleet.events import Actor
from fleet.models import Node, NodeEvent, NodeHold
from fleet.selectors import schedulable_nodes, unschedulable_reasons
from maintenance import event_types as maintenance_events
from maintenance import holds
from nodepool.tokens import create_user_token
from tests.factories import NodeFactory, make_schedulable_node, set_lifecycle
from tests.maintenance_support import act, heartbeat
from tests.races import race

pytestmark = pytest.mark.django_db


@pytest.fixture
def node():
    node, _ = make_schedulable_node()
    return node


@pytest.fixture
def automation_api(db) -> APIClient:
    """An upgrade controller's account: may cordon and uncordon (fleet.operate_node), not an operator."""
    user = User.objects.create_user("upgrade-bot")
    user.user_permissions.add(Permission.objects.get(codename="operate_node"))
    _, key = create_user_token(user)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return api


def active_owners(node: Node) -> list[str]:
    return list(node.holds.filter(removed_at__isnull=True).order_by("created_at", "pk").values_list("owner", flat=True))


def test_an_automations_cordon_and_uncordon_leave_the_operators_cordon_in_place(operator_api, automation_api, node):
    assert act(operator_api, node, "cordon", {"reason": "hardware check"}).status_code == 200

    cordon = act(automation_api, node, "cordon", {"reason": "agent upgrade"})
    uncordon = act(automation_api, node, "uncordon", {"reason": "agent upgraded"})

    assert (cordon.status_code, uncordon.status_code) == (200, 200)
    body = uncordon.json()
    assert (body["lifecycle"], body["cordoned"]) == ("ready", True)
    assert [(h["owner"], h["reason"]) for h in body["holds"]] == [("user:olivia-operator", "hardware check")]
    node.refresh_from_db()
    assert node.cordoned is True
    assert not schedulable_nodes().filter(pk=node.pk).exists()
    assert unschedulable_reasons(node)[0]["code"] == "cordoned"


def test_uncordon_of_a_node_the_caller_does_not_hold_is_409_naming_the_holders(operator_api, automation_api, node):
    act(operator_api, node, "cordon", {"reason": "hardware check"})

    response = act(automation_api, node, "uncordon", {"reason": "oops"})

    assert response.status_code == 409
    assert response.json()["code"] == "hold_not_found"
    assert response.json()["holds"] == ["user:olivia-operator"]
    assert active_owners(node) == ["user:olivia-operator"]


def test_removing_someone_elses_hold_without_force_is_403(operator_api, automation_api, node):
    act(automation_api, node, "cordon", {"reason": "agent upgrade"})

    response = act(operator_api, node, "uncordon", {"reason": "mine now", "owner": "user:upgrade-bot"})

    assert response.status_code == 403
    assert response.json()["code"] == "hold_owned_by_other"
    assert active_owners(node) == ["user:upgrade-bot"]


def test_force_is_for_operators_only(operator_api, automation_api, node):
    act(operator_api, node, "cordon", {"reason": "hardware check"})

    response = act(automation_api, node, "uncordon", {"reason": "x", "owner": "user:olivia-operator", "force": True})

    assert response.status_code == 403
    assert response.json()["code"] == "force_requires_operator"
    assert active_owners(node) == ["user:olivia-operator"]


def test_an_operator_may_force_another_actors_hold_off_and_it_is_recorded(operator_api, automation_api, node):
    act(automation_api, node, "cordon", {"reason": "agent upgrade"})

    response = act(
        operator_api, node, "uncordon", {"reason": "controller is stuck", "owner": "user:upgrade-bot", "force": True}
    )

    assert response.status_code == 200
    assert response.json()["cordoned"] is False
    hold = NodeHold.objects.get(node=node)
    assert (hold.forced, hold.removed_by_name, hold.removal_reason) == (True, "olivia-operator", "controller is stuck")
    event = NodeEvent.objects.get(node=node, type=maintenance_events.HOLD, to_state="removed")
    assert (event.actor_name, event.data["owner"], event.data["forced"]) == (
        "olivia-operator",
        "user:upgrade-bot",
        True,
    )


def test_force_without_an_owner_removes_every_hold(operator_api, automation_api, node):
    act(automation_api, node, "cordon", {"reason": "agent upgrade"})
    holds.place_hold(node, "system:upgrade", "rolling upgrade")

    response = act(operator_api, node, "uncordon", {"reason": "all clear", "force": True})

    assert response.status_code == 200
    assert active_owners(node) == []
    assert set(NodeHold.objects.filter(node=node).values_list("forced", flat=True)) == {True}


def test_a_repeated_cordon_by_the_same_actor_refreshes_its_hold(operator_api, node):
    act(operator_api, node, "cordon", {"reason": "first"})
    response = act(operator_api, node, "cordon", {"reason": "second"})

    assert response.status_code == 200
    assert [(h["owner"], h["reason"]) for h in response.json()["holds"]] == [("user:olivia-operator", "second")]


def test_the_node_api_shows_every_hold(operator_api, automation_api, node):
    act(operator_api, node, "cordon", {"reason": "hardware check"})
    act(automation_api, node, "cordon", {"reason": "agent upgrade"})

    body = operator_api.get(f"/api/v1/nodes/{node.pk}").json()

    assert body["cordoned"] is True
    assert [h["owner"] for h in body["holds"]] == ["user:olivia-operator", "user:upgrade-bot"]
    assert body["schedulable"] is False
    assert body["unschedulable_reasons"][0]["code"] == "cordoned"
    assert "user:olivia-operator (hardware check)" in body["unschedulable_reasons"][0]["message"]


def test_a_drain_places_its_own_hold_which_outlives_completion_until_return_to_service(operator_api, node):
    act(operator_api, node, "cordon", {"reason": "hardware check"})
    heartbeat(node)
    response = act(operator_api, node, "drain", {"reason": "rack work", "policy": "terminate", "deadline_in": 600})
    drain_id = response.json()["id"]
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.MAINTENANCE  # no leases: the drain completed at once
    assert active_owners(node) == ["user:olivia-operator", f"drain:{drain_id}"]

    act(operator_api, node, "return-to-service", {"reason": "rack done"})

    node.refresh_from_db()
    assert active_owners(node) == ["user:olivia-operator"]  # the operator's own hold stays


def test_quarantine_and_release_leave_holds_alone(operator_api, node):
    holds.place_hold(node, "system:upgrade", "rolling upgrade")

    act(operator_api, node, "quarantine", {"reason": "incident"})
    act(operator_api, node, "release", {"reason": "cleared"})

    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.PENDING
    assert (node.cordoned, active_owners(node)) == (True, ["system:upgrade"])


def test_admission_never_clears_holds(operator_api, django_capture_on_commit_callbacks):
    pending = NodeFactory()
    holds.place_hold(pending, "user:olivia-operator", "keep it out until the burn-in ends")
    pending.refresh_from_db()

    with django_capture_on_commit_callbacks(execute=True):
        response = operator_api.post(
            f"/api/v1/nodes/{pending.pk}/admit", {}, format="json", HTTP_IF_MATCH=f'"{pending.version}"'
        )

    assert response.status_code == 202, response.json()
    pending.refresh_from_db()
    assert pending.lifecycle == Lifecycle.READY
    assert (pending.cordoned, active_owners(pending)) == (True, ["user:olivia-operator"])


def test_a_cordoned_node_gets_no_lease_and_gets_one_after_uncordon(operator_api, client_api, node):
    act(operator_api, node, "cordon", {"reason": "check"})
    ask = {"workload_id": "job-1", "resources": {"cpu": "500m"}, "ttl_seconds": 60}

    refused = client_api.post("/api/v1/node-leases", {**ask, "pool": node.pool.name}, format="json")
    act(operator_api, node, "uncordon", {"reason": "done"})
    granted = client_api.post("/api/v1/node-leases", {**ask, "pool": node.pool.name}, format="json")

    assert refused.status_code == 409
    assert refused.json()["reasons"] == {"cordoned": 1}
    assert granted.status_code == 201, granted.json()


def test_a_hold_with_an_expiry_ends_at_the_next_sweep(node):
    now = timezone.now()
    holds.place_hold(node, "system:health-check", "flapping", now + timedelta(minutes=5), now=now)

    assert holds.expire_holds(now=now + timedelta(minutes=4)) == 0
    assert holds.expire_holds(now=now + timedelta(minutes=5)) == 1

    node.refresh_from_db()
    assert node.cordoned is False
    assert NodeHold.objects.get(node=node).removal_reason == "hold expired"


@pytest.mark.parametrize(
    ("action", "body", "status", "code"),
    [
        ("cordon", {"reason": "x", "expires_at": "tomorrow"}, 400, "validation_error"),
        ("cordon", {"reason": "x", "expires_at": "2020-01-01T00:00:00Z"}, 422, "invalid_hold"),
        ("uncordon", {"reason": "x", "owner": "u" * 201, "force": True}, 400, "validation_error"),
        ("uncordon", {"reason": "x", "force": "sometimes"}, 400, "validation_error"),
        ("uncordon", {"reason": "x"}, 409, "hold_not_found"),
    ],
)
def test_bad_hold_input_is_a_4xx_problem_and_changes_nothing(operator_api, node, action, body, status, code):
    response = act(operator_api, node, action, body)

    assert response.status_code == status
    assert response.json()["code"] == code
    node.refresh_from_db()
    assert (node.cordoned, node.version) == (False, 1)


def test_a_retired_node_cannot_be_held(node):
    set_lifecycle(node, Lifecycle.RETIRED)

    with pytest.raises(Exception) as excinfo:
        holds.place_hold(node, "system:upgrade", "x")

    assert excinfo.value.get_codes() == "transition_not_allowed"
    assert not NodeHold.objects.exists()


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_actors_cordoning_and_one_uncordoning_at_once_keep_cordoned_in_step_with_the_holds():
    node, _ = make_schedulable_node()
    holds.place_hold(node, "system:scale-down", "candidate")
    calls = [
        lambda: holds.place_hold(node.pk, "system:upgrade", "upgrade"),
        lambda: holds.place_hold(node.pk, "user:olivia", "check", actor=Actor("user", "olivia")),
        lambda: holds.remove_hold(node.pk, "system:scale-down"),
    ]
    outcome = race(lambda index: calls[index](), len(calls))

    assert outcome.errors == []
    node.refresh_from_db()
    assert sorted(active_owners(node)) == ["system:upgrade", "user:olivia"]
    assert node.cordoned is True
    assert node.version == 5  # one bump per change, none lost


def test_a_node_whose_expired_holds_cannot_be_removed_does_not_keep_the_others_cordoned(monkeypatch, caplog):
    now = timezone.now()
    stuck, other = make_schedulable_node()[0], make_schedulable_node()[0]
    for n in (stuck, other):
        holds.place_hold(n, "system:health-check", "flapping", now + timedelta(minutes=5), now=now)
    remove = holds._remove

    def fails_on_the_stuck_node(locked, *args, **kwargs):
        if locked.pk == stuck.pk:
            raise RuntimeError("a deadlock victim")
        return remove(locked, *args, **kwargs)

    monkeypatch.setattr(holds, "_remove", fails_on_the_stuck_node)
    assert holds.expire_holds(now=now + timedelta(minutes=5)) == 1
    assert Node.objects.get(pk=other.pk).cordoned is False
    assert Node.objects.get(pk=stuck.pk).cordoned is True
    assert f"the expired holds of node {stuck.pk} could not be removed" in caplog.text
