"""Fleet-wide aggregates computed by a beat task and stored, read by ``/metrics`` and the fleet overview.

Counting nodes by state, summing capacity and reported usage, and finding capability drift and
usage that leases do not explain each scan every node (the last two extract JSON numbers from each
one): about 200 ms of queries at 10,000 nodes (bench/observability.py). Done at every scrape of
every web process, and at every view of the fleet overview, that cost more than the scrape may.
So, as with the request classes' "can serve N now" (leases.preview.refresh_request_class_fits),
the beat task ``fleet.refresh_fleet_state`` computes them every ``NODEPOOL["FLEET_STATE_INTERVAL"]``
seconds (default 15) into the one :class:`~fleet.models.FleetState` row, and readers take that
row (:func:`current`). Storing in the database means gunicorn workers, Celery and the embedded
SQLite default all read the same figures. ``/metrics`` exports the row's age
(``nodepool_fleet_state_computed_timestamp_seconds``) so a stopped beat is visible.

``figures`` (JSON; pools by pk, resources by name, amounts in canonical units)::

    {"nodes": [[pool, lifecycle, liveness, health, n, schedulable, ready, clock_skewed, restarts, reports_ready]],
     "capacity": [[pool, resource, allocatable, allocated]],   # in-service nodes
     "used": [[pool, resource, reported usage]],               # in-service nodes
     "capability_drift": [[pool, n]], "usage_inconsistent": [[pool, n]],
     "devices": [[pool, type, model, health, allocatable, n]],  # live devices, bounded labels
     "reliability": [[pool, unrated, n<=0.5, …, n<=1.0]],       # fleet.reliability.metric_rows
     "unverified": [[pool, n]]}                                  # fleet.trust: deverified nodes

Retired nodes are never counted. Each query is one GROUP BY over the whole fleet.
"""

from __future__ import annotations

import time
from decimal import Decimal

from django.db import connection
from django.db.models import BigIntegerField, Count, F, Q, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import Abs, Cast
from django.utils import timezone

from nodepool.metrics import bounded_resources

from . import conf
from .choices import Lifecycle, Liveness
from .devices import device_metric_rows
from .models import FleetState, Node, NodeResource, Pool
from .reliability import metric_rows as reliability_metric_rows
from .selectors import IN_SERVICE_LIFECYCLES, schedulable_q, valid_credential_exists
from .trust import metric_rows as unverified_metric_rows

# Reported usage above what leases and reservations account for, by more than (this - 1) × the
# node's capacity, is "inconsistent" (agents measure their own overhead; a little above is noise,
# far above is work the control plane does not know about).
USAGE_SLACK = 1.10
DRIFT_RESOURCES = ("cpu", "memory")  # the resources benchmarks measure (fleet.benchmarks.compare_benchmark)

EMPTY: dict = {
    "nodes": [],
    "capacity": [],
    "used": [],
    "capability_drift": [],
    "usage_inconsistent": [],
    "devices": [],
    "reliability": [],
    "unverified": [],
}


def interval() -> float:
    """Seconds between two runs of the beat task (``NODEPOOL["FLEET_STATE_INTERVAL"]``)."""
    return conf.get("FLEET_STATE_INTERVAL")


def current() -> FleetState:
    """The stored figures; computed (and stored) here only when none were ever stored, so a fresh
    install answers before beat's first run. Stale figures are returned as they are: their age is
    exported, and the next run of the task replaces them."""
    state = FleetState.objects.filter(pk=1).first()
    if state is None or state.computed_at is None:
        state = refresh()
    return state


def refresh(*, now=None) -> FleetState:
    """Compute every figure and store it in the ``FleetState`` row (the beat task's body).

    A run that started before the stored one (two runs overlapping) does not overwrite it.
    """
    now = now or timezone.now()
    started = time.perf_counter()
    figures = compute(now=now)
    duration = time.perf_counter() - started
    FleetState.objects.get_or_create(pk=1)
    FleetState.objects.filter(pk=1).filter(Q(computed_at__isnull=True) | Q(computed_at__lte=now)).update(
        computed_at=now, duration_seconds=duration, figures=figures
    )
    return FleetState.objects.get(pk=1)


def compute(*, now=None) -> dict:
    """Every figure of :data:`EMPTY`'s shape, from the database as it is now (seven queries)."""
    now = now or timezone.now()
    capacity = _capacity()
    label = bounded_resources(row[1] for row in capacity)
    return {
        "nodes": _node_counts(now),
        "capacity": capacity,
        "used": _reported_usage({label(row[1]) for row in capacity} - {"other"}),
        "capability_drift": _drift(),
        "usage_inconsistent": _usage_inconsistent(),
        "devices": device_metric_rows(),
        "reliability": reliability_metric_rows(),
        "unverified": unverified_metric_rows(),
    }


