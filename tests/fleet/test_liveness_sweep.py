"""The liveness sweep: alive → stale → unreachable → lost from the server's clock, with the
outage guard, the mass-silence guard and lease loss exactly once."""

from __future__ import annotations

import itertools
import json
import uuid
from io import StringIO

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command

from fleet import event_types as fleet_events
from fleet import liveness
from fleet.choices import Lifecycle, Liveness
from fleet.liveness import timings_for
from fleet.liveness_sweep import sweep_liveness
from fleet.models import LivenessSweepState, Node, NodeEvent, NodeResource
from fleet.schedule import BEAT_SCHEDULE
from leases import event_types as leases_events
from leases.choices import LIVE_LEASE_STATES, LeaseState
from leases.models import Lease
from nodepool.api.permissions import CLIENTS
from tests.factories import PoolFactory, make_schedulable_node, set_lifecycle
from tests.heartbeat_support import T0, seconds, send
from tests.support import grant

# Ordering and liveness tests send messages back to back; the flood guard has its own tests.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_flood_guard", "clock_at_t0")]


def _client():
    user, _ = User.objects.get_or_create(username="sweep-client")
    user.groups.add(Group.objects.get_or_create(name=CLIENTS)[0])
    return user


def nodes_in(pool, count, **labels):
    """``count`` nodes of ``pool`` that heartbeat once now (sequence 0), each holding one real lease
    of 1 CPU (no command, so the node is not expected to report it)."""
    made = []
    for _ in range(count):
        pin = {"test/node": uuid.uuid4().hex[:12]}
        node = make_schedulable_node(pool, labels={**labels, **pin})[0]
        grant(_client(), f"job-{node.pk}", pool=pool.name, node_selector=pin)
        made.append(node)
    for node in made:
        send(node, 0)
    return made


# One counter for every heartbeat of a test run: sequences only grow, however runs are split.
_SEQUENCE = itertools.count(1000)


def lost_leases(*nodes) -> list[str]:
    """Ids (sorted) of the nodes whose lease is lost, after checking the real loss path did its
    whole job for each: the lease ended ``lost`` with the sweep's reason, the node's CPU was given
    back, and a lease event was written on the node."""
    lost = Lease.objects.filter(state=LeaseState.LOST)
    for lease in lost:
        assert lease.end_reason == "node lost: no heartbeat past the loss threshold"
        assert NodeResource.objects.get(node_id=lease.node_id, name="cpu").allocated == 0
        events = NodeEvent.objects.filter(node_id=lease.node_id, type=leases_events.LEASE, to_state="lost")
        assert events.count() == 1, "lost exactly once"
    for lease in Lease.objects.exclude(state=LeaseState.LOST):
        assert lease.state in LIVE_LEASE_STATES
        assert NodeResource.objects.get(node_id=lease.node_id, name="cpu").allocated == 1000
    return sorted(str(lease.node_id) for lease in lost)


def run_sweeps(time_machine, *, until: float, every: float = 5, keep_alive=(), start: float | None = None):
    """Sweep every ``every`` seconds until T0 + ``until``; ``keep_alive`` nodes heartbeat each step."""
    t = start if start is not None else every
    while t <= until:
        time_machine.move_to(T0 + seconds(t), tick=False)
        for node in keep_alive:
            send(node, next(_SEQUENCE))
        sweep_liveness()
        t += every


def liveness_of(*nodes):
    return [Node.objects.get(pk=n.pk).liveness for n in nodes]


def transitions(node):
    return [
        (e.from_state, e.to_state)
        for e in NodeEvent.objects.filter(node=node, type=fleet_events.LIVENESS).order_by("created_at", "id")
        if not e.data.get("loss_withheld")
    ]


def test_timings_default_to_kubernetes_grace_and_eviction():
    t = timings_for(PoolFactory(), fleet_size=10)
    assert (t.stale_after, t.unreachable_after, t.lost_after) == (20, 40, 300)


def test_timings_scale_with_the_fleet_like_nomads_rate_scaled_interval():
    t = timings_for(PoolFactory(), fleet_size=10_000, max_rate=50)
    assert (t.interval, t.stale_after, t.unreachable_after, t.lost_after) == (200, 400, 800, 6000)


def test_a_silent_node_goes_stale_then_unreachable_then_lost_once(time_machine):
    pool = PoolFactory()
    quiet, chatty = nodes_in(pool, 2)
    run_sweeps(time_machine, until=15, keep_alive=[chatty])
    assert liveness_of(quiet, chatty) == ["alive", "alive"]
    run_sweeps(time_machine, until=20, start=20, keep_alive=[chatty])
    assert liveness_of(quiet) == ["stale"]
    run_sweeps(time_machine, until=40, start=25, keep_alive=[chatty])
    assert liveness_of(quiet) == ["unreachable"]
    assert lost_leases() == []
    run_sweeps(time_machine, until=330, start=45, keep_alive=[chatty])
    assert liveness_of(quiet, chatty) == ["lost", "alive"]
    assert transitions(quiet) == [("alive", "stale"), ("stale", "unreachable"), ("unreachable", "lost")]
    liveness_events = NodeEvent.objects.filter(node=quiet, type=fleet_events.LIVENESS)
    assert {e.pool_id for e in liveness_events} == {pool.pk}, "each event belongs to the node's pool too"
    assert lost_leases() == [str(quiet.pk)]
    quiet.refresh_from_db()
    assert quiet.next_liveness_check_at is None and quiet.liveness_changed_at == T0 + seconds(300)


