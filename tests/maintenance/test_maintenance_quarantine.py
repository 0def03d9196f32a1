"""Quarantine (manual and automatic rules), release to a fresh admission, owners' view."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from fleet import event_types as fleet_events
from fleet.credentials import issue_credential
from fleet.events import Actor
from fleet.models import Node, NodeEvent
from leases import event_types as leases_events
from leases.models import Lease
from maintenance import event_types as maintenance_events
from maintenance import rules
from maintenance.models import Drain, Quarantine
from tests.factories import PoolFactory, make_schedulable_node, set_lifecycle
from tests.maintenance_support import act, allocated, make_lease

pytestmark = pytest.mark.django_db

NODE_ACTOR = Actor.system("heartbeat")


@pytest.fixture
def node():
    return make_schedulable_node()[0]


def test_quarantine_revokes_credentials_and_leases_at_once_and_blocks_artifacts(operator_api, node):
    issue_credential(node=node, issuer="test")
    leases = [make_lease(node, f"job-{i}") for i in range(2)]

    response = act(operator_api, node, "quarantine", {"reason": "crypto miner found", "evidence": {"process": "xmrig"}})

    assert response.status_code == 200
    body = response.json()
    assert (body["lifecycle"], body["artifacts_blocked"], body["lifecycle_reason"]) == (
        "quarantined",
        True,
        "crypto miner found",
    )
    assert body["quarantine"]["credentials_revoked"] == 2
    assert body["quarantine"]["leases_revoked"] == 2
    assert body["quarantine"]["evidence"] == {"process": "xmrig"}
    assert not node.credentials.filter(revoked_at__isnull=True).exists()
    assert {lease.state for lease in Lease.objects.filter(pk__in=[le.pk for le in leases])} == {"revoked"}
    assert allocated(node) == 0
    kinds = set(NodeEvent.objects.filter(node=node).values_list("type", flat=True))
    assert {
        fleet_events.LIFECYCLE,
        maintenance_events.QUARANTINE,
        fleet_events.CREDENTIAL,
        leases_events.LEASE,
    } <= kinds


def test_a_quarantined_nodes_credential_is_refused(operator_api, node):
    _, secret = issue_credential(node=node, issuer="test")
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Node {secret}")

    act(operator_api, node, "quarantine", {"reason": "incident"})
    response = agent.get("/api/v1/drains")

    assert response.status_code == 401
    assert response.json()["code"] == "authentication_failed"


def test_a_revoked_lease_frees_the_workload_to_be_placed_again_with_a_larger_token(operator_api, node):
    lease = make_lease(node, "job-1")
    other = make_schedulable_node()[0]

    act(operator_api, node, "quarantine", {"reason": "incident"})
    replacement = make_lease(other, "job-1")

    assert replacement.fencing_token > lease.fencing_token


def test_quarantining_a_draining_node_aborts_its_drain(operator_api, node):
    make_lease(node, "job-1")
    act(operator_api, node, "drain", {"reason": "window", "deadline_in": 600})

    act(operator_api, node, "quarantine", {"reason": "incident"})

    assert Drain.objects.get(node=node).state == "aborted"


def test_the_owner_sees_the_quarantine_and_its_reason_and_other_owners_do_not(
    operator_api, owner_api, owner, other_owner, node
):
    Node.objects.filter(pk=node.pk).update(owner=owner)
    act(operator_api, node, "quarantine", {"reason": "disk image tampered", "evidence": {"sha256": "ab12"}})
    other_api = APIClient()
    other_api.force_authenticate(other_owner)

    mine = owner_api.get("/api/v1/quarantines")
    theirs = other_api.get("/api/v1/quarantines")

    assert mine.status_code == 200
    [record] = mine.json()["results"]
    assert (record["reason"], record["node_lifecycle"], record["evidence"]) == (
        "disk image tampered",
        "quarantined",
        {"sha256": "ab12"},
    )
    assert theirs.json()["count"] == 0
    assert other_api.get(f"/api/v1/quarantines/{record['id']}").status_code == 404


def test_quarantine_evidence_must_be_an_object(operator_api, node):
    response = act(operator_api, node, "quarantine", {"reason": "x", "evidence": ["not", "an", "object"]})

    assert response.status_code == 400
    node.refresh_from_db()
    assert node.lifecycle == "ready"


def test_release_sends_the_node_back_to_pending_for_a_fresh_admission(operator_api, node):
    act(operator_api, node, "quarantine", {"reason": "incident"})

    response = act(operator_api, node, "release", {"reason": "reimaged"})

    assert response.status_code == 200
    body = response.json()
    assert body["lifecycle"] == "pending"  # never straight to ready
    assert body["allowed_actions"] == ["admit", "cordon", "quarantine", "retire"]
    assert body["artifacts_blocked"] is False
    assert "credential" not in body  # a new one comes through re-enrollment
    quarantine = Quarantine.objects.get(node=node)
    assert (quarantine.release_reason, quarantine.released_by_name) == ("reimaged", "olivia-operator")
    assert not node.credentials.filter(revoked_at__isnull=True).exists()


def test_release_can_issue_a_new_credential_shown_once(operator_api, node):
    act(operator_api, node, "quarantine", {"reason": "incident"})

    response = act(operator_api, node, "release", {"reason": "reimaged", "issue_credential": True})

    secret = response.json()["credential"]
    assert secret.startswith("npn_")
    assert node.credentials.filter(revoked_at__isnull=True).count() == 1
    assert secret not in str(list(NodeEvent.objects.values_list("data", flat=True)))


def test_usage_above_capacity_quarantines_the_node_naming_the_rule_and_evidence(node):
    rule = rules.evaluate_heartbeat(node, usage={"cpu": 64000, "memory": 1}, agent_version="1.0.0", actor=NODE_ACTOR)

    assert rule == "impossible_usage"
    assert node.lifecycle == "quarantined"  # the caller's instance is refreshed
    quarantine = Quarantine.objects.get(node=node)
    assert quarantine.rule == "impossible_usage"
    assert quarantine.reason.startswith("impossible_usage: ")
    assert "cpu 64000 > capacity 8000" in quarantine.reason
    assert quarantine.evidence["over_capacity"] == {"cpu": {"usage": 64000, "capacity": 8000, "in_inventory": True}}


def test_usage_within_capacity_and_tolerance_is_fine(node):
    assert (
        rules.evaluate_heartbeat(node, usage={"cpu": 8200, "memory": 1}, agent_version="1.0.0", actor=NODE_ACTOR)
        is None
    )
    node.refresh_from_db()
    assert node.lifecycle == "ready"


@pytest.mark.parametrize(
    ("allowed", "version", "quarantined"),
    [
        ("", "0.1", False),
        (">=1.0,<2", "1.4.2", False),
        (">=1.0,<2", "1.5.0rc1", False),
        (">=1.0,<2", "2.0.0", True),
        (">=1.0,<2", "0.9", True),
        (">=1.0,<2", "not-a-version", True),
        ("~=1.2", "1.1", True),
        ("this is not a specifier", "1.0", False),
    ],
)
def test_agent_versions_outside_the_pools_allowed_set_quarantine(allowed, version, quarantined):
    pool = PoolFactory(allowed_agent_versions=allowed)
    node = make_schedulable_node(pool)[0]

    rule = rules.evaluate_heartbeat(node, usage={}, agent_version=version, actor=NODE_ACTOR)

    assert (rule == "agent_version_not_allowed") is quarantined
    assert (node.lifecycle == "quarantined") is quarantined


def test_rules_leave_quarantined_and_retired_nodes_alone(node):
    set_lifecycle(node, "retired")

    assert rules.evaluate_heartbeat(node, usage={"cpu": 10**9}, agent_version="1", actor=NODE_ACTOR) is None
    assert rules.attestation_failed(node, detail="bad signature", actor=NODE_ACTOR) is None
    assert not Quarantine.objects.exists()


def test_attestation_and_integrity_failures_quarantine_with_their_rule(node):
    second = make_schedulable_node()[0]

    assert rules.attestation_failed(node, detail="signature does not verify", actor=NODE_ACTOR) == "attestation_failed"
    assert (
        rules.integrity_check_failed(second, check="benchmark_nonce", detail="nonce replayed", actor=NODE_ACTOR)
        == "integrity_check_failed"
    )
    assert Quarantine.objects.get(node=node).reason == "attestation_failed: signature does not verify"
    assert Quarantine.objects.get(node=second).evidence["check"] == "benchmark_nonce"


def test_declared_capacity_far_above_verified_quarantines(node):
    assert rules.evaluate_declared_capacity(node, declared={"cpu": 9000}, actor=NODE_ACTOR) is None
    assert (
        rules.evaluate_declared_capacity(node, declared={"cpu": 64000}, actor=NODE_ACTOR) == "capacity_above_verified"
    )
    assert Quarantine.objects.get(node=node).evidence["over"] == {"cpu": {"declared": 64000, "verified": 8000}}


def test_an_automatic_quarantine_is_reversible_by_an_operator(operator_api, node):
    rules.attestation_failed(node, detail="bad signature", actor=NODE_ACTOR)

    response = act(operator_api, node, "release", {"reason": "false positive: key rotated"})

    assert response.status_code == 200
    assert response.json()["lifecycle"] == "pending"
    assert Quarantine.objects.get(node=node).released_at is not None


def test_a_heartbeat_transaction_can_save_its_node_after_a_rule_quarantined_it(node):
    from django.db import transaction

    with transaction.atomic():
        held = Node.objects.select_for_update().get(pk=node.pk)
        held.sequence = 7
        held.save(update_fields=["sequence"])
        rule = rules.evaluate_heartbeat(held, usage={"cpu": 10**6}, agent_version="1.0.0", actor=NODE_ACTOR)
        held.usage = {"cpu": 10**6}
        held.save(update_fields=["usage"])  # no ConcurrentTransition: the instance was brought up to date

    assert rule == "impossible_usage"
    stored = Node.objects.get(pk=node.pk)
    assert (stored.lifecycle, stored.sequence, stored.usage, stored.version) == ("quarantined", 7, {"cpu": 10**6}, 2)


@pytest.mark.parametrize(
    ("url", "status"),
    [
        ("/api/v1/quarantines?open=maybe", 400),
        ("/api/v1/quarantines?rule=whim", 400),
        ("/api/v1/quarantines?node=not-a-uuid", 400),
        ("/api/v1/quarantines/not-a-number", 404),
        ("/api/v1/drains/not-a-uuid", 404),
        ("/api/v1/drains?policy=yolo", 400),
        ("/api/v1/drains/00000000-0000-0000-0000-000000000000", 404),
        ("/api/v1/disruption-budgets/abc", 404),
    ],
)
def test_bad_read_queries_are_4xx_problems(operator_api, url, status):
    response = operator_api.get(url)

    assert response.status_code == status
    assert response["Content-Type"] == "application/problem+json"


def test_quarantines_filter_open_and_released(operator_api, node):
    act(operator_api, node, "quarantine", {"reason": "incident"})
    act(operator_api, node, "release", {"reason": "fixed"})
    second = make_schedulable_node()[0]
    act(operator_api, second, "quarantine", {"reason": "incident"})

    open_ones = operator_api.get("/api/v1/quarantines?open=true").json()
    closed = operator_api.get("/api/v1/quarantines?open=false").json()

    assert [q["node"] for q in open_ones["results"]] == [str(second.pk)]
    assert [q["node"] for q in closed["results"]] == [str(node.pk)]


def test_the_heartbeat_rules_cost_one_query_and_none_without_usage(django_assert_num_queries):
    pool = PoolFactory(allowed_agent_versions=">=1.0")
    node = make_schedulable_node(pool)[0]
    deferred = Node.objects.select_related("pool").only("id", "lifecycle", "pool__id").get(pk=node.pk)
    loaded = Node.objects.select_related("pool").get(pk=node.pk)

    with django_assert_num_queries(1):
        assert rules.evaluate_heartbeat(deferred, usage={"cpu": 100}, agent_version="1.2", actor=NODE_ACTOR) is None
    with django_assert_num_queries(0):
        assert rules.evaluate_heartbeat(loaded, usage={}, agent_version="1.2", actor=NODE_ACTOR) is None
    with django_assert_num_queries(1):
        assert rules.evaluate_heartbeat(deferred, usage={}, agent_version="1.2", actor=NODE_ACTOR) is None
