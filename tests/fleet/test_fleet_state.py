"""fleet.refresh_fleet_state: the fleet-wide figures /metrics and the admin fleet overview read.

The beat task computes node counts by state, capacity, reported usage, capability drift and
inconsistent usage into one stored row; a scrape or a page view reads that row instead of scanning
the fleet. Here: the task finds what a node-by-node walk of a small fleet finds, readers use the
stored figures (and say how old they are), and nothing at scrape time reads the node table.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from fleet import collectors, conf, fleet_state
from fleet.choices import Health, Lifecycle, Liveness
from fleet.models import FleetState, Node, NodeCredential, NodeResource, Pool
from fleet.reliability import BUCKETS
from fleet.selectors import IN_SERVICE_LIFECYCLES, SCHEDULABLE_HEALTH
from fleet.tasks import refresh_fleet_state_task
from leases.overview import fleet_overview
from nodepool.celery import app
from tests.factories import NodeFactory, PoolFactory, make_schedulable_node, set_lifecycle
from tests.metrics_support import samples, scrape, value

GiB = 2**30
pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet():
    """Two pools (tolerances 0.8 and 0.5) with nodes in many states: drifting, over-using, skewed,
    restarted, cordoned, unreachable, degraded, without a credential, draining, pending, retired."""
    strict = PoolFactory(name="strict", benchmark_tolerance=0.8)
    loose = PoolFactory(name="loose", benchmark_tolerance=0.5)
    big = {"cpu": 8000, "memory": 32 * GiB}
    declared = {"resources": big}

    def node(pool, hostname, *, resources=big, **fields):
        made, _ = make_schedulable_node(pool, hostname=hostname, resources=resources, declared=declared)
        if fields:
            Node.objects.filter(pk=made.pk).update(**fields)
        return made

    node(strict, "plain")
    node(strict, "slow-cpu", measured={"resources": {"cpu": 6000, "memory": 32 * GiB}})  # 0.75 < 0.8: drift
    node(loose, "slow-cpu", measured={"resources": {"cpu": 6000, "memory": 32 * GiB}})  # 0.75 >= 0.5: none
    node(strict, "big-memory", measured={"resources": {"cpu": 8000, "memory": 48 * GiB}})  # declared < 0.8 x
    node(strict, "over-using", usage={"cpu": 8500, "memory": GiB})  # 8.5 > 0 + 0 + 0.8 cores
    node(strict, "leased", usage={"cpu": 5000, "memory": GiB})
    NodeResource.objects.filter(node__hostname="leased", name="cpu").update(allocated=5000)  # explained
    node(loose, "skewed", clock_skew_seconds=-45.0, restart_count=2, usage={"cpu": 500})
    node(loose, "restarted", restart_count=3, health=Health.DEGRADED)
    node(loose, "cordoned", cordoned=True)
    node(loose, "silent", liveness=Liveness.UNREACHABLE)
    node(loose, "not-ready", ready=False)
    node(loose, "overdue", status_report_overdue=True)
    gone = node(strict, "no-credential")
    NodeCredential.objects.filter(node=gone).update(revoked_at=timezone.now())
    set_lifecycle(node(strict, "draining", usage={"memory": 40 * GiB}), Lifecycle.DRAINING)
    NodeFactory(pool=loose, hostname="newcomer", measured={"resources": {"cpu": 1000}})  # pending, drifting
    set_lifecycle(node(strict, "retired", measured={"resources": {"cpu": 1000}}), Lifecycle.RETIRED)
    plain = Node.objects.get(hostname="plain")
    NodeResource.objects.create(node=plain, name="nvidia.com/gpu", capacity=4, allocatable=4, allocated=1)
    Node.objects.filter(hostname="plain").update(usage={"cpu": 500, "nvidia.com/gpu": 1})
    return strict, loose


def walk() -> dict:
    """What a node-by-node walk of the fleet finds, in the stored figures' shape (sorted rows)."""
    now = timezone.now()
    credentialed = set(
        NodeCredential.objects.filter(revoked_at__isnull=True, expires_at__gt=now).values_list("node_id", flat=True)
    )
    skew = conf.get("CLOCK_SKEW_THRESHOLD")
    nodes: dict[tuple, Counter] = defaultdict(Counter)
    capacity: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    used: Counter = Counter()
    drift: Counter = Counter()
    inconsistent: Counter = Counter()
    resources = defaultdict(dict)
    for r in NodeResource.objects.all():
        resources[r.node_id][r.name] = r
    names = {r.name for rows in resources.values() for r in rows.values()}
    for node in Node.objects.select_related("pool").exclude(lifecycle=Lifecycle.RETIRED):
        in_service = node.lifecycle in IN_SERVICE_LIFECYCLES
        counts = nodes[(node.pool_id, node.lifecycle, node.liveness, node.health)]
        counts["n"] += 1
        counts["schedulable"] += (
            node.lifecycle == Lifecycle.READY and not node.cordoned and node.liveness == Liveness.ALIVE
            and node.ready and node.health in SCHEDULABLE_HEALTH and not node.status_report_overdue
            and node.pk in credentialed
        )  # fmt: skip
        counts["ready"] += in_service and node.liveness == Liveness.ALIVE and node.ready
        counts["skewed"] += abs(node.clock_skew_seconds or 0) > skew
        counts["restarts"] += node.restart_count
        counts["reports_ready"] += node.ready
        tolerance = node.pool.benchmark_tolerance
        drifting = over = False
        for name in ("cpu", "memory"):
            d = (node.declared or {}).get("resources", {}).get(name)
            m = (node.measured or {}).get("resources", {}).get(name)
            if d is not None and m is not None:
                drifting |= (d > 0 and m < d * tolerance) or (m > 0 and d < m * tolerance)
            row = resources[node.pk].get(name)
            use = (node.usage or {}).get(name)
            if row is not None and use is not None:
                over |= use > row.allocated + row.reserved + row.capacity * 0.1
        drift[node.pool_id] += drifting
        inconsistent[node.pool_id] += over
        if in_service:
            for name, row in resources[node.pk].items():
                capacity[(node.pool_id, name)][0] += row.allocatable
                capacity[(node.pool_id, name)][1] += row.allocated
            for name, amount in (node.usage or {}).items():
                if name in names:
                    used[(node.pool_id, name)] += amount
    return {
        "nodes": sorted(
            [*key, c["n"], c["schedulable"], c["ready"], c["skewed"], c["restarts"], c["reports_ready"]]
            for key, c in nodes.items()
        ),
        "capacity": sorted([*key, *sums] for key, sums in capacity.items()),
        "used": sorted([*key, amount] for key, amount in used.items()),
        "capability_drift": sorted([pool, n] for pool, n in drift.items() if n),
        "usage_inconsistent": sorted([pool, n] for pool, n in inconsistent.items() if n),
        "devices": [],  # this fleet has none; tests/fleet/test_devices.py counts devices
        "reliability": reliability_walk(),
        # nodes carrying nodepool.dev/unverified (fleet.trust); tests/fleet/test_reverification.py deverifies some
        "unverified": sorted(
            [pool, n]
            for pool, n in Counter(
                node.pool_id
                for node in Node.objects.exclude(lifecycle=Lifecycle.RETIRED)
                if any(t.get("key") == "nodepool.dev/unverified" for t in node.taints or [])
            ).items()
        ),
    }


