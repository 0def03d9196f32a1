"""A status report answers from the node as it is after its UPDATE, not from the snapshot it read.

The status report reads the node (authentication, ordering), then applies itself with one
conditional UPDATE that also clears the pending-instruction marker. A drain, an upgrade step or an
operator may commit between the two: the UPDATE still wins (its compare-and-swap is about the
heartbeat's own fields), and the marker it clears may carry a bit raised by that change. The
answer must then be built from the node as it now is, or the instruction behind the bit is lost
until the next periodic status report. This failed a 20-node roll in CI: a canary drained while
its report was in flight never got its upgrade instruction, timed out and rolled the upgrade back.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test import TestCase
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from fleet import status_reports
from fleet.events import Actor
from fleet.heartbeats import HeartbeatReport, apply_heartbeat
from fleet.instructions import Instruction
from fleet.models import Node
from maintenance import services as maintenance_services
from operations import rollout, upgrades
from tests.operations_support import ready_pool

pytestmark = pytest.mark.django_db

TARGET = {"version": "2.0.0", "artifact": {"ref": "https://artifacts.example/agent-2.0.0.whl", "sha256": "b" * 64}}


def report(node: Node, sequence: int) -> HeartbeatReport:
    return HeartbeatReport(
        incarnation=node.incarnation, sequence=sequence, observed_at=timezone.now(), ready=True, agent_version="1.0.0"
    )


def snapshot(node: Node) -> Node:
    """The node as the status report's authentication read it."""
    return Node.objects.select_related("pool").get(pk=node.pk)


def test_an_upgrade_step_committed_under_a_report_in_flight_reaches_that_report_or_keeps_its_bit():
    pool, [(node, _)] = ready_pool("race", 1)
    seen_by_report = snapshot(node)
    actor = Actor.system("test:operator")
    upgrade = upgrades.upgrade_create(data={"pool": pool.name, "target": TARGET, "canary_nodes": 0}, actor=actor)
    with TestCase.captureOnCommitCallbacks(execute=True):  # the tick's UPGRADE bit is raised on commit
        upgrades.upgrade_start(upgrade_id=upgrade.pk, expected_version=upgrade.version, actor=actor)
        rollout.advance(upgrade_id=upgrade.pk)
    moved = Node.objects.get(pk=node.pk)
    assert moved.lifecycle == "maintenance" and moved.instructions & Instruction.UPGRADE

    outcome = apply_heartbeat(
        node=seen_by_report, report=report(seen_by_report, 1), actor=Actor.for_node(seen_by_report)
    )

    assert outcome.applied
    after = Node.objects.get(pk=node.pk)
    delivered = outcome.instructions.get("upgrade", {}).get("version") == "2.0.0"
    assert delivered or after.instructions & Instruction.UPGRADE, "the upgrade instruction was lost with its bit"
    assert delivered, "the report answers from the node as it is now (in maintenance, told to upgrade)"
    assert (outcome.node.lifecycle, outcome.node.version) == (after.lifecycle, after.version)


def test_a_cordon_committed_under_a_report_in_flight_is_what_the_report_answers(monkeypatch):
    _, [(node, _)] = ready_pool("cordon", 1)
    seen_by_report = snapshot(node)
    maintenance_services.cordon_node(
        node_id=node.pk, expected_version=node.version, reason="disk swap", actor=Actor.system("test:operator")
    )

    def not_thread_safe(self, *args, **kwargs):
        # django-fsm's refresh lifts the ``protected`` flag of the field every thread shares: two
        # at once in a threaded server fail with "Direct lifecycle modification is not allowed".
        raise AssertionError("the heartbeat path must reload with Node.reload(), not refresh_from_db()")

    monkeypatch.setattr(Node, "refresh_from_db", not_thread_safe)

    outcome = apply_heartbeat(
        node=seen_by_report, report=report(seen_by_report, 1), actor=Actor.for_node(seen_by_report)
    )

    after = Node.objects.get(pk=node.pk)
    assert outcome.applied and after.cordoned and after.sequence == 1
    assert (outcome.node.cordoned, outcome.node.version) == (True, after.version)


