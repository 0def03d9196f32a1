"""A stalled sweeper is not an outage (issue 29, item 1), and the sweep runs pool by pool (item 6).

The three gaps side by side, in one pool of five nodes (interval 10 s, grace 40 s, loss 300 s),
one of which dies at t=20 s; the sweep runs every 5 s until t=25 s, then nothing until t=115 s:

* **stall**: the API kept serving renewals of the other four: the first sweep after it (t=115 s)
  marks the dead node unreachable (silent 95 s, past its grace);
* **outage**: nobody could renew: grace restarts at the recovery, as before (unreachable at 155 s);
* **clock jump**: the clock stepped 3 h forward: the same as an outage, as before.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from fleet import clock
from fleet import event_types as fleet_events
from fleet.liveness_sweep import sweep_liveness
from fleet.models import ControlPlaneClock, LivenessSweepState, Node, NodeCredential, NodeEvent
from fleet.signals import nodes_lost
from nodepool import metrics
from tests.factories import PoolFactory, make_schedulable_node
from tests.heartbeat_support import T0, seconds, send

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_flood_guard", "clock_at_t0")]

_SEQUENCE = itertools.count(1)


def at(time_machine, t: float) -> None:
    time_machine.move_to(T0 + seconds(t), tick=False)


def renew(nodes) -> None:
    for node in nodes:
        send(node, next(_SEQUENCE))


def liveness_of(*nodes) -> list[str]:
    return [Node.objects.get(pk=n.pk).liveness for n in nodes]


@pytest.fixture
def five(time_machine):
    """Five nodes renewing and swept every 5 s until t=25 s; ``dead`` stopped after t=20 s."""
    pool = PoolFactory(name="general")
    nodes = [make_schedulable_node(pool)[0] for _ in range(5)]
    dead, others = nodes[0], nodes[1:]
    for t in range(0, 30, 5):
        at(time_machine, t)
        renew(others + ([dead] if t <= 20 else []))
        sweep_liveness()
    assert liveness_of(*nodes) == ["alive"] * 5
    return dead, others


def test_a_stalled_sweep_marks_the_node_that_died_during_it_at_its_first_run(time_machine, five):
    dead, others = five
    for t in range(30, 115, 5):  # the sweep is stopped; the API keeps serving renewals
        at(time_machine, t)
        renew(others)
    at(time_machine, 115)
    summary = sweep_liveness()
    assert summary["gap"] == "stall" and summary["recovering"] is False
    assert liveness_of(dead) == ["unreachable"] and liveness_of(*others) == ["alive"] * 4
    assert LivenessSweepState.objects.get().recovered_at is None


def test_an_outage_restarts_grace_as_before(time_machine, five):
    dead, others = five
    at(time_machine, 115)  # nobody could reach the control plane for 90 s
    summary = sweep_liveness()
    assert summary["gap"] == "outage" and summary["recovering"] is True and summary["moved"] == {}
    assert liveness_of(dead, *others) == ["alive"] * 5
    for t in range(120, 160, 5):
        at(time_machine, t)
        renew(others)
        sweep_liveness()
        assert liveness_of(dead) == (["unreachable"] if t >= 155 else ["alive"] if t < 135 else ["stale"])


def test_a_forward_clock_jump_restarts_grace_as_before(time_machine, five):
    dead, others = five
    at(time_machine, 3 * 3600)
    summary = sweep_liveness()
    assert summary["gap"] == "outage" and summary["moved"] == {}
    assert liveness_of(dead, *others) == ["alive"] * 5
    assert NodeEvent.objects.filter(type=fleet_events.CLOCK_JUMP).count() == 1


def test_a_stall_of_the_periodic_jobs_pauses_no_deadline(time_machine, five):
    """fleet.clock.observe applies the same test: a beat stall extends no credential."""
    dead, others = five
    expires = {c.pk: c.expires_at for c in NodeCredential.objects.all()}
    for t in range(30, 120, 5):
        at(time_machine, t)
        renew(others)
    assert clock.observe() is None
    assert {c.pk: c.expires_at for c in NodeCredential.objects.all()} == expires
    assert not NodeEvent.objects.filter(type=fleet_events.CLOCK_JUMP).exists()
    assert ControlPlaneClock.objects.get().paused_seconds == 0


def test_an_outage_of_the_periodic_jobs_still_pauses_deadlines(time_machine, five):
    at(time_machine, 120)
    gap = clock.observe()
    assert gap is not None and gap.paused == seconds(120 - 25 - 5)
    assert NodeEvent.objects.filter(type=fleet_events.CLOCK_JUMP).count() == 1


@contextmanager
def bad_rows(pool):
    """A real failure: a trigger that aborts any liveness change of ``pool``'s nodes."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "CREATE FUNCTION np_test_bad_row() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'a bad row'; END $$"
            )
            cursor.execute(
                "CREATE TRIGGER np_test_bad_row BEFORE UPDATE ON fleet_node FOR EACH ROW WHEN "
                f"(NEW.pool_id = {int(pool.pk)} AND OLD.liveness IS DISTINCT FROM NEW.liveness) "
                "EXECUTE FUNCTION np_test_bad_row()"
            )
        else:
            cursor.execute(
                "CREATE TRIGGER np_test_bad_row BEFORE UPDATE OF liveness ON fleet_node FOR EACH ROW "
                f"WHEN NEW.pool_id = {int(pool.pk)} BEGIN SELECT RAISE(ABORT, 'a bad row'); END"
            )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("DROP TRIGGER np_test_bad_row ON fleet_node")
                cursor.execute("DROP FUNCTION np_test_bad_row()")
            else:
                cursor.execute("DROP TRIGGER np_test_bad_row")


