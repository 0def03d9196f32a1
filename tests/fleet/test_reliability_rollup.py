"""The reliability rollup: uptime and device faults from events, rows that outlive the event
retention, and per-pool metrics without node ids (fleet.reliability)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
import time_machine
from django.test import Client

from fleet import event_types
from fleet.choices import ActorType
from fleet.events import Actor, record_event
from fleet.fleet_state import refresh
from fleet.models import Node, NodeEvent, NodeReliabilityDay
from fleet.reliability import record, rollup, uptime
from fleet.retention import prune_events
from tests.factories import NodeFactory, PoolFactory
from tests.metrics_support import scrape, value

pytestmark = pytest.mark.django_db
DAY = date(2026, 11, 2)
MIDNIGHT = datetime(2026, 11, 2, tzinfo=UTC)
ACTOR = Actor.system("fleet.sweep_liveness")


def at(hours: float) -> datetime:
    return MIDNIGHT + timedelta(hours=hours)


def liveness_event(node, hours, from_state, to_state):
    event = record_event(node, event_types.LIVENESS, ACTOR, from_state=from_state, to_state=to_state)
    NodeEvent.objects.filter(pk=event.pk).update(created_at=at(hours))


@pytest.fixture
def node():
    with time_machine.travel(at(-6), tick=False):  # enrolled at 18:00 the day before
        return NodeFactory(pool=PoolFactory(name="general"), liveness="lost")


def flapping_day(node):
    """Up 0-6 h, unreachable 6-8 h, up 8-20 h, lost from 20 h: 18 h up of 24."""
    liveness_event(node, 6, "alive", "unreachable")
    liveness_event(node, 8, "unreachable", "alive")
    liveness_event(node, 20, "alive", "lost")


def test_uptime_counts_alive_and_stale_time_from_the_liveness_events(node):
    flapping_day(node)
    liveness_event(node, 2, "alive", "stale")  # stale is still up
    liveness_event(node, 2.5, "stale", "alive")
    found = uptime(start=at(0), end=at(24), nodes=[(node.pk, node.created_at, "lost")])
    assert found == {node.pk: (86400, 18 * 3600)}


def test_a_node_without_events_in_the_window_keeps_its_current_liveness(node):
    alive = NodeFactory(pool=node.pool, liveness="alive")
    found = uptime(start=at(0), end=at(24), nodes=[(node.pk, at(-6), "lost"), (alive.pk, at(12), "alive")])
    assert found == {node.pk: (86400, 0), alive.pk: (12 * 3600, 12 * 3600)}  # observed since it enrolled


def test_the_rollup_writes_yesterday_and_today_and_device_faults(node):
    flapping_day(node)
    tainted = record_event(node, event_types.DEVICE, Actor.for_node(node), to_state="tainted",
                           data={"device_id": "GPU-1"})  # fmt: skip
    operator = record_event(node, event_types.DEVICE, Actor(ActorType.USER, "oscar"), to_state="tainted",
                            data={"device_id": "GPU-2"})  # fmt: skip
    NodeEvent.objects.filter(pk__in=[tainted.pk, operator.pk]).update(created_at=at(9))
    with time_machine.travel(at(24.5), tick=False):
        rollup()
        rollup()  # twice: the same rows
    yesterday = NodeReliabilityDay.objects.get(node=node, day=DAY)
    assert (yesterday.observed_seconds, yesterday.up_seconds) == (86400, 18 * 3600)
    assert yesterday.device_faults == {"GPU-1": 1}  # an operator's taint is not a fault
    today = NodeReliabilityDay.objects.get(node=node, day=DAY + timedelta(days=1))
    assert (today.observed_seconds, today.up_seconds) == (1800, 0)


def test_the_record_outlives_the_events_it_was_made_from(node, settings):
    flapping_day(node)
    with time_machine.travel(at(23), tick=False):
        rollup()
    NodeReliabilityDay.objects.filter(node=node, day=DAY).update(leases_completed=9, leases_lost_unreachable=1)
    settings.NODEPOOL = {**settings.NODEPOOL, "RETENTION_DAYS": 1, "RETENTION_KEEP_EVENTS_PER_NODE": 0,
                         "RELIABILITY_MIN_SAMPLE": 10}  # fmt: skip
    with time_machine.travel(at(24 * 5), tick=False):
        prune_events()
        assert not NodeEvent.objects.filter(node=node, type=event_types.LIVENESS).exists()
        rollup()  # rewrites only the last two days: the pruned day keeps its figures
        shown = record(Node.objects.get(pk=node.pk))
    week = shown["windows"]["7d"]
    # 6 h up the day it enrolled (alive until the first event), 18 h the flapping day, lost since.
    assert week["up_seconds"] == (6 + 18) * 3600
    assert (week["leases_completed"], week["leases_node_fault"]) == (9, 1)
    assert shown["reliability"] == 0.9


def test_rows_older_than_the_reliability_retention_are_pruned(node, settings):
    settings.NODEPOOL = {**settings.NODEPOOL, "RELIABILITY_RETENTION_DAYS": 10}
    NodeReliabilityDay.objects.create(node=node, day=DAY - timedelta(days=11), leases_completed=3)
    NodeReliabilityDay.objects.create(node=node, day=DAY - timedelta(days=9), leases_completed=3)
    with time_machine.travel(at(1), tick=False):
        assert rollup()["pruned"] == 1
    assert sorted(NodeReliabilityDay.objects.values_list("day", flat=True)) == [
        DAY - timedelta(days=9), DAY - timedelta(days=1), DAY
    ]  # fmt: skip


def test_metrics_export_per_pool_buckets_and_never_a_node_id(node):
    pool = node.pool
    for score in (0.42, 0.97, 0.995, None):
        other = NodeFactory(pool=pool)
        Node.objects.filter(pk=other.pk).update(reliability=score)
    refresh()
    text = scrape(Client())
    assert value(text, "nodepool_nodes_reliability_unrated", pool="general") == 2  # the fixture's node too
    assert value(text, "nodepool_nodes_by_reliability", pool="general", le="0.5") == 1
    assert value(text, "nodepool_nodes_by_reliability", pool="general", le="0.99") == 2
    assert value(text, "nodepool_nodes_by_reliability", pool="general", le="1.0") == 3
    reliability_lines = [line for line in text.splitlines() if "reliability" in line]
    assert reliability_lines
    for each in Node.objects.all():
        assert all(str(each.pk) not in line and each.hostname not in line for line in reliability_lines)


def test_the_record_lists_the_re_verification_runs_of_the_window(node):
    from fleet.models import Reverification

    def run(state, code, hours):
        return Reverification.objects.create(
            node=node, pool=node.pool, state=state, code=code, due_at=at(hours), finished_at=at(hours),
            evidence={"measured": {"cpu": 1}},
        )  # fmt: skip

    run("passed", "passed", -24 * 40)  # outside the 30 days
    run("failed", "measured_below_verified", 1)
    run("passed", "passed", 5)
    run("scheduled", "", 30)  # not finished: not history
    with time_machine.travel(at(6), tick=False):
        shown = record(Node.objects.get(pk=node.pk))["reverifications"]
    assert (shown["passed"], shown["failed"]) == (1, 1)
    newest_first = [("passed", "passed"), ("failed", "measured_below_verified")]
    assert [(r["state"], r["code"]) for r in shown["runs"]] == newest_first
    assert all("evidence" not in r for r in shown["runs"])


def test_the_admin_node_page_shows_the_record_to_operators_and_the_owner(node, operator, owner):
    from django.urls import reverse

    from tests.support import staff_client

    Node.objects.filter(pk=node.pk).update(owner=owner, reliability=0.9512)
    NodeReliabilityDay.objects.create(node=node, day=date.today(), leases_completed=39, leases_lost_unreachable=2,
                                      device_faults={"GPU-7": 3})  # fmt: skip
    url = reverse("admin:fleet_node_change", args=[node.pk])
    for user in (operator, owner):
        page = staff_client(user).get(url)
        assert page.status_code == 200
        text = page.content.decode()
        section = text[text.index(">Reliability<") :]
        assert "0.9512" in section and "lost_unreachable 2" in section and "GPU-7 × 3" in section
