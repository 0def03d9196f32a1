"""How ended leases count in their node's reliability record (leases.reliability, fleet.reliability)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from fleet import event_types
from fleet.events import Actor, record_event
from fleet.models import Node, NodeReliabilityDay
from fleet.reliability import record, refresh_scores
from leases.choices import DEVICE_FAULT_REVOKE_PREFIX
from leases.lifecycle import end_lease
from leases.models import Lease
from leases.reconcile import lose_node_leases, revoke_node_leases
from tests.factories import PoolFactory, make_schedulable_node, set_lifecycle
from tests.races import race
from tests.support import grant

pytestmark = pytest.mark.django_db
ACTOR = Actor.system("test")


@pytest.fixture
def node():
    node, _ = make_schedulable_node(PoolFactory(name="general"), resources={"cpu": 64000, "memory": 2**36})
    return node


def granted(user, name):
    return grant(user, name, pool="general")


def end(lease, state, reason="test", **extra):
    assert end_lease(lease.pk, to_state=state, actor=ACTOR, reason=reason, now=timezone.now(), **extra) is not None


def causes(node) -> dict:
    window = record(Node.objects.get(pk=node.pk))["windows"]["30d"]
    return {"completed": window["leases_completed"], **window["leases_node_fault_by_cause"]}


def test_each_way_a_lease_ends_counts_as_defined(client_user, node):
    # Completed: released by the client, whatever its job's outcome (a failed job is not the node's fault).
    end(granted(client_user, "ok"), "released", outcome="succeeded")
    end(granted(client_user, "job-failed"), "released", outcome="failed")
    # Not counted: expired (the client stopped renewing), revoked by an operator.
    end(granted(client_user, "expired"), "expired")
    end(granted(client_user, "operator"), "revoked", reason="operator revoked it")
    # Revoked by a device fault (leases.device_faults' reason).
    end(granted(client_user, "gpu"), "revoked", reason=f"{DEVICE_FAULT_REVOKE_PREFIX}GPU-1 tainted")
    # Lost while the node is alive: it stopped reporting the lease.
    end(granted(client_user, "unreported"), "lost", reason="not reported by the node for 3 heartbeats")
    # Failed right after an unplanned restart (a new incarnation after the grant).
    after_restart = granted(client_user, "after-restart")
    record_event(node, event_types.RESTART, ACTOR, reason="the agent restarted (new incarnation)")
    end(after_restart, "released", outcome="failed")
    # Lost with the node unreachable.
    lost = granted(client_user, "unreachable")
    Node.objects.filter(pk=node.pk).update(liveness="unreachable")
    assert lose_node_leases([node.pk], actor=ACTOR, reason="node unreachable past the loss threshold") == 1
    # Revoked because the node was quarantined.
    Node.objects.filter(pk=node.pk).update(liveness="alive")
    quarantined = granted(client_user, "quarantine")
    set_lifecycle(node, "quarantined")
    assert revoke_node_leases(node, actor=ACTOR, reason="node quarantined: test") == 1

    assert Lease.objects.get(pk=lost.pk).state == "lost"
    assert Lease.objects.get(pk=quarantined.pk).state == "revoked"
    assert causes(node) == {
        "completed": 2,
        "lost_unreachable": 1,
        "lost_unreported": 1,
        "lost_on_restart": 0,
        "failed_after_restart": 1,
        "revoked_device_fault": 1,
        "revoked_quarantine": 1,
    }


def test_a_lease_lost_after_the_node_restarted_counts_as_lost_on_restart(client_user, node):
    lease = granted(client_user, "job")
    record_event(node, event_types.RESTART, ACTOR, reason="the agent restarted (new incarnation)")
    end(lease, "lost", reason="the node restarted (new incarnation) and does not run this lease")
    assert causes(node)["lost_on_restart"] == 1


def test_a_failure_during_a_drain_is_not_an_unplanned_restart(client_user, node):
    lease = granted(client_user, "job")
    record_event(node, event_types.RESTART, ACTOR, reason="restart for maintenance")
    set_lifecycle(node, "draining")
    end(lease, "released", outcome="failed")
    assert causes(node)["completed"] == 1 and causes(node)["failed_after_restart"] == 0


def test_the_score_needs_the_minimum_sample_and_is_completed_over_counted(client_user, node, settings):
    settings.NODEPOOL = {**settings.NODEPOOL, "RELIABILITY_MIN_SAMPLE": 4}
    for index in range(3):
        end(granted(client_user, f"ok-{index}"), "released")
    refresh_scores()
    assert Node.objects.get(pk=node.pk).reliability is None  # 3 counted < 4: unrated
    end(granted(client_user, "gpu"), "revoked", reason=f"{DEVICE_FAULT_REVOKE_PREFIX}GPU-0 tainted")
    end(granted(client_user, "expired"), "expired")  # not counted
    assert refresh_scores() == 1
    current = Node.objects.get(pk=node.pk)
    assert current.reliability == 0.75
    shown = record(current)
    assert shown["reliability"] == 0.75 and shown["rated"] is True
    assert shown["windows"]["7d"]["reliability"] == 0.75
    assert shown["windows"]["30d"]["leases_node_fault"] == 1
    assert refresh_scores() == 0  # unchanged: nothing written


def test_a_rolled_back_lease_end_takes_its_count_back(client_user, node):
    from django.db import transaction

    lease = granted(client_user, "job")
    with pytest.raises(RuntimeError), transaction.atomic():
        end(lease, "released")
        raise RuntimeError("the ending transaction fails")
    assert not NodeReliabilityDay.objects.exists()


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_leases_ending_at_once_on_one_node_are_all_counted():
    from fleet.reliability import record_lease_outcome

    node, _ = make_schedulable_node(PoolFactory(name="race"))
    now = timezone.now()
    outcome = race(lambda i: record_lease_outcome(node_id=node.pk, outcome="completed", at=now), 4)
    assert not outcome.errors
    assert NodeReliabilityDay.objects.get(node=node).leases_completed == 4


def test_the_record_is_shown_to_the_client_the_owner_and_operators_alike(
    client_user, node, client_api, owner_api, operator_api, owner
):
    Node.objects.filter(pk=node.pk).update(owner=owner, reliability=0.98)
    end(granted(client_user, "ok"), "released")
    end(granted(client_user, "gpu"), "revoked", reason=f"{DEVICE_FAULT_REVOKE_PREFIX}GPU-0 tainted")
    for api in (client_api, owner_api, operator_api):
        detail = api.get(f"/api/v1/nodes/{node.pk}").json()
        assert detail["reliability"] == 0.98
        week = detail["reliability_record"]["windows"]["7d"]
        assert (week["leases_completed"], week["leases_node_fault"]) == (1, 1)
        assert week["leases_node_fault_by_cause"]["revoked_device_fault"] == 1
        listed = api.get("/api/v1/nodes?pool=general").json()["results"]
        assert [n["reliability"] for n in listed] == [0.98]
        assert listed[0]["reliability_record"]["windows"]["30d"]["leases_completed"] == 1