@pytest.mark.parametrize(
    ("t", "moved", "after"),
    [
        # Short of lost: the pools are moved together; that fails, so each is swept alone.
        (25, {"alive->stale": 1}, "stale"),
        # Past the loss threshold: each pool is swept alone anyway (guards, nodes_lost).
        (400, {"alive->lost": 1}, "lost"),
    ],
)
def test_a_failing_pool_is_logged_counted_and_skipped(time_machine, caplog, t, moved, after):
    good, bad = PoolFactory(name="good"), PoolFactory(name="bad")
    good_node, bad_node = make_schedulable_node(good)[0], make_schedulable_node(bad)[0]
    for node in (good_node, bad_node):
        send(node, next(_SEQUENCE))
    before = metrics.LIVENESS_SWEEP_POOL_FAILURES.labels(pool="bad")._value.get()
    at(time_machine, t)
    with bad_rows(bad):
        summary = sweep_liveness()
    assert summary["failed_pools"] == ["bad"] and summary["moved"] == moved
    assert liveness_of(good_node, bad_node) == [after, "alive"]
    assert NodeEvent.objects.filter(node=good_node, type=fleet_events.LIVENESS).count() == 1
    assert not NodeEvent.objects.filter(node=bad_node, type=fleet_events.LIVENESS).exists()
    assert metrics.LIVENESS_SWEEP_POOL_FAILURES.labels(pool="bad")._value.get() == before + 1
    assert "liveness_sweep_pool_failed pool=bad" in caplog.text
    assert LivenessSweepState.objects.get().last_run_at == T0 + seconds(t)
    at(time_machine, t + 5)
    assert sweep_liveness()["failed_pools"] == []  # the next run sweeps it
    assert liveness_of(bad_node) == [after]


def test_pools_short_of_lost_are_moved_in_one_statement(time_machine):
    """The steady state costs what one pool costs, however many pools are due."""
    pools = [PoolFactory(name=f"p{i}") for i in range(8)]
    nodes = [make_schedulable_node(pool)[0] for pool in pools for _ in range(2)]
    renew(nodes)
    at(time_machine, 25)
    with CaptureQueriesContext(connection) as queries:
        summary = sweep_liveness()
    assert summary["moved"] == {"alive->stale": 16} and summary["failed_pools"] == []
    assert liveness_of(*nodes) == ["stale"] * 16
    assert NodeEvent.objects.filter(type=fleet_events.LIVENESS).count() == 16
    writes = [q["sql"] for q in queries.captured_queries if "fleet_nodeevent" in q["sql"]]
    if connection.vendor == "postgresql":
        assert len(writes) == 1, writes


def test_nodes_lost_is_signalled_once_per_pool(time_machine):
    pools = [PoolFactory(name="a"), PoolFactory(name="b")]
    nodes = [make_schedulable_node(pool)[0] for pool in pools]
    renew(nodes)
    sent = []

    def receiver(sender, node_ids, **kwargs):
        sent.append(sorted(str(n) for n in node_ids))

    nodes_lost.connect(receiver)
    try:
        at(time_machine, 400)
        sweep_liveness()
    finally:
        nodes_lost.disconnect(receiver)
    assert sorted(sent) == sorted([[str(nodes[0].pk)], [str(nodes[1].pk)]])
