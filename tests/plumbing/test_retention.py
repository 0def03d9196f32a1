"""Retention: old events and ended leases go in bounded batches; a node's last events, evidence
types and whatever a keep hook protects stay."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models import Q
from django.utils import timezone

from fleet import event_types as fleet_events
from fleet.events import Actor, record_event
from fleet.models import NodeEvent
from fleet.retention import prune_events
from leases.choices import LeaseState
from leases.models import Lease
from leases.retention import prune_ended_leases
from marketplace import event_types as marketplace_events
from nodepool import retention
from tests.factories import NodeFactory, PoolFactory

pytestmark = pytest.mark.django_db
ACTOR = Actor.system("test")


@pytest.fixture
def policy(settings):
    settings.NODEPOOL = {
        **settings.NODEPOOL,
        "RETENTION_DAYS": 30,
        "RETENTION_KEEP_EVENTS_PER_NODE": 3,
        "RETENTION_BATCH": 2,
        "RETENTION_MAX_BATCHES": 100,
    }


@pytest.fixture
def clean_hooks(monkeypatch):
    monkeypatch.setattr(retention, "_event_hooks", [])
    monkeypatch.setattr(retention, "_lease_hooks", [])


def aged(node, days: float, type=fleet_events.LIVENESS, **fields) -> NodeEvent:
    event = record_event(node, type, ACTOR, **fields)
    NodeEvent.objects.filter(pk=event.pk).update(created_at=timezone.now() - timedelta(days=days))
    return event


def test_old_events_go_but_a_nodes_last_events_stay_however_old(policy, clean_hooks):
    quiet = NodeFactory(hostname="quiet")  # 5 events, all old: its 3 newest stay
    busy = NodeFactory(hostname="busy")  # 4 old events and 3 recent ones: every old one goes
    quiet_events = [aged(quiet, days=100 - i) for i in range(5)]
    busy_old = [aged(busy, days=60 + i) for i in range(4)]
    busy_new = [aged(busy, days=1) for _ in range(3)]
    result = prune_events()
    assert result == {"deleted": 6, "more": False}
    remaining = set(NodeEvent.objects.values_list("pk", flat=True))
    assert remaining == {e.pk for e in quiet_events[2:]} | {e.pk for e in busy_new}
    assert not remaining & {e.pk for e in busy_old}


def test_evidence_types_and_hooked_events_are_kept(policy, clean_hooks):
    node = NodeFactory()
    for _ in range(3):
        aged(node, days=1)
    usage = aged(node, days=400, type=marketplace_events.USAGE)
    appeal = aged(None, days=400, type=marketplace_events.APPEAL, pool=node.pool)
    guard = aged(None, days=400, type=fleet_events.GUARD, pool=node.pool)
    hooked = aged(node, days=400, reason="kept for an unfinalized statement")
    plain = aged(node, days=400)
    retention.keep_events(lambda: Q(reason__startswith="kept for"))
    prune_events()
    remaining = set(NodeEvent.objects.values_list("pk", flat=True))
    assert {usage.pk, appeal.pk, hooked.pk} <= remaining
    assert guard.pk not in remaining and plain.pk not in remaining


def test_one_run_deletes_at_most_batch_times_max_batches(policy, clean_hooks, settings):
    settings.NODEPOOL = {**settings.NODEPOOL, "RETENTION_MAX_BATCHES": 2, "RETENTION_KEEP_EVENTS_PER_NODE": 1}
    node = NodeFactory()
    aged(node, days=1)
    for i in range(7):
        aged(node, days=100 + i)
    assert prune_events() == {"deleted": 4, "more": True}
    assert prune_events() == {"deleted": 3, "more": True}
    assert prune_events() == {"deleted": 0, "more": False}
    assert NodeEvent.objects.count() == 1


def lease(node, *, state, ended_days_ago, workload):
    now = timezone.now()
    return Lease.objects.create(
        workload_id=workload, fencing_token=1, node=node, node_incarnation=1, pool=node.pool, state=state,
        ttl_seconds=60, expires_at=now, granted_at=now - timedelta(days=(ended_days_ago or 0) + 1),
        ended_at=now - timedelta(days=ended_days_ago) if ended_days_ago is not None else None,
    )  # fmt: skip


def test_ended_leases_past_retention_go_unless_live_recent_or_kept(policy, clean_hooks):
    node = NodeFactory(pool=PoolFactory(name="general"))
    old = lease(node, state=LeaseState.RELEASED, ended_days_ago=60, workload="old")
    recent = lease(node, state=LeaseState.EXPIRED, ended_days_ago=2, workload="recent")
    live = lease(node, state=LeaseState.ACTIVE, ended_days_ago=None, workload="live")
    evidence = lease(node, state=LeaseState.REVOKED, ended_days_ago=60, workload="billed")
    retention.keep_leases(lambda: Q(workload_id="billed"))
    assert prune_ended_leases() == {"deleted": 1, "skipped": 0, "more": False}
    assert set(Lease.objects.values_list("pk", flat=True)) == {recent.pk, live.pk, evidence.pk}
    assert not Lease.objects.filter(pk=old.pk).exists()


def test_retention_runs_hourly_from_beat():
    from nodepool.celery import collect_beat_schedule

    schedule = collect_beat_schedule()
    assert schedule["fleet-prune-events"]["task"] == "fleet.prune_events"
    assert schedule["leases.prune_ended_leases"]["task"] == "leases.prune_ended_leases"
    assert schedule["fleet-prune-events"]["options"]["expire_seconds"] < 3600
