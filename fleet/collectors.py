"""Fleet state for ``/metrics``: nodes by state, capacity per resource, guards, drift.

Registered with :func:`nodepool.metrics.register_collector` in ``FleetConfig.ready()``. The
figures that scan every node (counts by state, capacity, reported usage, capability drift,
inconsistent usage) are computed by the beat task ``fleet.refresh_fleet_state`` every
``NODEPOOL["FLEET_STATE_INTERVAL"]`` seconds and read here from the one row it stores
(:mod:`fleet.fleet_state`), whose age is exported; a scrape runs a few small queries whatever the
fleet's size. Labels are pool names and state values, never node ids. docs/observability.md lists them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator

from django.db.models import Count
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from nodepool.metrics import bounded_resources, forget_object, gauge, resource_unit

from . import fleet_state, reliability
from .models import LivenessSweepState, Pool
from .readiness import shown_counts
from .selectors import IN_SERVICE_LIFECYCLES


def collect() -> Iterable[Metric]:
    pools = dict(Pool.objects.values_list("pk", "name"))
    state = fleet_state.current()
    figures = {**fleet_state.EMPTY, **(state.figures or {})}
    yield device_metrics(pools, figures)
    yield from reliability.metric_families(pools, figures)
    by_state, per_pool = node_counts(figures)

    yield gauge(
        "nodepool_nodes",
        "Nodes by pool, lifecycle, liveness and health (retired nodes are not counted).",
        ["pool", "lifecycle", "liveness", "health"],
        ((pools.get(p), lc, lv, h, n) for (p, lc, lv, h), n in by_state.items() if p in pools),
    )
    for metric, key, text in (
        ("nodepool_nodes_schedulable", "schedulable",
         "Nodes that may receive new work (ready, alive, reporting ready, healthy enough, valid credential)."),
        ("nodepool_nodes_in_service", "in_service",
         "Nodes admitted and not taken out (lifecycle ready, held or not, or draining): the Ready SLI's denominator."),
        ("nodepool_nodes_ready", "ready",
         "In-service nodes that are alive and report ready: the Ready SLI's numerator."),
        ("nodepool_nodes_clock_skewed", "skewed",
         "Nodes whose last measured clock skew exceeds NODEPOOL['CLOCK_SKEW_THRESHOLD'] seconds."),
    ):  # fmt: skip
        yield gauge(metric, text, ["pool"], samples_per_pool(pools, ((p, c[key]) for p, c in per_pool.items())))
    yield gauge(
        "nodepool_nodes_unverified",
        "Nodes deverified by a scheduled re-verification (taint nodepool.dev/unverified), by pool.",
        ["pool"],
        samples_per_pool(pools, ((p, n) for p, n in figures.get("unverified") or [])),
    )
    readiness, health_shown = shown_counts(figures)
    yield gauge(
        "nodepool_nodes_readiness",
        "Nodes by readiness as shown: ready / not_ready as reported, "
        "unknown once unreachable, lost or never heard from.",
        ["pool", "readiness"],
        sorted((pools[p], state, n) for (p, state), n in readiness.items() if p in pools),
    )
    yield gauge(
        "nodepool_nodes_health",
        "Nodes by health as shown: the judged health, unknown once unreachable, lost or never heard from.",
        ["pool", "health"],
        sorted((pools[p], state, n) for (p, state), n in health_shown.items() if p in pools),
    )
    yield gauge(
        "nodepool_pool_ready_ratio_objective",
        "The pool's Node Ready SLO (Pool.ready_ratio_objective), for burn-rate alerts.",
        ["pool"],
        Pool.objects.values_list("name", "ready_ratio_objective"),
    )
    restarts = CounterMetricFamily(
        "nodepool_node_restarts",
        "Agent restarts (incarnation changes) summed over the pool's current nodes (from Node.restart_count).",
        labels=["pool"],
    )
    for pool, total in samples_per_pool(pools, ((p, c["restarts"]) for p, c in per_pool.items())):
        restarts.add_metric([pool], float(total or 0))
    yield restarts
    yield from _capacity(pools, figures)
    yield gauge(
        "nodepool_nodes_capability_drift",
        "Nodes whose measured cpu or memory differs from the declared amount beyond the pool's benchmark tolerance.",
        ["pool"],
        samples_per_pool(pools, figures["capability_drift"]),
    )
    yield gauge(
        "nodepool_nodes_usage_inconsistent",
        "Nodes reporting usage of a resource well above what their leases and reservations account for.",
        ["pool"],
        samples_per_pool(pools, figures["usage_inconsistent"]),
    )
    yield GaugeMetricFamily(
        "nodepool_fleet_state_computed_timestamp_seconds",
        "When the node counts, capacity, usage, drift and inconsistent-usage figures were computed "
        "(Unix time; the beat task fleet.refresh_fleet_state); alert on time() minus this.",
        value=state.computed_at.timestamp(),
    )
    yield GaugeMetricFamily(
        "nodepool_fleet_state_compute_duration_seconds",
        "How long that computation took (its database queries included).",
        value=state.duration_seconds,
    )
    yield from _sweep()


def node_counts(figures: dict) -> tuple[dict, dict]:
    """The stored per-state rows (:mod:`fleet.fleet_state`) as ``({(pool, lifecycle, liveness,
    health): n}, {pool: {"schedulable", "in_service", "ready", "skewed", "restarts"}})``."""
    by_state: dict = {}
    per_pool: dict = defaultdict(Counter)
    for pool, lifecycle, liveness, health, n, schedulable, ready, skewed, restarts, *_ in figures["nodes"]:
        by_state[(pool, lifecycle, liveness, health)] = n
        totals = per_pool[pool]
        totals["schedulable"] += schedulable
        totals["in_service"] += n if lifecycle in IN_SERVICE_LIFECYCLES else 0
        totals["ready"] += ready
        totals["skewed"] += skewed
        totals["restarts"] += restarts or 0
    return by_state, per_pool


def samples_per_pool(pools: dict, rows) -> list[tuple]:
    """Rows ``(pool pk, value)`` → ``(pool name, value)`` for a ``["pool"]`` gauge; every pool of
    ``pools`` (``{pk: name}``) gets a sample, 0 when absent, in name order."""
    found = dict((row[0], row[1]) for row in rows)
    return [(name, found.get(pk, 0) or 0) for pk, name in sorted(pools.items(), key=lambda i: i[1])]


def counts_by_pool(pools: dict, queryset, pool_field: str, *fields: str) -> Iterator[tuple]:
    """Rows ``(pool name, *values of fields, count)`` of ``queryset`` in one GROUP BY, for a gauge
    labelled ``["pool", *fields]``.

    ``pool_field`` is the path to the pool's pk (``"pool"``, ``"node__pool"``); ``pools`` is
    ``{pk: name}``, and a pool missing from it (deleted since it was read) is labelled ``""``.
    Only combinations that exist get a sample.
    """
    rows = queryset.values_list(pool_field, *fields).annotate(n=Count("id")).order_by()
    return ((pools.get(pool, ""), *values, n) for pool, *values, n in rows)


def _capacity(pools: dict, figures: dict) -> Iterable[Metric]:
    rows = figures["capacity"]
    label = bounded_resources(r[1] for r in rows)
    families = {
        key: GaugeMetricFamily(f"nodepool_pool_{key}", text, labels=["pool", "resource", "unit"])
        for key, text in (
            ("allocatable", "Allocatable capacity of in-service nodes (capacity minus reservations), in base units."),
            ("allocated", "Capacity held by live leases on in-service nodes, in base units."),
            ("used", "Usage the in-service nodes report in their heartbeats, in base units."),
        )
    }
    sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for pool, resource, allocatable, allocated in rows:
        key = (pools.get(pool), label(resource), resource_unit(resource))
        sums[key][0] += (allocatable or 0) * key[2][1]
        sums[key][1] += (allocated or 0) * key[2][1]
    for (pool, resource, (unit, _)), (allocatable, allocated) in sorted(sums.items(), key=str):
        families["allocatable"].add_metric([pool, resource, unit], allocatable)
        families["allocated"].add_metric([pool, resource, unit], allocated)
    for pool, resource, amount in figures["used"]:
        unit, factor = resource_unit(resource)
        families["used"].add_metric([pools.get(pool, ""), resource, unit], float(amount or 0) * factor)
    return families.values()


def _sweep() -> Iterable[Metric]:
    state = LivenessSweepState.objects.filter(pk=1).values_list("last_run_at", "guarded_groups").first()
    last_run, guards = state if state else (None, {})
    if last_run is not None:
        yield GaugeMetricFamily(
            "nodepool_liveness_sweep_last_run_timestamp_seconds",
            "When the liveness sweep last completed (Unix time); alert on time() minus this.",
            value=last_run.timestamp(),
        )
    engaged = GaugeMetricFamily(
        "nodepool_mass_silence_guard_engaged",
        "1 for each group where the mass-silence guard withholds lease loss (pool '*' = the whole fleet).",
        labels=["pool", "scope", "zone"],
    )
    for key, guard in sorted((guards or {}).items()):
        pool, _, zone = key.partition("/")
        engaged.add_metric([pool, str(guard.get("scope", "")), zone], 1.0)
    yield engaged


def device_metrics(pools: dict, figures: dict) -> Metric:
    """``nodepool_devices{pool,type,model,health,allocatable}``: live devices, counted by the
    fleet-state task (fleet.devices.device_metric_rows), the model normalised to a known list or
    ``other``; never a device id."""
    return gauge(
        "nodepool_devices",
        "Live devices by pool, type, normalised model, health and whether they are allocatable.",
        ["pool", "type", "model", "health", "allocatable"],
        ((pools[p], t, m, h, str(a).lower(), n) for p, t, m, h, a, n in figures["devices"] if p in pools),
    )


def existing_pools() -> dict:
    """``{pool name: created_at}`` of every pool (per-process series of other names are not exported)."""
    return dict(Pool.objects.values_list("name", "created_at"))


def existing_request_classes() -> dict:
    """``{(pool name, request class name): pool created_at}`` of every request class declared now."""
    return {
        (name, c.get("name")): created
        for name, created, classes in Pool.objects.values_list("name", "created_at", "request_classes")
        for c in classes or []
        if isinstance(c, dict) and c.get("name")
    }


def forget_pool_series(sender, instance: Pool, **kwargs) -> None:
    """``post_delete`` of a pool (whatever deletes it): remember its per-process series' values, so
    that a pool created later under the same name starts from zero (nodepool.metrics.forget_object)."""
    forget_object("pool", instance.name)