def test_a_node_silent_past_every_threshold_goes_straight_to_lost_with_one_event(time_machine):
    (node,) = nodes_in(PoolFactory(), 1)
    time_machine.move_to(T0 + seconds(400), tick=False)
    summary = sweep_liveness()
    assert summary["moved"] == {"alive->lost": 1}
    assert transitions(node)[-1] == ("alive", "lost")
    assert lost_leases() == [str(node.pk)]


def test_the_sweeps_events_carry_the_sweep_time_not_the_wall_clock(time_machine):
    """Each sweep runs at its ``now``; the events it writes say that time on both databases (on
    PostgreSQL the statement inserts them with the sweep's time; on SQLite they were written with
    the wall clock, here half a second later)."""
    (quiet,) = nodes_in(PoolFactory(), 1)
    for t in range(5, 45, 5):
        time_machine.move_to(T0 + seconds(t + 0.5), tick=False)
        sweep_liveness(now=T0 + seconds(t))
    events = NodeEvent.objects.filter(node=quiet, type=fleet_events.LIVENESS).order_by("created_at", "id")
    assert [(e.to_state, e.created_at) for e in events] == [
        ("stale", T0 + seconds(20)),
        ("unreachable", T0 + seconds(40)),
    ]


def test_liveness_never_changes_the_lifecycle(time_machine):
    (node,) = nodes_in(PoolFactory(), 1)
    set_lifecycle(node, Lifecycle.QUARANTINED)
    time_machine.move_to(T0 + seconds(400), tick=False)
    sweep_liveness()
    node.refresh_from_db()
    assert (node.lifecycle, node.liveness) == (Lifecycle.QUARANTINED, Liveness.LOST)


def test_a_lost_node_returns_to_alive_with_a_heartbeat(time_machine):
    (node,) = nodes_in(PoolFactory(), 1)
    time_machine.move_to(T0 + seconds(400), tick=False)
    sweep_liveness()
    time_machine.move_to(T0 + seconds(410), tick=False)
    assert send(node, 1).applied
    node.refresh_from_db()
    assert node.liveness == Liveness.ALIVE and node.next_liveness_check_at == T0 + seconds(430)
    assert transitions(node)[-1] == ("lost", "alive")


def test_retired_nodes_are_left_alone(time_machine):
    (node,) = nodes_in(PoolFactory(), 1)
    set_lifecycle(node, Lifecycle.RETIRED)
    time_machine.move_to(T0 + seconds(400), tick=False)
    sweep_liveness()
    assert liveness_of(node) == ["alive"]


def test_after_an_outage_gap_silence_is_not_held_against_the_nodes(time_machine):
    pool = PoolFactory()
    back, gone = nodes_in(pool, 2)
    sweep_liveness()  # the sweep ran at T0, then the control plane was down for ten minutes
    time_machine.move_to(T0 + seconds(600), tick=False)
    summary = sweep_liveness()
    assert summary["gap_seconds"] == 600 and summary["recovering"] is True
    assert summary["moved"] == {}
    assert liveness_of(back, gone) == ["alive", "alive"]
    assert LivenessSweepState.objects.get().recovered_at == T0 + seconds(600)
    # Grace counts from the recovery: stale 20 s, unreachable 40 s, lost 300 s after it.
    run_sweeps(time_machine, start=605, until=615, keep_alive=[back])
    assert liveness_of(back, gone) == ["alive", "alive"]
    run_sweeps(time_machine, start=620, until=620, keep_alive=[back])
    assert liveness_of(gone) == ["stale"]
    run_sweeps(time_machine, start=625, until=640, keep_alive=[back])
    assert liveness_of(gone) == ["unreachable"]
    run_sweeps(time_machine, start=645, until=895, keep_alive=[back])
    assert liveness_of(gone) == ["unreachable"] and lost_leases() == []
    run_sweeps(time_machine, start=900, until=900, keep_alive=[back])
    assert liveness_of(back, gone) == ["alive", "lost"] and lost_leases() == [str(gone.pk)]


def test_a_forward_jump_of_the_server_clock_counts_as_a_gap(time_machine):
    (node,) = nodes_in(PoolFactory(), 1)
    sweep_liveness()
    time_machine.move_to(T0 + seconds(3 * 3600), tick=False)
    assert sweep_liveness()["moved"] == {}
    assert liveness_of(node) == ["alive"]


def test_a_backward_jump_of_the_server_clock_degrades_nobody(time_machine):
    (node,) = nodes_in(PoolFactory(), 1)
    time_machine.move_to(T0 + seconds(10), tick=False)
    sweep_liveness()
    time_machine.move_to(T0 - seconds(3600), tick=False)
    assert sweep_liveness()["moved"] == {}
    assert liveness_of(node) == ["alive"]


