"""Racing heartbeats and racing sweeps: at most one winner, one event per change (SQLite and PostgreSQL)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from fleet import event_types as fleet_events
from fleet.choices import Liveness
from fleet.liveness_sweep import sweep_liveness
from fleet.models import Node, NodeEvent
from tests import races
from tests.factories import PoolFactory, make_schedulable_node
from tests.heartbeat_support import T0, node_api, post_beat, seconds, send

# Ordering and liveness tests send messages back to back; the flood guard has its own tests.
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.usefixtures("no_flood_guard", "clock_at_t0"),
]
THREADS = 8


def race(work, count=THREADS):
    """Run ``work(i)`` in ``count`` threads released together (tests/races.py); results in thread order."""
    outcome = races.race(work, count)
    assert not outcome.errors, outcome.errors
    return outcome.results


@pytest.mark.race
def test_identical_racing_heartbeats_apply_exactly_once():
    node, secret = make_schedulable_node(PoolFactory())
    NodeEvent.objects.all().delete()

    def work(i):
        body = post_beat(node_api(secret), node, sequence=7, ready=False).json()
        return body["code"]

    codes = Counter(race(work))
    assert codes == {"applied": 1, "duplicate_sequence": THREADS - 1}
    assert NodeEvent.objects.filter(node=node, type=fleet_events.READINESS).count() == 1


@pytest.mark.race
def test_racing_sequences_leave_the_highest_and_never_go_back():
    node, secret = make_schedulable_node(PoolFactory())
    results = race(lambda i: post_beat(node_api(secret), node, sequence=i + 1, usage={"cpu": i + 1}).json())
    node.refresh_from_db()
    assert node.sequence == THREADS and node.usage == {"cpu": THREADS}
    assert all(r["code"] in ("applied", "stale_sequence") for r in results)


@pytest.mark.race
def test_racing_restarts_count_one_restart():
    node, secret = make_schedulable_node(PoolFactory())
    send(node, 50)
    race(lambda i: post_beat(node_api(secret), node, incarnation=2, sequence=i).json())
    node.refresh_from_db()
    assert node.incarnation == 2 and node.sequence == THREADS - 1
    assert node.restart_count == 1
    assert NodeEvent.objects.filter(node=node, type=fleet_events.RESTART).count() == 1


@pytest.mark.race
def test_two_sweeps_at_once_give_one_event_per_node_and_one_loss_per_node(time_machine, monkeypatch, settings):
    settings.NODEPOOL = {**settings.NODEPOOL, "UNHEALTHY_ZONE_FRACTION": 1.0}  # the whole fleet dies here
    pool = PoolFactory()
    nodes = [make_schedulable_node(pool)[0] for _ in range(12)]
    for node in nodes:
        send(node, 0)
    lost_calls: list = []
    lock = threading.Lock()

    def lose(node_ids, *, actor, reason):
        with lock:
            lost_calls.extend(str(i) for i in node_ids)
        return len(node_ids)

    monkeypatch.setattr("leases.reconcile.lose_node_leases", lose)
    time_machine.move_to(T0 + seconds(400), tick=False)
    race(lambda i: sweep_liveness(), count=4)
    assert set(Node.objects.values_list("liveness", flat=True)) == {Liveness.LOST}
    per_node = Counter(
        str(e.node_id) for e in NodeEvent.objects.filter(type=fleet_events.LIVENESS, to_state=Liveness.LOST)
    )
    assert sorted(per_node.values()) == [1] * len(nodes)
    assert sorted(lost_calls) == sorted(str(n.pk) for n in nodes)


@pytest.mark.race
def test_a_sweep_racing_heartbeats_never_leaves_a_fresh_node_degraded(time_machine):
    pool = PoolFactory()
    nodes = [make_schedulable_node(pool)[0] for _ in range(THREADS - 1)]
    for node in nodes:
        send(node, 0)
    time_machine.move_to(T0 + seconds(25), tick=False)

    def work(i):
        return sweep_liveness() if i == 0 else send(nodes[i - 1], 1).applied

    results = race(work)
    assert all(results[1:])
    assert set(Node.objects.values_list("liveness", flat=True)) == {Liveness.ALIVE}
