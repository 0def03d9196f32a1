"""Liveness: computed by the control plane from its own receipt times, never from node clocks.

``unknown`` (never heard) → ``alive`` → ``stale`` (missed about two intervals) → ``unreachable``
(past the pool's grace) → ``lost`` (past the loss threshold: the node's leases are declared lost).
A heartbeat brings a node back to ``alive`` (fleet.heartbeats); this module degrades it.

This module holds the timings, pure functions of the pool and the fleet's size
(:func:`timings_for`, :func:`next_heartbeat_in`); fleet.liveness_sweep degrades nodes with them.

Rate scaling is Nomad's: the heartbeat interval grows with the number of nodes so that the fleet
sends at most ``NODEPOOL["MAX_HEARTBEATS_PER_SECOND"]`` (nomad/heartbeat.go, ``RateScaledInterval``
plus a stagger: here each node's own slot, :func:`next_heartbeat_in`), and every liveness threshold
scales with it.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime

from django.core.cache import cache

from . import conf
from .choices import Lifecycle
from .models import Node, Pool

logger = logging.getLogger(__name__)

# Spreading the herd: every answer aims the node at its own slot in the interval (a hash of its
# id), moving it at most this fraction of the interval earlier or later, so the prescribed delay
# stays within [0.6, 1.4] x interval: above the flood guard's half interval, well inside the
# stale deadline (two intervals). Nodes that all arrive at one instant (a control-plane restart, a
# network blip) are spread evenly over 0.8 x interval at once, then settle on their slots
# (the phase error shrinks to a fifth at each renewal). Nomad staggers on the server side too
# (nomad/heartbeat.go); agents add no jitter of their own.
SLOT_SPREAD = 0.4
_SLOTS = 1_000_003
STALE_INTERVALS = 2
POPULATION_CACHE_KEY = "fleet:heartbeat_population"
POPULATION_CACHE_SECONDS = 30


@dataclass(frozen=True)
class Timings:
    """A pool's liveness timings at the current fleet size, in seconds.

    ``interval`` is the renewal interval nodes are told (``renewal_interval``; each answer's
    ``next_renewal_in`` aims at the node's slot around it); ``scale`` is
    ``interval / pool.heartbeat_interval`` (≥ 1) and multiplies the pool's grace and loss threshold.
    """

    interval: float
    scale: float
    stale_after: float
    unreachable_after: float
    lost_after: float
    # Status reports come at least this often (never more often than renewals are asked for).
    status_report_interval: float = 60.0


def max_heartbeats_per_second() -> float:
    return conf.get("MAX_HEARTBEATS_PER_SECOND")


def timings_for(pool: Pool, fleet_size: int, max_rate: float | None = None) -> Timings:
    """The liveness timings of ``pool`` when ``fleet_size`` nodes heartbeat.

    interval = max(pool.heartbeat_interval, fleet_size / max_rate) (Nomad's ``RateScaledInterval``:
    never below the pool's own interval); stale after two intervals; grace and loss threshold
    scaled by the same factor, so their ratios to the interval stay what the pool says.
    """
    rate = max_rate or max_heartbeats_per_second()
    base = float(pool.heartbeat_interval)
    interval = max(base, fleet_size / rate if rate > 0 else base)
    scale = interval / base if base > 0 else 1.0
    return Timings(
        interval=interval,
        scale=scale,
        stale_after=STALE_INTERVALS * interval,
        unreachable_after=max(pool.heartbeat_grace * scale, STALE_INTERVALS * interval),
        lost_after=max(pool.loss_threshold * scale, pool.heartbeat_grace * scale),
        status_report_interval=max(float(getattr(pool, "status_report_interval", 60) or 60), interval),
    )


def slot_of(node_id) -> float:
    """The node's own slot in the renewal interval, as a fraction in [0, 1) (from its id)."""
    value = node_id.int if isinstance(node_id, uuid.UUID) else uuid.UUID(str(node_id)).int
    return (value % _SLOTS) / _SLOTS


def next_heartbeat_in(timings: Timings, *, node_id, now: datetime) -> float:
    """Seconds until the node's next renewal (or heartbeat): aimed at its own slot in the interval.

    The slot is ``slot_of(node_id) x interval`` seconds into each interval of the server's clock
    (Unix time modulo the interval). The answer is the interval plus 0.8 x the signed error
    between the slot and ``now + interval`` (in [-interval/2, interval/2)), so it lies within
    [0.6, 1.4] x interval; a node already on its slot is told exactly the interval.
    """
    interval = timings.interval
    if interval <= 0:
        return 0.0
    error = (slot_of(node_id) * interval - (now.timestamp() + interval)) % interval
    if error >= interval / 2:
        error -= interval
    return round(interval + 2 * SLOT_SPREAD * error, 3)


def heartbeat_population(*, fresh: bool = False) -> int:
    """How many nodes heartbeat (every node not retired), cached for 30 s per process.

    Counting all non-retired nodes (not only live ones) keeps the interval steady while part of
    the fleet is silent: a shrinking count would shorten the interval under nodes told a longer one.
    """
    if not fresh:
        cached = cache.get(POPULATION_CACHE_KEY)
        if cached is not None:
            return cached
    count = Node.objects.exclude(lifecycle=Lifecycle.RETIRED).count()
    cache.set(POPULATION_CACHE_KEY, count, POPULATION_CACHE_SECONDS)
    return count
