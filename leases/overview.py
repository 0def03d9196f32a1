"""The admin fleet overview: per pool, nodes by state, capacity bars, schedulable nodes, "can serve
class X: N", pending lease requests, the mass-silence guard and recent events.

Nothing here scans the fleet, so the page stays cheap at 10,000 nodes (bench/observability.py):
node counts and capacity are the figures the beat task fleet.refresh_fleet_state stored (at most
``NODEPOOL["FLEET_STATE_INTERVAL"]``, 15 s, old; fleet/fleet_state.py), "can serve" numbers the
ones leases.refresh_request_class_fits stored (at most 30 s old). Pending requests, the guard and
the last events are read live: five small queries whatever the number of pools or nodes (each
pool's last event ids come with the pool rows, then one query reads those events).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.db.models import Count, Min, OuterRef, Subquery
from django.utils import timezone

from fleet import fleet_state
from fleet.models import LivenessSweepState, NodeEvent, Pool
from fleet.readiness import shown_counts
from fleet.selectors import IN_SERVICE_LIFECYCLES
from humanunits import quantity

from .choices import LeaseRequestState
from .models import LeaseRequest

EVENTS_PER_POOL = 5


def fleet_overview(*, now=None, events_per_pool: int = EVENTS_PER_POOL) -> list[dict[str, Any]]:
    """One entry per pool, sorted by name::

    {"pool": Pool, "total": n, "schedulable": n, "ready": n, "in_service": n,
     "lifecycle": {state: n}, "liveness": {state: n}, "health": {state: n}, "readiness": {state: n},
     "capacity": [{"resource", "allocatable", "allocated", "percent", "label"}],
     "request_classes": [{"name", "fits"}], "pending": n, "oldest_pending_seconds": float | None,
     "guards": [{"scope", "zone", "silent", "total"}], "events": [NodeEvent],
     "request_classes_at": datetime | None, "state_at": datetime}  # when the stored figures were computed
    """
    now = now or timezone.now()
    pools = list(Pool.objects.annotate(**_recent_event_ids(events_per_pool)).order_by("name"))
    by_pool: dict[int, dict[str, Any]] = {
        pool.pk: {
            "pool": pool, "total": 0, "schedulable": 0, "ready": 0, "in_service": 0,
            "lifecycle": defaultdict(int), "liveness": defaultdict(int), "health": defaultdict(int),
            "readiness": defaultdict(int),
            "capacity": [], "request_classes": [], "pending": 0, "oldest_pending_seconds": None,
            "guards": [], "events": [], "state_at": None,
        }
        for pool in pools
    }  # fmt: skip
    state = fleet_state.current()
    figures = {**fleet_state.EMPTY, **(state.figures or {})}
    for pool, lifecycle, liveness, _health, n, n_schedulable, n_ready, *_ in figures["nodes"]:
        entry = by_pool.get(pool)
        if entry is None:
            continue
        entry["total"] += n
        entry["schedulable"] += n_schedulable
        entry["ready"] += n_ready
        entry["in_service"] += n if lifecycle in IN_SERVICE_LIFECYCLES else 0
        entry["lifecycle"][lifecycle] += n
        entry["liveness"][liveness] += n
    # Health and readiness as shown: unknown once a node is unreachable, lost or never heard from.
    readiness, health_shown = shown_counts(figures)
    for (pool, state_name), n in readiness.items():
        if pool in by_pool and n:
            by_pool[pool]["readiness"][state_name] += n
    for (pool, state_name), n in health_shown.items():
        if pool in by_pool and n:
            by_pool[pool]["health"][state_name] += n
    for pool, name, allocatable, allocated in figures["capacity"]:
        if pool in by_pool:
            percent = round(100 * allocated / allocatable, 1) if allocatable else 0.0
            label = f"{quantity(name, allocated)} of {quantity(name, allocatable)}"
            by_pool[pool]["capacity"].append(
                {
                    "resource": name,
                    "allocatable": allocatable,
                    "allocated": allocated,
                    "percent": percent,
                    "label": label,
                }
            )
    for pool, n, oldest in (
        LeaseRequest.objects.filter(state=LeaseRequestState.PENDING)
        .values_list("pool")
        .annotate(n=Count("id"), oldest=Min("created_at"))
        .order_by()
    ):
        if pool in by_pool:
            by_pool[pool]["pending"] = n
            by_pool[pool]["oldest_pending_seconds"] = (now - oldest).total_seconds()
    names = {pool.name: pool.pk for pool in pools}
    guards = LivenessSweepState.objects.filter(pk=1).values_list("guarded_groups", flat=True).first() or {}
    for key, guard in sorted(guards.items()):
        pool_name, _, zone = key.partition("/")
        targets = list(by_pool) if pool_name == "*" else [names[pool_name]] if pool_name in names else []
        for pk in targets:
            by_pool[pk]["guards"].append({**guard, "zone": zone if zone != "*" else ""})
    for pool in pools:
        entry = by_pool[pool.pk]
        stored = pool.request_class_fits or {}
        entry["request_classes"] = [
            {"name": c["name"], "fits": stored.get(c["name"])} for c in pool.request_classes or []
        ]
        entry["request_classes_at"] = pool.request_class_fits_at
        entry["state_at"] = state.computed_at
        for key in ("lifecycle", "liveness", "health", "readiness"):
            entry[key] = dict(sorted(entry[key].items()))
    wanted = [getattr(pool, f"recent_event_{i}") for pool in pools for i in range(events_per_pool)]
    for event in NodeEvent.objects.filter(pk__in=[pk for pk in wanted if pk is not None]).select_related("node"):
        by_pool[event.pool_id]["events"].append(event)
    for entry in by_pool.values():
        entry["events"].sort(key=lambda e: (e.created_at, e.pk), reverse=True)
    return [by_pool[pool.pk] for pool in pools]


def _recent_event_ids(count: int) -> dict[str, Subquery]:
    """Annotations ``recent_event_<i>``: the id of a pool's i-th most recent event (each one index
    lookup on ``nodeevent_pool_recent``), so that one query then reads every pool's last events
    instead of one query per pool."""
    recent = NodeEvent.objects.filter(pool=OuterRef("pk")).order_by("-created_at", "-id").values("pk")
    return {f"recent_event_{i}": Subquery(recent[i : i + 1]) for i in range(count)}