def _number(value) -> int | float:
    """A database sum as a JSON number (PostgreSQL sums bigints into numerics)."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    return value or 0


def _node_counts(now) -> list[list]:
    """One scan of the node table: per (pool, lifecycle, liveness, health), the count and how many
    of those are schedulable, Ready (in service, alive, reporting ready) and clock-skewed, the
    sum of their restarts, and how many last reported ready (whatever their liveness)."""
    skew = conf.get("CLOCK_SKEW_THRESHOLD")
    in_service = Q(lifecycle__in=IN_SERVICE_LIFECYCLES)
    rows = (
        Node.objects.exclude(lifecycle=Lifecycle.RETIRED)
        # reports_ready: the column under another name, since the "ready" annotation below hides it.
        .alias(
            has_valid_credential=valid_credential_exists(now), skew=Abs("clock_skew_seconds"), reports_ready=F("ready")
        )
        .values_list("pool", "lifecycle", "liveness", "health")
        .annotate(
            n=Count("id"),
            schedulable=Count("id", filter=schedulable_q(now)),
            ready=Count("id", filter=in_service & Q(liveness=Liveness.ALIVE, ready=True)),
            skewed=Count("id", filter=Q(skew__gt=skew)),
            restarts=Sum("restart_count"),
            reported_ready=Count("id", filter=Q(reports_ready=True)),  # readiness shown (fleet.readiness)
        )
        .order_by()
    )
    return [[*row[:4], *map(_number, row[4:])] for row in rows]


def _capacity() -> list[list]:
    """``[pool, resource, allocatable, allocated]`` summed over in-service nodes."""
    rows = (
        NodeResource.objects.filter(node__lifecycle__in=IN_SERVICE_LIFECYCLES)
        .values_list("node__pool", "name")
        .annotate(Sum("allocatable"), Sum("allocated"))
        .order_by("node__pool", "name")
    )
    return [[pool, name, _number(allocatable), _number(allocated)] for pool, name, allocatable, allocated in rows]


def _reported_usage(resources: set[str]) -> list[list]:
    """``[pool, resource, summed usage]`` from ``Node.usage`` (``{resource: canonical int}``) of
    in-service nodes, for ``resources`` only."""
    if not resources:
        return []
    names = sorted(resources)
    sums = {f"u{i}": Sum(Cast(KT(f"usage__{r}"), BigIntegerField())) for i, r in enumerate(names)}
    out = []
    for row in Node.objects.filter(lifecycle__in=IN_SERVICE_LIFECYCLES).values("pool").annotate(**sums).order_by():
        for i, resource in enumerate(names):
            if row[f"u{i}"] is not None:
                out.append([row["pool"], resource, _number(row[f"u{i}"])])
    return out


def _json_number(column: str, *path: str) -> str:
    """SQL for a number inside a JSON column, NULL when absent, on PostgreSQL and SQLite alike."""
    if connection.vendor == "postgresql":
        inner = "".join(f" -> '{p}'" for p in path[:-1])
        return f"(({column}{inner} ->> '{path[-1]}')::float8)"
    return f"CAST(json_extract({column}, '$.{'.'.join(path)}') AS REAL)"


def _drift() -> list[list]:
    """Nodes per pool whose measured/declared ratio of cpu or memory is outside the tolerance band:
    measured < declared × tolerance (the node overstates) or declared < measured × tolerance.

    Raw SQL: each JSON number is extracted once in a subselect (the ORM repeats the expressions
    in every OR branch, which cost four times as much at 10,000 nodes). On PostgreSQL ``OFFSET 0``
    keeps the planner from pulling the subselect up into the outer query, which would repeat the
    extractions in the filter again (34 -> 18 ms at 10,000 nodes). Not on SQLite (OFFSET needs a LIMIT there).
    """
    columns, conditions = [], []
    fence = " OFFSET 0" if connection.vendor == "postgresql" else ""
    for i, resource in enumerate(DRIFT_RESOURCES):
        columns.append(f"{_json_number('n.declared', 'resources', resource)} AS d{i}")
        columns.append(f"{_json_number('n.measured', 'resources', resource)} AS m{i}")
        conditions.append(f"(d{i} > 0 AND m{i} < d{i} * t) OR (m{i} > 0 AND d{i} < m{i} * t)")
    sql = (
        f"SELECT s.pool_id, COUNT(*) FROM (SELECT n.pool_id, p.benchmark_tolerance AS t, {', '.join(columns)} "  # noqa: S608 (no input in it)
        f"FROM {Node._meta.db_table} n JOIN {Pool._meta.db_table} p ON p.id = n.pool_id "
        f"WHERE n.lifecycle <> %s{fence}) s WHERE {' OR '.join(conditions)} GROUP BY s.pool_id"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [Lifecycle.RETIRED])
        return [[pool, n] for pool, n in cursor.fetchall()]


def _usage_inconsistent() -> list[list]:
    """Nodes per pool reporting cpu or memory usage above leases + reservations + slack × capacity.

    One join of the resource rows with their node (the usage key is the resource row's name).
    """
    if connection.vendor == "postgresql":
        used = "((n.usage ->> r.name)::float8)"
    else:
        used = """CAST(json_extract(n.usage, '$."' || r.name || '"') AS REAL)"""
    names = ", ".join("%s" for _ in DRIFT_RESOURCES)
    sql = (
        f"SELECT n.pool_id, COUNT(DISTINCT n.id) FROM {NodeResource._meta.db_table} r "  # noqa: S608 (no input in it)
        f"JOIN {Node._meta.db_table} n ON n.id = r.node_id "
        f"WHERE r.name IN ({names}) AND n.lifecycle <> %s "
        f"AND {used} > r.allocated + r.reserved + r.capacity * %s GROUP BY n.pool_id"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [*DRIFT_RESOURCES, Lifecycle.RETIRED, USAGE_SLACK - 1])
        return [[pool, n] for pool, n in cursor.fetchall()]
