"""The pace shared by renewals and status reports: per-pool timings and the flood guard.

Both message kinds (fleet.renewals, fleet.heartbeats) tell the node the same interval and refuse
a message that comes sooner than a fraction of it. They read the timings from one per-process
cache: if status reports told the interval fresh from the pool and renewals their cached one,
each kind would find "the interval changed" after the other, and that exemption would lift the
flood guard for both while the two differ.

Timings are per pool and change only with the pool or the fleet's size, so each process keeps
them for ``TIMINGS_CACHE_SECONDS`` (a pool edit reaches renewals within that time).
"""

from __future__ import annotations

import time

from nodepool.api.problems import Problem

from . import conf, liveness
from .errors import TOO_MANY_REQUESTS
from .models import Pool

TIMINGS_CACHE_SECONDS = 30.0
_TIMINGS: dict[int, tuple[float, liveness.Timings]] = {}


class TooManyRequests(Problem):
    """429 with ``Retry-After`` (whole seconds, rounded up)."""

    status_code = 429
    default_code = TOO_MANY_REQUESTS

    def __init__(self, detail: str, retry_after: float):
        self.wait = max(1, int(retry_after + 0.999))
        super().__init__(detail, TOO_MANY_REQUESTS, retry_after=self.wait)


def min_spacing_fraction() -> float:
    """The flood guard: a message kind may not come sooner than this fraction of the interval
    last told (``NODEPOOL["MIN_SPACING_FRACTION"]``, default 0.5; 0 turns the guard off)."""
    return conf.get("MIN_SPACING_FRACTION")


def pool_timings(pool_id: int, *, now_monotonic: float | None = None) -> liveness.Timings:
    """The liveness timings of pool ``pool_id`` at the current fleet size, cached per process."""
    clock = now_monotonic if now_monotonic is not None else time.monotonic()
    cached = _TIMINGS.get(pool_id)
    if cached is not None and clock - cached[0] < TIMINGS_CACHE_SECONDS:
        return cached[1]
    pool = Pool.objects.get(pk=pool_id)
    timings = liveness.timings_for(pool, liveness.heartbeat_population())
    _TIMINGS[pool_id] = (clock, timings)
    return timings


def forget_timings() -> None:
    """Drop this process's cached timings (fleet.renewals.forget_cached_timings drops the rest)."""
    _TIMINGS.clear()
