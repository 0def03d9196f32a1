"""Spreading the herd (issue 29, item 2): every answer aims the node at its own slot in the
interval, within [0.6, 1.4] x the interval, so a fleet that arrives at one instant is spread at
once, and the answers carry the base interval (``renewal_interval``) beside ``next_renewal_in``."""

from __future__ import annotations

import heapq
import random
import uuid
from collections import Counter
from datetime import timedelta

import pytest

from fleet import liveness
from fleet.api import renewal_views  # noqa: F401 (the view module the answers come from)
from fleet.models import Pool
from tests.factories import PoolFactory, make_schedulable_node
from tests.fleet_support import enroll, fresh_throttles, make_token  # noqa: F401
from tests.heartbeat_support import T0

NODES, MAX_RATE = 3000, 50.0  # each node told 60 s, as in the report


def herd_timings():
    pool = Pool(heartbeat_interval=10, heartbeat_grace=40, loss_threshold=300)
    return liveness.timings_for(pool, NODES, MAX_RATE)


def arrivals(node_ids, timings, *, start, until: float) -> Counter:
    """Every node renews at ``start`` (a restart), then each follows its ``next_renewal_in``: the
    count of renewals per whole second from ``start``, up to ``until`` seconds."""
    buckets: Counter = Counter()
    queue = [(0.0, i) for i in range(len(node_ids))]
    while queue:
        t, i = heapq.heappop(queue)
        if t >= until:
            break
        buckets[int(t)] += 1
        delay = liveness.next_heartbeat_in(timings, node_id=node_ids[i], now=start + timedelta(seconds=t))
        heapq.heappush(queue, (t + delay, i))
    return buckets


def test_thousands_of_nodes_arriving_at_once_are_spread_within_one_interval():
    timings = herd_timings()
    assert timings.interval == 60
    rng = random.Random(29)
    node_ids = [uuid.UUID(int=rng.getrandbits(128), version=4) for _ in range(NODES)]
    buckets = arrivals(node_ids, timings, start=T0, until=4 * timings.interval)
    mean = NODES / timings.interval
    after_one = [buckets.get(s, 0) for s in range(int(timings.interval), int(3 * timings.interval))]
    assert sum(after_one) >= 1.9 * NODES, "every node renews about once an interval"
    assert max(after_one) <= 2 * mean, f"largest one-second bucket {max(after_one)} against a mean of {mean}"


@pytest.mark.parametrize("seconds_in", [0.0, 7.3, 31.9, 59.99])
def test_every_prescribed_delay_stays_within_0_6_and_1_4_intervals(seconds_in):
    timings = herd_timings()
    rng = random.Random(7)
    for _ in range(500):
        node_id = uuid.UUID(int=rng.getrandbits(128), version=4)
        delay = liveness.next_heartbeat_in(timings, node_id=node_id, now=T0 + timedelta(seconds=seconds_in))
        assert 0.6 * timings.interval <= delay <= 1.4 * timings.interval


def test_a_node_settles_on_its_own_slot():
    timings = herd_timings()
    node_id = uuid.uuid4()
    t = T0
    delays = []
    for _ in range(8):
        delay = liveness.next_heartbeat_in(timings, node_id=node_id, now=t)
        delays.append(delay)
        t += timedelta(seconds=delay)
    assert abs(delays[-1] - timings.interval) < 0.01, delays


@pytest.mark.django_db
@pytest.mark.usefixtures("fresh_throttles", "clock_at_t0")
def test_enrollment_and_renewal_answers_carry_the_interval_told_and_the_slot_delay(anon_api, settings):
    settings.NODEPOOL = {**settings.NODEPOOL, "MAX_HEARTBEATS_PER_SECOND": 0.1}
    pool = PoolFactory(name="general", heartbeat_interval=10, heartbeat_grace=40)
    for _ in range(5):
        make_schedulable_node(pool)
    from fleet import renewals

    renewals.forget_cached_timings()
    answer = enroll(anon_api, make_token(pool)).json()
    told = liveness.timings_for(pool, liveness.heartbeat_population(fresh=True)).interval
    assert told > 10, "the fleet's size stretches the pool's interval"
    assert answer["renewal_interval"] == told and answer["heartbeat_interval"] >= told
    assert 0.6 * told <= answer["next_renewal_in"] <= 1.4 * told