def reliability_walk() -> list[list]:
    """``[pool, unrated, n<=bound for each of fleet.reliability.BUCKETS]`` node by node."""
    rows: dict = {}
    for node in Node.objects.exclude(lifecycle=Lifecycle.RETIRED):
        row = rows.setdefault(node.pool_id, [node.pool_id, 0, *[0] * len(BUCKETS)])
        if node.reliability is None:
            row[1] += 1
        for index, bound in enumerate(BUCKETS):
            row[2 + index] += node.reliability is not None and node.reliability <= bound
    return sorted(rows.values())


def stored() -> dict:
    return {key: sorted(rows) for key, rows in FleetState.objects.get(pk=1).figures.items()}


def test_the_task_finds_what_a_node_by_node_walk_finds(fleet):
    strict, loose = fleet
    Node.objects.filter(hostname="newcomer").update(reliability=0.97)
    Node.objects.filter(pk=Node.objects.filter(pool=strict).order_by("pk").values("pk")[:1]).update(reliability=0.4)
    refresh_fleet_state_task.apply()
    figures = stored()
    assert figures == walk()
    assert figures["capability_drift"] == sorted([[strict.pk, 2], [loose.pk, 1]])
    assert figures["usage_inconsistent"] == sorted([[strict.pk, 2]])  # over-using, draining (memory)
    assert [strict.pk, "nvidia.com/gpu", 4, 1] in figures["capacity"]
    assert [strict.pk, "nvidia.com/gpu", 1] in figures["used"]
    state = FleetState.objects.get(pk=1)
    assert state.computed_at is not None and state.duration_seconds > 0