def test_zone_wide_silence_keeps_marking_unreachable_but_withholds_lease_loss(time_machine):
    pool = PoolFactory()
    nodes = nodes_in(pool, 5, zone="a")
    silent, answering = nodes[:4], nodes[4:] + nodes_in(PoolFactory(), 5, zone="b")
    run_sweeps(time_machine, until=400, keep_alive=answering)
    assert liveness_of(*silent) == ["unreachable"] * 4 and lost_leases() == []
    withheld = NodeEvent.objects.filter(type=fleet_events.LIVENESS, data__loss_withheld=True)
    assert sorted(str(e.node_id) for e in withheld) == sorted(str(n.pk) for n in silent)  # once per node
    assert "4/5 nodes" in withheld[0].reason and "55%" in withheld[0].reason
    assert list(LivenessSweepState.objects.get().guarded_groups) == [f"{pool.name}/*"]
    # Two come back: 2/5 silent is under the fraction, so the guard lifts; the rest get a fresh
    # loss window from the release (tests/fleet/test_liveness_guard_release.py) and are lost after it.
    run_sweeps(time_machine, start=405, until=700, keep_alive=answering + silent[:2])
    assert liveness_of(*silent[2:]) == ["unreachable", "unreachable"] and lost_leases() == []
    run_sweeps(time_machine, start=705, until=705, keep_alive=answering + silent[:2])
    assert liveness_of(*silent[2:]) == ["lost", "lost"]
    assert lost_leases() == sorted(str(n.pk) for n in silent[2:])


def test_a_single_failed_zone_elsewhere_still_loses_its_leases(time_machine):
    pool = PoolFactory()
    healthy = nodes_in(pool, 3, zone="a") + nodes_in(pool, 3, zone="b")
    failed = nodes_in(pool, 3, zone="c")
    run_sweeps(time_machine, until=300, keep_alive=healthy)
    assert liveness_of(*failed) == ["lost"] * 3
    assert lost_leases() == sorted(str(n.pk) for n in failed)


def test_a_partially_silent_zone_withholds_loss_in_that_zone_only(time_machine):
    pool = PoolFactory()
    zone_a = nodes_in(pool, 5, **{"topology.kubernetes.io/zone": "a"})
    zone_b = nodes_in(pool, 6, **{"topology.kubernetes.io/zone": "b"})
    lone_b = zone_b[0]
    run_sweeps(time_machine, until=300, keep_alive=zone_a[3:] + zone_b[1:])
    assert liveness_of(*zone_a[:3]) == ["unreachable"] * 3  # 3/5 of zone a: held
    assert liveness_of(lone_b) == ["lost"]  # 1/6 of zone b: lost normally
    assert lost_leases() == [str(lone_b.pk)]
    assert f"{pool.name}/a" in LivenessSweepState.objects.get().guarded_groups


def test_a_pool_of_one_node_still_loses_its_leases(time_machine):
    (node,) = nodes_in(PoolFactory(), 1)
    run_sweeps(time_machine, until=300)
    assert liveness_of(node) == ["lost"] and lost_leases() == [str(node.pk)]


def test_the_management_command_runs_one_sweep_and_prints_json(time_machine):
    (node,) = nodes_in(PoolFactory(), 1)
    time_machine.move_to(T0 + seconds(25), tick=False)
    out = StringIO()
    call_command("sweep_liveness", stdout=out)
    assert json.loads(out.getvalue())["moved"] == {"alive->stale": 1}
    assert liveness_of(node) == ["stale"]


def test_the_celery_task_runs_the_sweep_and_beat_runs_it_often_with_an_expiry(time_machine):
    from fleet.tasks import sweep_liveness_task

    (node,) = nodes_in(PoolFactory(), 1)
    time_machine.move_to(T0 + seconds(25), tick=False)
    sweep_liveness_task.delay()
    assert liveness_of(node) == ["stale"]
    entry = BEAT_SCHEDULE["fleet-sweep-liveness"]
    assert entry["task"] == "fleet.sweep_liveness" and entry["options"]["expires"] < entry["schedule"]


def test_the_sweep_only_reads_due_nodes(time_machine, django_assert_max_num_queries):
    pool = PoolFactory()
    nodes_in(pool, 20)
    time_machine.move_to(T0 + seconds(25), tick=False)
    # clock row (fleet.clock), state row, due pools, fleet size, 6 transitions, the state row again
    # at the end, the savepoints of the three transactions (start, the pool, end): no per-node query.
    with django_assert_max_num_queries(29):
        assert sweep_liveness()["moved"] == {"alive->stale": 20}
    assert liveness.heartbeat_population() == 20


def test_when_most_of_the_fleet_goes_silent_no_leases_are_lost_anywhere(time_machine):
    nodes = nodes_in(PoolFactory(), 2) + nodes_in(PoolFactory(), 2)
    run_sweeps(time_machine, until=400, keep_alive=nodes[3:])
    assert liveness_of(*nodes[:3]) == ["unreachable"] * 3 and lost_leases() == []
    assert list(LivenessSweepState.objects.get().guarded_groups) == ["*"]
