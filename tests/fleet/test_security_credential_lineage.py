"""Credential lineage: only the newest credential rotates, reuse after the overlap revokes the
lineage, rotation is throttled per node — all kept in the database (issue 11, item 1)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from fleet import event_types as fleet_events
from fleet.models import Node, NodeCredential, NodeEvent
from tests.fleet_support import enroll, fresh_throttles, make_pool, make_token, node_api  # noqa: F401
from tests.heartbeat_support import beat
from tests.problems import assert_problem

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fresh_throttles")]


@pytest.fixture
def enrolled(anon_api):
    token = make_token(make_pool(name="general"), max_uses=10)
    body = enroll(anon_api, token).json()
    return Node.objects.get(pk=body["node_id"]), body["credential"]


def _rotate(secret, node):
    return node_api(secret).post(f"/api/v1/nodes/{node.pk}/credentials/rotate", {}, format="json")


def _heartbeat(secret, node, sequence):
    return node_api(secret).post(f"/api/v1/nodes/{node.pk}/heartbeats", beat(sequence), format="json")


def test_an_old_credential_cannot_mint_credentials_after_a_rotation(enrolled):
    node, c0 = enrolled
    assert _rotate(c0, node).status_code == 201

    attempts = [_rotate(c0, node) for _ in range(5)]

    for response in attempts:
        assert_problem(response, 409, "credential_superseded")
    assert NodeCredential.objects.filter(node=node).count() == 2


def test_a_superseded_credential_used_after_its_overlap_revokes_the_whole_lineage(enrolled, time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    node, c0 = enrolled
    c1 = _rotate(c0, node).json()["credential"]
    c2 = _rotate(c1, node).json()["credential"]
    assert _heartbeat(c2, node, 1).status_code == 200
    time_machine.shift(301)

    response = _heartbeat(c0, node, 2)

    assert assert_problem(response, 401, "authentication_failed")["reason"] == "credential_superseded"
    assert not NodeCredential.objects.filter(node=node, revoked_at__isnull=True).exists()
    assert assert_problem(_heartbeat(c2, node, 3), 401)["reason"] == "credential_revoked"
    event = NodeEvent.objects.get(node=node, type=fleet_events.SECURITY)
    assert event.data["revoked"] == 3 and "lineage revoked" in event.reason


def test_a_superseded_credential_within_its_overlap_still_authenticates_but_revokes_nothing(enrolled):
    node, c0 = enrolled
    _rotate(c0, node)

    assert _heartbeat(c0, node, 1).status_code == 200
    assert NodeCredential.objects.filter(node=node, revoked_at__isnull=True).count() == 2
    assert not NodeEvent.objects.filter(node=node, type=fleet_events.SECURITY).exists()


def test_an_expired_credential_that_was_never_rotated_is_just_expired(enrolled, time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    node, c0 = enrolled
    time_machine.shift(24 * 3600 + 1)

    assert assert_problem(_heartbeat(c0, node, 1), 401)["reason"] == "credential_expired"
    assert not NodeEvent.objects.filter(node=node, type=fleet_events.SECURITY).exists()


def test_rotation_is_throttled_per_node_from_the_database(enrolled, settings, anon_api):
    settings.NODEPOOL = {**settings.NODEPOOL, "CREDENTIAL_ROTATIONS_PER_HOUR": 3}
    node, secret = enrolled
    for _ in range(3):
        secret = _rotate(secret, node).json()["credential"]

    refused = _rotate(secret, node)

    body = assert_problem(refused, 429, "rotation_throttled")
    assert 0 < int(refused["Retry-After"]) <= 3600 and body["retry_after"] == int(refused["Retry-After"])
    assert NodeCredential.objects.filter(node=node).count() == 4
    # Another node is not affected by this node's count.
    other_token = make_token(make_pool(name="other"))
    other = enroll(anon_api, other_token, hostname="h2.example.test").json()
    assert _rotate(other["credential"], Node.objects.get(pk=other["node_id"])).status_code == 201


def test_the_throttle_window_slides(enrolled, settings, time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    settings.NODEPOOL = {**settings.NODEPOOL, "CREDENTIAL_ROTATIONS_PER_HOUR": 1}
    node, secret = enrolled
    secret = _rotate(secret, node).json()["credential"]
    assert _rotate(secret, node).status_code == 429
    time_machine.shift(3601)

    assert _rotate(secret, node).status_code == 201


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_racing_rotations_with_one_credential_make_exactly_one_successor():
    from tests.factories import PoolFactory, make_schedulable_node
    from tests.fleet.test_heartbeats_concurrency import race

    node, secret = make_schedulable_node(PoolFactory())

    statuses = race(lambda i: _rotate(secret, node).status_code, count=6)

    assert sorted(statuses) == [201, 409, 409, 409, 409, 409]
    assert NodeCredential.objects.filter(node=node, issuer="rotation").count() == 1
    assert NodeCredential.objects.filter(node=node, superseded_by__isnull=False).count() == 1
