"""When the mass-silence guard lifts, nodes still silent get a fresh loss window (issue 12, case 1).

Kubernetes and Nomad restart the clock after a disruption ends: a node silent since before the
outage is not declared lost on the very next sweep, only one loss threshold after the release.
Guard engaged / released are pool events.
"""

from __future__ import annotations

import pytest

from fleet import event_types as fleet_events
from fleet.liveness_sweep import sweep_liveness
from fleet.models import LivenessSweepState, Node, NodeEvent
from tests.factories import PoolFactory, make_schedulable_node
from tests.heartbeat_support import T0, seconds, send

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clock_at_t0")]


@pytest.fixture
def losses(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "leases.reconcile.lose_node_leases",
        lambda node_ids, *, actor, reason: calls.append(sorted(str(i) for i in node_ids)) or len(node_ids),
    )
    return calls


def nodes_in(pool, count, **labels):
    made = [make_schedulable_node(pool, labels=dict(labels))[0] for _ in range(count)]
    for node in made:
        send(node, 0)
    return made


class Clock:
    """Sweeps every 5 s from where it left off; ``answering`` nodes heartbeat at each step."""

    def __init__(self, time_machine):
        self.time_machine, self.t, self.sequence = time_machine, 0, 1000

    def run(self, *, until: float, answering=()):
        while self.t + 5 <= until:
            self.t += 5
            self.time_machine.move_to(T0 + seconds(self.t), tick=False)
            for node in answering:
                self.sequence += 1
                send(node, self.sequence)
            sweep_liveness()


def liveness_of(*nodes):
    return [Node.objects.get(pk=n.pk).liveness for n in nodes]


def test_nodes_still_silent_when_the_guard_lifts_are_lost_one_loss_threshold_after_the_release(time_machine, losses):
    pool = PoolFactory()
    zone = nodes_in(pool, 6, zone="a")
    early, late, answering = zone[:4], zone[4], zone[5:] + nodes_in(PoolFactory(), 5, zone="b")
    clock = Clock(time_machine)
    clock.run(until=200, answering=[late, *answering])
    clock.run(until=400, answering=answering)  # 5/6 of the pool silent: loss withheld
    assert liveness_of(*early) == ["unreachable"] * 4 and losses == []

    clock.run(until=405, answering=[*answering, *early[:3]])  # three come back: 2/6 silent, guard lifts
    still_silent = [early[3], late]
    assert LivenessSweepState.objects.get().guarded_groups == {}
    assert liveness_of(*still_silent) == ["unreachable", "unreachable"] and losses == []

    # ``late`` went silent at 200 and would have been lost at 500; both now count from 405.
    clock.run(until=700, answering=[*answering, *early[:3]])
    assert liveness_of(*still_silent) == ["unreachable", "unreachable"] and losses == []
    clock.run(until=705, answering=[*answering, *early[:3]])
    assert liveness_of(*still_silent) == ["lost", "lost"]
    assert losses == [sorted(str(n.pk) for n in still_silent)]


def test_guard_engaged_and_released_are_events_of_the_pool(time_machine, losses):
    pool = PoolFactory()
    nodes = nodes_in(pool, 5, zone="a")
    answering = nodes[4:] + nodes_in(PoolFactory(), 5, zone="b")
    clock = Clock(time_machine)
    clock.run(until=400, answering=answering)
    clock.run(until=405, answering=[*answering, *nodes[:2]])

    events = list(NodeEvent.objects.filter(type=fleet_events.GUARD).order_by("created_at", "id"))
    assert [(e.to_state, e.pool_id, e.node_id, e.subject_id) for e in events] == [
        ("engaged", pool.pk, None, f"{pool.name}/*"),
        ("released", pool.pk, None, f"{pool.name}/*"),
    ]
    assert events[0].data["silent"] == 4 and events[0].data["total"] == 5
    assert "fresh loss window" in events[1].reason


def test_a_guard_that_engages_again_withholds_loss_again(time_machine, losses):
    pool = PoolFactory()
    nodes = nodes_in(pool, 5, zone="a")
    answering = nodes[4:] + nodes_in(PoolFactory(), 5, zone="b")
    clock = Clock(time_machine)
    clock.run(until=400, answering=answering)
    clock.run(until=405, answering=[*answering, *nodes[:2]])
    clock.run(until=1000, answering=answering)  # the two went silent again: guard engaged again

    assert losses == []
    assert liveness_of(*nodes[:4]) == ["unreachable"] * 4
    assert list(LivenessSweepState.objects.get().guard_releases) == []