def test_an_unchanged_node_is_not_read_again():
    _, [(node, _)] = ready_pool("quiet", 1)
    seen_by_report = snapshot(node)
    with CaptureQueriesContext(connection) as queries:
        outcome = apply_heartbeat(
            node=seen_by_report, report=report(seen_by_report, 1), actor=Actor.for_node(seen_by_report)
        )
    assert outcome.applied
    reads = [q["sql"] for q in queries if q["sql"].startswith('SELECT "fleet_node"."id"')]
    assert not reads, reads


def test_an_overdue_mark_committed_under_a_report_in_flight_is_cleared_by_that_report():
    """The overdue sweep sets a flag and a condition without bumping ``version``: the report's
    compare-and-swap covers the flag, so a report that read the node before the mark reads it
    again and clears both, rather than leaving ``StatusReportOverdue=True`` beside a cleared flag."""
    _, [(node, _)] = ready_pool("overdue", 1)
    t0 = timezone.now()
    apply_heartbeat(node=snapshot(node), report=report(node, 1), actor=Actor.for_node(node), now=t0)
    Node.objects.filter(pk=node.pk).update(status_report_due_at=t0)
    seen_by_report = snapshot(node)
    assert status_reports.mark_overdue(now=t0 + timedelta(seconds=10), actor=Actor.system("test:sweep")) == 1

    outcome = apply_heartbeat(
        node=seen_by_report,
        report=report(seen_by_report, 2),
        actor=Actor.for_node(seen_by_report),
        now=t0 + timedelta(seconds=11),
    )

    after = Node.objects.get(pk=node.pk)
    assert outcome.applied and after.sequence == 2 and not after.status_report_overdue
    assert "StatusReportOverdue" not in {c["type"] for c in after.conditions}, after.conditions
    assert after.events.filter(reason__startswith="StatusReportOverdue: True → ").exists()


# The pending-instruction marker against instructions kept in other apps' tables (no node version
# bump): the report's UPDATE sets the marker to 0 (a blind write, not ``instructions & ~mask``), so
# a bit raised after the report read the node is cleared with the others. That is safe only
# because every instruction is read after that UPDATE, and every poster raises its bit after its
# own write commits: either the report sees the instruction, or the bit is raised after the clear.


def test_a_checkpoint_asked_under_a_report_in_flight_is_in_that_reports_answer():
    """Posted between the report's read and its UPDATE: the bit is cleared, the order delivered."""
    from leases import fencing
    from tests.maintenance_support import make_lease

    pool, [(node, _)] = ready_pool("race", 1)
    lease = make_lease(node, "job-1", resources={"cpu": 500}, ttl=3600)
    seen_by_report = snapshot(node)
    with TestCase.captureOnCommitCallbacks(execute=True):
        fencing.request_checkpoint(lease=lease, actor=Actor.system("test:operator"))
    assert Node.objects.get(pk=node.pk).instructions & Instruction.CHECKPOINT
    assert Node.objects.get(pk=node.pk).version == seen_by_report.version  # no reload to rescue it

    outcome = apply_heartbeat(
        node=seen_by_report, report=report(seen_by_report, 1), actor=Actor.for_node(seen_by_report)
    )
    assert outcome.applied
    assert outcome.checkpoint_leases == [str(lease.pk)]
    assert Node.objects.get(pk=node.pk).instructions == 0


def test_a_grant_committed_after_a_report_read_the_leases_keeps_its_bit_for_the_next_renewal(client_user, monkeypatch):
    """Committed after the report listed the node's leases (so not in its answer): the grant raises
    LEASES after the report's UPDATE cleared the marker, and the next renewal says a lease waits."""
    from leases import reconcile as lease_reconcile
    from tests.support import grant

    pool, [(node, _)] = ready_pool("general", 1)
    seen_by_report = snapshot(node)
    real, granted = lease_reconcile.reconcile_heartbeat, []

    def then_a_grant_commits(*args, **kwargs):
        answer = real(*args, **kwargs)
        with TestCase.captureOnCommitCallbacks(execute=True):
            granted.append(grant(client_user, "job-1"))
        return answer

    monkeypatch.setattr(lease_reconcile, "reconcile_heartbeat", then_a_grant_commits)
    outcome = apply_heartbeat(
        node=seen_by_report, report=report(seen_by_report, 1), actor=Actor.for_node(seen_by_report)
    )
    assert outcome.applied and granted
    assert str(granted[0].pk) not in {a["lease_id"] for a in outcome.assigned_leases or []}
    assert Node.objects.get(pk=node.pk).instructions & Instruction.LEASES
