"""Usage records and reconciliation: only evidenced time is billable; outcomes, holds, races."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
import time_machine

from fleet.events import Actor
from fleet.models import NodeEvent, NodeResource
from leases.fencing import lease_release
from maintenance import services as maintenance
from marketplace import event_types as marketplace_events
from marketplace.choices import GapReason, UsageState
from marketplace.models import PoolSettlement, UsageRecord
from marketplace.reconciliation import reconcile_due, reconcile_usage, resolve_usage, settlement_window
from tests.marketplace_support import ACTOR, Reporter, at, grant_at, owned_node, priced_pool

pytestmark = pytest.mark.django_db
OPERATOR = Actor.system("operator-test")


@pytest.fixture
def pool():
    return priced_pool()


@pytest.fixture
def node(pool, owner):
    return owned_node(pool, owner, "a")[0]


def release_at(seconds, lease, client_user, incarnation=1):
    with time_machine.travel(at(seconds), tick=False):
        lease_release(
            lease_id=lease.pk,
            data={"fencing_token": lease.fencing_token, "node_incarnation": incarnation, "outcome": "succeeded"},
            user=client_user,
            actor=ACTOR,
        )
    return UsageRecord.objects.get(lease=lease)


def settle(record, seconds_after_end=1000):
    return reconcile_usage(record.pk, actor=ACTOR, now=record.ended_at + timedelta(seconds=seconds_after_end))


def test_the_lease_end_opens_a_usage_record_pending_for_the_settlement_window(node, pool, client_user, owner):
    lease = grant_at(0, client_user, pool, "job-1", node=node)
    Reporter(node).every(10, 70, [lease])
    record = release_at(75, lease, client_user)
    assert (record.state, record.owner, record.node, record.pool) == (UsageState.PENDING, owner, node, pool)
    assert record.resources == {"cpu": 2000, "memory": 2**30}
    assert (record.started_at, record.ended_at, record.lease_state, record.outcome) == (
        at(0),
        at(75),
        "released",
        "succeeded",
    )
    assert record.settle_after == at(75) + timedelta(seconds=900)
    assert record.allocated_seconds == Decimal("75.000")
    # Early: the window has not passed, nothing changes.
    assert reconcile_usage(record.pk, actor=ACTOR, now=at(500)).state == UsageState.PENDING


def test_normal_work_reconciles_with_billable_time_equal_to_the_evidenced_time(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-2", node=node)
    Reporter(node).every(10, 70, [lease])
    record = settle(release_at(75, lease, client_user))
    assert record.state == UsageState.RECONCILED
    assert (record.evidenced_seconds, record.billable_seconds) == (Decimal(60), Decimal(60))
    assert [g["reason"] for g in record.gaps] == [GapReason.NOT_STARTED, GapReason.AFTER_LAST_REPORT]
    assert [g["seconds"] for g in record.gaps] == [10.0, 5.0]
    event = NodeEvent.objects.get(type=marketplace_events.USAGE, subject_type="usage_record", subject_id=str(record.pk))
    assert (event.from_state, event.to_state, event.lease_id) == ("pending", "reconciled", lease.pk)


def test_a_silent_period_is_a_gap_and_is_not_billed(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-3", node=node)
    reporter = Reporter(node)
    reporter.every(10, 100, [lease])
    reporter.every(200, 300, [lease])  # 100 s of silence
    record = settle(release_at(305, lease, client_user))
    assert record.state == UsageState.RECONCILED
    assert record.billable_seconds == Decimal(190)
    assert {
        "start": at(100).isoformat(),
        "end": at(200).isoformat(),
        "seconds": 100.0,
        "reason": GapReason.SILENCE,
    } in record.gaps


def test_a_node_that_was_lost_and_came_back_bills_only_what_it_evidenced(node, pool, client_user):
    from fleet.liveness_sweep import sweep_liveness

    lease = grant_at(0, client_user, pool, "job-4", node=node)
    reporter = Reporter(node)
    reporter.every(10, 100, [lease])
    with time_machine.travel(at(160), tick=False):
        sweep_liveness()  # unreachable after 40 s of grace
    reporter.every(200, 300, [lease])
    record = settle(release_at(305, lease, client_user))
    assert record.billable_seconds == Decimal(190)
    assert [g["reason"] for g in record.gaps if g["start"] == at(100).isoformat()] == [GapReason.UNREACHABLE]


def test_a_restart_bills_both_incarnations_evidence_but_not_the_restart_gap(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-5", node=node)
    reporter = Reporter(node)
    reporter.every(10, 100, [lease])
    reporter.every(130, 200, [lease], incarnation=2)
    record = settle(release_at(205, lease, client_user, incarnation=2))
    assert record.state == UsageState.RECONCILED
    assert record.billable_seconds == Decimal(90 + 70)
    assert [g["reason"] for g in record.gaps] == [
        GapReason.NOT_STARTED,
        GapReason.STALE_INCARNATION,
        GapReason.AFTER_LAST_REPORT,
    ]


def test_a_stale_token_report_is_never_evidence(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-6", node=node)
    reporter = Reporter(node)
    reporter.every(10, 50, [lease])
    reporter.every(60, 70, [lease], token=lease.fencing_token + 1)  # two: a third would lose the lease
    reporter.every(80, 120, [lease])
    record = settle(release_at(125, lease, client_user))
    assert record.billable_seconds == Decimal(40 + 40)
    assert GapReason.TOKEN_MISMATCH in [g["reason"] for g in record.gaps]


def test_a_lease_on_a_node_quarantined_during_it_is_held_until_the_quarantine_is_released(
    node, pool, client_user, operator
):
    lease = grant_at(0, client_user, pool, "job-7", node=node)
    Reporter(node).every(10, 100, [lease])
    with time_machine.travel(at(105), tick=False):
        quarantine = maintenance.quarantine_node(node_id=node.pk, reason="suspicious", evidence={}, actor=OPERATOR)
    record = settle(UsageRecord.objects.get(lease=lease))
    assert (record.state, record.held_by) == (UsageState.HELD, quarantine)
    assert record.billable_seconds == Decimal(90)
    # Still held on a re-run while the quarantine is open; released, the sweep reconciles it.
    assert settle(record).state == UsageState.HELD
    node.refresh_from_db()
    with time_machine.travel(at(5000), tick=False):
        maintenance.release_node(node_id=node.pk, expected_version=node.version, reason="cleared", actor=OPERATOR)
    assert reconcile_due(actor=ACTOR, now=at(5001)) == {"reconciled": 1}
    record.refresh_from_db()
    assert record.state == UsageState.RECONCILED and record.billable_seconds == Decimal(90)


def test_absent_usage_in_all_evidence_is_disputed_and_an_operator_resolves_it(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-8", node=node)
    Reporter(node).every(10, 100, [lease], usage={"cpu": 0, "memory": 0})
    record = settle(release_at(105, lease, client_user))
    assert record.state == UsageState.DISPUTED
    assert [f["code"] for f in record.findings] == ["absent_usage"]
    resolved = resolve_usage(
        record_id=record.pk,
        decision="adjust",
        billable_seconds=Decimal(30),
        expected_version=record.version,
        reason="partial work confirmed",
        actor=OPERATOR,
    )
    assert (resolved.state, resolved.billable_seconds) == (UsageState.ADJUSTED, Decimal(30))
    assert resolved.billable_intervals == [[at(10).isoformat(), at(40).isoformat()]]
    assert "partial work confirmed" in resolved.adjustment["why"]


def test_partly_absent_usage_is_adjusted_with_the_quantity_and_why(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-9", node=node)
    reporter = Reporter(node)
    reporter.every(10, 100, [lease])
    reporter.report(110, [])
    reporter.every(120, 150, [lease], usage={"cpu": 0, "memory": 0})
    record = settle(release_at(155, lease, client_user))
    assert record.state == UsageState.ADJUSTED
    assert record.billable_seconds == Decimal(90) and record.evidenced_seconds == Decimal(120)
    assert record.adjustment["quantity_seconds"] == "90.000"
    assert "no use of the allocated resources" in record.adjustment["why"]


def test_usage_above_the_nodes_capacity_is_disputed(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-10", node=node)
    # Below the automatic quarantine's margin would still be impossible: report memory far above capacity
    # through the evidence directly, as a node whose rule is not configured might.
    Reporter(node).every(10, 50, [lease])
    record = release_at(55, lease, client_user)
    from leases.models import EvidenceInterval

    EvidenceInterval.objects.filter(lease=lease).update(usage_max={"cpu": 99_000})
    record = settle(record)
    assert record.state == UsageState.DISPUTED
    assert [f["code"] for f in record.findings] == ["impossible_usage"]


def test_reconciling_twice_is_idempotent_and_writes_one_event(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-11", node=node)
    Reporter(node).every(10, 40, [lease])
    record = release_at(45, lease, client_user)
    first = settle(record)
    second = settle(record)
    assert (first.state, second.state, second.version) == (UsageState.RECONCILED, UsageState.RECONCILED, 2)
    assert NodeEvent.objects.filter(type=marketplace_events.USAGE, subject_id=str(record.pk)).count() == 1


def test_resolving_a_record_that_is_not_disputed_is_a_conflict(node, pool, client_user):
    from nodepool.api.problems import Conflict

    lease = grant_at(0, client_user, pool, "job-12", node=node)
    record = settle(release_at(45, lease, client_user))
    with pytest.raises(Conflict) as refused:
        resolve_usage(
            record_id=record.pk, decision="accept", expected_version=record.version, reason="x", actor=OPERATOR
        )
    assert refused.value.get_codes() == "usage_not_disputed"


def test_the_settlement_window_defaults_to_twice_the_scaled_loss_threshold_or_15_minutes(pool, settings):
    assert settlement_window(pool) == 900.0  # 2 x 300 s < 15 min
    pool.loss_threshold = 600
    pool.save()
    assert settlement_window(pool) == 1200.0
    PoolSettlement.objects.create(pool=pool, settlement_window=60)
    assert settlement_window(pool) == 601.0  # never at or below the loss threshold
    PoolSettlement.objects.filter(pool=pool).update(settlement_window=3600)
    assert settlement_window(pool) == 3600.0


def test_usage_of_a_device_the_node_does_not_have_is_disputed_and_noise_is_not(node, pool, client_user):
    """Reconciliation judges usage by the automatic quarantine's rule (maintenance.rules): a GPU in use
    on a node without GPUs is impossible; 3 % over capacity is measurement noise (5 % tolerance)."""
    from leases.models import EvidenceInterval

    capacity = NodeResource.objects.get(node=node, name="cpu").capacity
    for n, (peak, expected) in enumerate(
        [
            ({"cpu": 1000, "nvidia.com/gpu": 4}, UsageState.DISPUTED),
            ({"cpu": int(capacity * 1.03)}, UsageState.RECONCILED),
        ]
    ):
        t0 = 100 * n
        lease = grant_at(t0, client_user, pool, f"job-dev-{n}", node=node)
        Reporter(node).every(t0 + 10, t0 + 50, [lease])
        record = release_at(t0 + 55, lease, client_user)
        EvidenceInterval.objects.filter(lease=lease).update(usage_max=peak)
        record = settle(record)
        assert record.state == expected, record.findings
        if expected == UsageState.DISPUTED:
            assert "nvidia.com/gpu" in record.findings[0]["message"]