def test_metrics_after_the_task_carry_the_walks_figures(client, fleet):
    strict, loose = fleet
    fleet_state.refresh()
    text = samples(scrape(client))
    for pool in (strict, loose):
        nodes = Node.objects.filter(pool=pool).exclude(lifecycle=Lifecycle.RETIRED)
        assert (
            value(text, "nodepool_nodes_in_service", pool=pool.name)
            == nodes.filter(lifecycle__in=IN_SERVICE_LIFECYCLES).count()
        )
    assert (
        value(text, "nodepool_nodes_schedulable", pool="strict") == 5
    )  # plain, slow-cpu, big-memory, over-using, leased
    assert value(text, "nodepool_nodes_schedulable", pool="loose") == 3  # slow-cpu, skewed, restarted (degraded)
    assert value(text, "nodepool_nodes_ready", pool="loose") == 5  # slow-cpu, skewed, restarted, cordoned, overdue
    assert value(text, "nodepool_nodes_clock_skewed", pool="loose") == 1
    assert value(text, "nodepool_node_restarts_total", pool="loose") == 5
    assert value(text, "nodepool_nodes_capability_drift", pool="strict") == 2
    assert value(text, "nodepool_nodes_capability_drift", pool="loose") == 1
    assert value(text, "nodepool_nodes_usage_inconsistent", pool="strict") == 2
    assert value(text, "nodepool_nodes_usage_inconsistent", pool="loose") == 0
    assert value(text, "nodepool_pool_used", pool="strict", resource="nvidia.com/gpu", unit="integer") == 1
    assert value(text, "nodepool_pool_allocated", pool="strict", resource="cpu", unit="core") == 5
    computed = FleetState.objects.get(pk=1)
    assert value(text, "nodepool_fleet_state_computed_timestamp_seconds") == computed.computed_at.timestamp()
    assert value(text, "nodepool_fleet_state_compute_duration_seconds") == computed.duration_seconds


def test_a_scrape_reads_the_stored_figures_until_the_next_run(client, fleet):
    strict, _ = fleet
    earlier = timezone.now() - timedelta(seconds=40)
    fleet_state.refresh(now=earlier)
    make_schedulable_node(strict, hostname="late")
    text = samples(scrape(client))
    assert value(text, "nodepool_nodes_schedulable", pool="strict") == 5  # not yet
    assert value(text, "nodepool_fleet_state_computed_timestamp_seconds") == earlier.timestamp()
    fleet_state.refresh()
    assert value(scrape(client), "nodepool_nodes_schedulable", pool="strict") == 6


def test_a_scrape_scans_no_node(fleet):
    fleet_state.refresh()
    with CaptureQueriesContext(connection) as queries:
        list(collectors.collect())
    assert len(queries) <= 5
    for query in queries:
        assert "fleet_node" not in query["sql"], query["sql"]


def test_the_first_reader_computes_when_nothing_was_stored(fleet):
    assert not FleetState.objects.exists()
    names = {family.name for family in collectors.collect()}
    assert "nodepool_fleet_state_computed_timestamp_seconds" in names
    assert stored() == walk()


def test_a_run_that_started_earlier_never_overwrites_a_later_one(fleet):
    now = timezone.now()
    fleet_state.refresh(now=now)
    Node.objects.filter(hostname="plain").update(cordoned=True)
    fleet_state.refresh(now=now - timedelta(seconds=20))  # a slow run, started before
    assert FleetState.objects.get(pk=1).computed_at == now
    assert stored() != walk()


def test_the_overview_reads_the_stored_figures(fleet):
    strict, _ = fleet
    fleet_state.refresh()
    make_schedulable_node(strict, hostname="late")
    entry = next(e for e in fleet_overview() if e["pool"].name == "strict")
    assert (entry["total"], entry["schedulable"]) == (7, 5)
    assert entry["state_at"] == FleetState.objects.get(pk=1).computed_at
    fleet_state.refresh()
    entry = next(e for e in fleet_overview() if e["pool"].name == "strict")
    assert (entry["total"], entry["schedulable"]) == (8, 6)


def test_pools_without_nodes_and_pools_added_since_get_zero(client, fleet):
    fleet_state.refresh()
    Pool.objects.create(name="added-later")
    text = samples(scrape(client))
    assert value(text, "nodepool_nodes_schedulable", pool="added-later") == 0
    assert value(text, "nodepool_nodes_capability_drift", pool="added-later") == 0


def test_beat_runs_the_task_every_fleet_state_interval():
    entry = app.conf.beat_schedule["fleet-refresh-fleet-state"]
    assert entry["task"] == "fleet.refresh_fleet_state" == refresh_fleet_state_task.name
    assert entry["schedule"] == fleet_state.interval() == 15.0
    assert entry["options"]["expires"] < entry["schedule"]
