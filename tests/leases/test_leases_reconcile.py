"""Reconciliation through heartbeats, node-wide loss and revocation, drain dry-runs, consistency."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.core.management import call_command
from django.utils import timezone

from fleet.events import Actor
from fleet.models import Node, NodeResource
from leases.models import ConsistencyReport, Lease
from leases.reconcile import (
    lose_node_leases,
    reconcile_heartbeat,
    revoke_node_leases,
    simulate_placement,
)
from leases.sweeps import check_consistency
from tests import support
from tests.factories import PoolFactory, make_schedulable_node

pytestmark = pytest.mark.django_db
ACTOR = Actor.system("test")


@pytest.fixture
def pool():
    return PoolFactory(name="general")


@pytest.fixture
def node(pool):
    return make_schedulable_node(pool)[0]


def grant(client_user, workload_id="job-1", cpu="1", **extra):
    # A command by default: the node runs the lease, so it is expected in the node's reports.
    return support.grant(client_user, workload_id, cpu=cpu, **{"command": ["sleep", "30"], **extra})


def report(lease, token=None):
    return {
        "lease_id": str(lease.pk),
        "fencing_token": lease.fencing_token if token is None else token,
        "state": "running",
    }


def heartbeat(node, reported, *, restarted=False, incarnation=None):
    node = Node.objects.get(pk=node.pk)
    return reconcile_heartbeat(
        node, incarnation=incarnation or node.incarnation, reported=reported, restarted=restarted, actor=ACTOR
    )


def test_unknown_ended_and_stale_leases_are_told_to_stop(client_user, node):
    live = grant(client_user, "live")
    ended = grant(client_user, "ended")
    lose_node_leases([node.pk], actor=ACTOR, reason="test")
    fresh = grant(client_user, "fresh")
    unknown = "00000000-0000-0000-0000-000000000001"
    reported = [report(live), report(ended), report(fresh, token=0), {"lease_id": unknown, "fencing_token": 1}]
    result = heartbeat(node, reported)
    assert set(result["stop"]) == {str(live.pk), str(ended.pk), str(fresh.pk), unknown}
    assert result["checkpoint"] == []


def test_a_lease_not_reported_for_three_heartbeats_is_lost(client_user, node):
    lease = grant(client_user)
    with time_machine.travel(timezone.now() + timedelta(seconds=30)):
        for _ in range(2):
            heartbeat(node, [])
        assert Lease.objects.get(pk=lease.pk).state == "granted"
        heartbeat(node, [])
    assert Lease.objects.get(pk=lease.pk).state == "lost"
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 0


def test_a_placement_only_lease_the_node_does_not_list_is_never_lost(client_user, node):
    # The agent lists only the leases it runs; a lease without a command is placement only.
    lease = grant(client_user, command=[])
    with time_machine.travel(timezone.now() + timedelta(seconds=30)):
        for _ in range(10):
            heartbeat(node, [])
    stored = Lease.objects.get(pk=lease.pk)
    assert stored.state == "granted"
    assert stored.missed_reports == 0
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 1000


def test_a_reported_lease_resets_its_miss_count(client_user, node):
    lease = grant(client_user)
    with time_machine.travel(timezone.now() + timedelta(seconds=30)):
        heartbeat(node, [])
        heartbeat(node, [])
        heartbeat(node, [report(lease)])
        heartbeat(node, [])
    stored = Lease.objects.get(pk=lease.pk)
    assert stored.state == "granted"
    assert stored.missed_reports == 1


def test_a_just_granted_lease_is_not_counted_missing(client_user, node):
    lease = grant(client_user)
    for _ in range(5):
        heartbeat(node, [])
    assert Lease.objects.get(pk=lease.pk).missed_reports == 0


def test_after_a_restart_reported_leases_are_adopted_and_the_rest_lost(client_user, node):
    kept = grant(client_user, "kept")
    dropped = grant(client_user, "dropped")
    Node.objects.filter(pk=node.pk).update(incarnation=2)
    result = heartbeat(node, [report(kept)], restarted=True, incarnation=2)
    assert result["stop"] == []
    assert Lease.objects.get(pk=kept.pk).node_incarnation == 2
    assert Lease.objects.get(pk=dropped.pk).state == "lost"


def test_a_node_back_after_its_leases_were_lost_is_told_to_stop(client_user, node):
    lease = grant(client_user)
    assert lose_node_leases([node.pk], actor=ACTOR, reason="unreachable") == 1
    assert lose_node_leases([node.pk], actor=ACTOR, reason="unreachable") == 0
    replacement = grant(client_user)
    assert replacement.fencing_token > lease.fencing_token
    assert heartbeat(node, [report(lease)])["stop"] == [str(lease.pk)]
    assert Lease.objects.filter(workload_id="job-1", state__in=["granted", "active"]).count() == 1


def test_checkpoint_requests_come_back_in_the_heartbeat(client_user, node):
    lease = grant(client_user)
    Lease.objects.filter(pk=lease.pk).update(checkpoint_requested_at=timezone.now())
    assert heartbeat(node, [report(lease)])["checkpoint"] == [str(lease.pk)]


def test_revoking_a_nodes_leases_fences_them(client_user, node):
    lease = grant(client_user)
    assert revoke_node_leases(node, actor=ACTOR, reason="quarantine") == 1
    assert Lease.objects.get(pk=lease.pk).state == "revoked"
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 0


def test_simulate_placement_finds_another_node_and_changes_nothing(client_user, pool, node):
    lease = grant(client_user, cpu="6")
    assert simulate_placement(lease, exclude_node_ids=[node.pk])["placeable"] is False
    other, _ = make_schedulable_node(pool)
    result = simulate_placement(lease, exclude_node_ids=[node.pk])
    assert result == {"placeable": True, "node_id": str(other.pk), "reasons": {}, "message": result["message"]}
    assert NodeResource.objects.get(node=other, name="cpu").allocated == 0


def test_simulate_placement_explains_why_not(client_user, pool, node):
    lease = grant(client_user, cpu="6")
    make_schedulable_node(pool, resources={"cpu": 2000, "memory": 2**30})
    result = simulate_placement(lease, exclude_node_ids=[node.pk])
    assert result["reasons"] == {"excluded": 1, "insufficient_cpu": 1}
    assert result["message"].startswith("0/2 nodes are available")


def test_consistency_check_reports_and_repairs_drift(client_user, node):
    grant(client_user, cpu="2")
    assert check_consistency().drift == []
    NodeResource.objects.filter(node=node, name="cpu").update(allocated=5000)
    report_ = check_consistency()
    assert report_.drift == [{"node_id": str(node.pk), "resource": "cpu", "allocated": 5000, "leased": 2000}]
    assert node.events.filter(reason="capacity drift").exists()
    call_command("check_lease_capacity", "--repair")
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 2000
    assert ConsistencyReport.objects.count() == 3
    assert check_consistency().drift == []


def test_consistency_check_finds_every_kind_of_drift_in_a_fixed_number_of_reads(
    client_user, pool, django_assert_max_num_queries
):
    """A counter above its leases, a leased resource whose counter is zero, and one with no row at
    all are drift; a zero-amount lease on a zero counter is not. The first pass reads the fleet in
    two queries whatever its size (one per leased resource made it never finish at 10,000 nodes)."""
    from tests.maintenance_support import make_lease

    nodes = [make_schedulable_node(pool)[0] for _ in range(5)]
    for i, node in enumerate(nodes):
        make_lease(node, f"w{i}", resources={"cpu": 1000})
    NodeResource.objects.filter(node=nodes[0], name="cpu").update(allocated=3000)  # above its lease
    NodeResource.objects.filter(node=nodes[1], name="cpu").update(allocated=0)  # leased, counter zero
    make_lease(nodes[2], "gpu-job", resources={"nvidia.com/gpu": 1})  # leased, no row at all
    make_lease(nodes[3], "nothing", resources={"memory": 0})  # zero on zero: fine
    with django_assert_max_num_queries(2 + 3 * 6):  # two reads, then six per suspect node
        report = check_consistency()
    assert sorted((d["node_id"], d["resource"], d["allocated"], d["leased"]) for d in report.drift) == sorted(
        [
            (str(nodes[0].pk), "cpu", 3000, 1000),
            (str(nodes[1].pk), "cpu", 0, 1000),
            (str(nodes[2].pk), "nvidia.com/gpu", 0, 1),
        ]
    )
    assert report.nodes_checked == 5
