"""Racing renewals, and renewals racing status reports and the sweep: one winner, nothing lost."""

from __future__ import annotations

from collections import Counter

import pytest

from fleet import event_types as fleet_events
from fleet.choices import Liveness
from fleet.instructions import Instruction, post_instructions
from fleet.liveness_sweep import sweep_liveness
from fleet.models import Node, NodeEvent
from tests.factories import PoolFactory, make_schedulable_node
from tests.fleet.test_renewals import renew
from tests.heartbeat_support import T0, node_api, post_beat, seconds
from tests.races import race

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.race,
    pytest.mark.usefixtures("clock_at_t0"),
]
THREADS = 8


def test_identical_racing_renewals_apply_exactly_once():
    node, secret = make_schedulable_node(PoolFactory())
    codes = Counter(race(lambda i: renew(node, secret, sequence=7).json()["code"], THREADS).results)
    assert codes == {"applied": 1, "duplicate_sequence": THREADS - 1}
    assert Node.objects.get(pk=node.pk).sequence == 7


def test_racing_renewals_of_a_flooding_node_write_once_and_the_rest_get_429():
    node, secret = make_schedulable_node(PoolFactory())
    statuses = Counter(race(lambda i: renew(node, secret, sequence=i + 1).status_code, THREADS).results)
    # One renewal wins; the rest are refused by the spacing in the same statement (429) or lost
    # the ordering to a higher sequence that won first (200 stale_sequence): none writes.
    assert statuses[200] >= 1 and statuses[200] + statuses[429] == THREADS
    node.refresh_from_db()
    assert node.last_heartbeat_at == T0
    applied = [s for s in range(1, THREADS + 1) if s == node.sequence]
    assert len(applied) == 1


def test_racing_revivals_of_a_stale_node_write_one_liveness_event():
    node, secret = make_schedulable_node(PoolFactory())
    Node.objects.filter(pk=node.pk).update(liveness=Liveness.STALE)
    codes = Counter(race(lambda i: renew(node, secret, sequence=5).json()["code"], THREADS).results)
    assert codes["applied"] == 1
    assert NodeEvent.objects.filter(node=node, type=fleet_events.LIVENESS, to_state=Liveness.ALIVE).count() == 1
    assert Node.objects.get(pk=node.pk).liveness == Liveness.ALIVE


def test_an_instruction_posted_while_a_status_report_applies_is_never_lost(time_machine):
    node, secret = make_schedulable_node(PoolFactory())

    def work(i):
        if i % 2:
            post_instructions([node.pk], Instruction.LEASES, on_commit=False)
            return "posted"
        return post_beat(node_api(secret), node, sequence=i + 1).json()["code"]

    assert not race(work, THREADS).errors
    # Whatever the interleaving, the marker is set unless a report was applied after the last post;
    # a final post always survives until the next report.
    post_instructions([node.pk], Instruction.CHECKPOINT, on_commit=False)
    time_machine.move_to(T0 + seconds(10), tick=False)
    assert renew(node, secret, sequence=100).json()["flags"] & Instruction.CHECKPOINT


def test_a_renewal_racing_the_sweep_never_leaves_a_renewed_node_stale(time_machine):
    pool = PoolFactory()
    node, secret = make_schedulable_node(pool)
    renew(node, secret, sequence=1)
    time_machine.move_to(T0 + seconds(21), tick=False)

    def work(i):
        return sweep_liveness() if i % 2 else renew(node, secret, sequence=2 + i).status_code

    assert not race(work, THREADS).errors
    node.refresh_from_db()
    assert node.last_heartbeat_at == T0 + seconds(21) and node.liveness == Liveness.ALIVE
