"""/metrics and the admin fleet overview at 10,000 nodes on PostgreSQL, next to same-run baselines.

    .venv/bin/python bench/observability.py [--nodes 10000] [--scrapes 200] [--quick]

Seeds ``--nodes`` nodes over four pools (mixed lifecycle, liveness and health; cpu and memory on
every node, GPUs on a quarter; credentials; reported usage; queued lease requests; events; two
request classes per pool, one plain and one with a feature, so both "can serve N now" paths run).

* ``/metrics``: sequential scrapes through gunicorn (one worker) with the scrape token and the
  per-process scrape cache **off** (``NODEPOOL_METRICS_CACHE_SECONDS=0``), so every scrape runs
  every query: the worst case, not the cached one. Goal: p99 <= 200 ms. Baseline, same run, same
  database: ``SELECT count(*) FROM fleet_node``.
* The beat tasks whose stored answers /metrics and the overview read: ``fleet.refresh_fleet_state``
  (node counts, capacity, usage, capability drift, inconsistent usage; every 15 s) and the pools'
  request-class evaluation (every 30 s), run after seeding: their median run times over three
  runs are reported.
* Fleet overview: ``GET /admin/fleet-overview/`` rendered in-process (Django's test client, an
  operator logged in), median and p99. Goal: <= 4x the baseline ``SELECT pool_id, count(*) FROM
  fleet_node GROUP BY pool_id``, timed in the same process.

``--quick`` (CI): 400 nodes, 20 scrapes, 10 renders. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEFAULT_DATABASE_URL, Gunicorn, django_setup, emit, percentile, prepare_database

TOKEN = "bench-metrics-token-" + secrets.token_hex(8)
GiB = 2**30
POOLS = ("batch", "gpu", "edge", "web")


def seed(count: int) -> None:
    """``count`` nodes over :data:`POOLS` with resources, credentials, usage, events and requests."""
    from django.contrib.auth.models import User
    from django.db import connection
    from django.utils import timezone

    from fleet.models import Node, NodeCredential, NodeEvent, NodeResource, Pool
    from leases.models import LeaseRequest

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE fleet_nodeevent, fleet_nodecredential, fleet_noderesource, fleet_node, fleet_pool, "
            "leases_leaserequest, leases_lease, fleet_livenesssweepstate, fleet_fleetstate CASCADE"
        )
    now = timezone.now()
    pools = [
        Pool.objects.create(
            name=name,
            request_classes=[
                {"name": "small", "resources": {"cpu": 2000, "memory": 4 * GiB}},
                {"name": "amd64-large", "resources": {"cpu": 16000}, "features": {"arch": "amd64"}},
            ],
        )
        for name in POOLS
    ]
    nodes, resources, credentials = [], [], []
    for i in range(count):
        pool = pools[i % len(pools)]
        lifecycle = "pending" if i % 50 == 0 else "draining" if i % 97 == 0 else "ready"
        liveness = "unreachable" if i % 40 == 1 else "stale" if i % 33 == 2 else "alive"
        node = Node(
            pool=pool, hostname=f"bench-{i}", lifecycle=lifecycle, liveness=liveness, ready=i % 60 != 3,
            health="degraded" if i % 25 == 4 else "healthy", last_heartbeat_at=now, incarnation=1 + i % 3,
            restart_count=i % 3, clock_skew_seconds=45.0 if i % 500 == 5 else 0.1,
            labels={"zone": f"z{i % 3}"}, verified={"features": {"arch": "amd64" if i % 4 else "arm64"}},
            declared={"resources": {"cpu": 32000, "memory": 128 * GiB}},
            measured={"resources": {"cpu": 16000 if i % 300 == 7 else 31000, "memory": 120 * GiB}},
            usage={"cpu": 4000 + (i % 8) * 1000, "memory": (8 + i % 32) * GiB},
        )  # fmt: skip
        nodes.append(node)
        resources += [
            NodeResource(node=node, name="cpu", capacity=32000, allocatable=31000, allocated=(i % 8) * 3000),
            NodeResource(node=node, name="memory", capacity=128 * GiB, allocatable=120 * GiB, allocated=(i % 5) * GiB),
        ]
        if i % 4 == 0:
            resources.append(NodeResource(node=node, name="nvidia.com/gpu", capacity=8, allocatable=8, allocated=i % 8))
        credentials.append(
            NodeCredential(
                node=node,
                prefix=f"b{i:09d}",
                secret_hash="x" * 64,
                issuer="bench",
                issued_at=now,
                expires_at=now + timedelta(days=1),
            )  # fmt: skip
        )
    Node.objects.bulk_create(nodes, batch_size=2000)
    NodeResource.objects.bulk_create(resources, batch_size=5000)
    NodeCredential.objects.bulk_create(credentials, batch_size=5000)
    events = [
        NodeEvent(node=nodes[i % count], pool_id=nodes[i % count].pool_id, type="liveness", actor_type="system",
                  actor_name="bench", from_state="alive", to_state="stale")
        for i in range(count * 2)
    ]  # fmt: skip
    NodeEvent.objects.bulk_create(events, batch_size=5000)
    LeaseRequest.objects.bulk_create(
        [LeaseRequest(workload_id=f"queued-{i}", pool=pools[i % len(pools)], spec={}) for i in range(40)]
    )
    User.objects.filter(username="bench-operator").delete()
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")


def timed(function, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        out.append((time.perf_counter() - started) * 1000)
    return out


def sql(statement: str):
    from django.db import connection

    def run():
        with connection.cursor() as cursor:
            cursor.execute(statement)
            cursor.fetchall()

    return run


def scrape_bench(database_url: str, scrapes: int) -> dict:
    extra = {"NODEPOOL_METRICS_TOKEN": TOKEN, "NODEPOOL_METRICS_CACHE_SECONDS": "0"}
    with Gunicorn(database_url, workers=1, extra_env=extra) as server:
        request = urllib.request.Request(server.base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})

        def scrape():
            with urllib.request.urlopen(request, timeout=30) as response:
                body = response.read()
                assert response.status == 200 and b"nodepool_nodes{" in body

        for _ in range(3):
            scrape()  # warm the worker (imports, connection, compiled queries)
        scrape_ms = timed(scrape, scrapes)
    baseline_ms = timed(sql("SELECT count(*) FROM fleet_node"), max(scrapes, 50))
    return {
        "scrape_p50_ms": round(percentile(scrape_ms, 50), 2),
        "scrape_p99_ms": round(percentile(scrape_ms, 99), 2),
        "scrape_max_ms": round(max(scrape_ms), 2),
        "baseline_count_p50_ms": round(percentile(baseline_ms, 50), 3),
        "baseline_count_p99_ms": round(percentile(baseline_ms, 99), 3),
        "scrape_goal_ms": 200,
        "scrape_goal_met": percentile(scrape_ms, 99) <= 200,
    }


def overview_bench(renders: int) -> dict:
    from django.contrib.auth.models import User
    from django.test import Client

    operator = User.objects.create_superuser("bench-operator", password=secrets.token_hex(8))
    client = Client()
    client.force_login(operator)

    def render():
        response = client.get("/admin/fleet-overview/")
        assert response.status_code == 200 and b"Pool batch" in response.content

    render()
    render_ms = timed(render, renders)
    baseline_ms = timed(sql("SELECT pool_id, count(*) FROM fleet_node GROUP BY pool_id"), max(renders, 50))
    median, base = statistics.median(render_ms), statistics.median(baseline_ms)
    return {
        "overview_p50_ms": round(median, 2),
        "overview_p99_ms": round(percentile(render_ms, 99), 2),
        "baseline_group_by_p50_ms": round(base, 3),
        "overview_vs_baseline": round(median / base, 1) if base else None,
        "overview_goal_ratio": 4,
        "overview_goal_met": bool(base) and median / base <= 4,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--renders", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="CI mode: 400 nodes, 20 scrapes, 10 renders")
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DATABASE_URL))
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.scrapes, args.renders = 400, 20, 10
    prepare_database(args.database_url)
    django_setup(args.database_url)
    started = time.perf_counter()
    seed(args.nodes)
    seeded_s = time.perf_counter() - started
    figures = {"bench": "observability", "nodes": args.nodes, "seed_seconds": round(seeded_s, 1)}
    from fleet.fleet_state import refresh as refresh_fleet_state
    from leases.preview import refresh_request_class_fits

    refresh_fleet_state()  # warm (its first run pays for cold caches)
    refresh_ms = timed(refresh_fleet_state, 3)  # the 15 s beat task behind node counts, capacity, drift
    figures["refresh_fleet_state_ms"] = round(statistics.median(refresh_ms), 1)
    refresh_ms = timed(refresh_request_class_fits, 3)  # the 30 s beat task behind "can serve N now"
    figures["refresh_request_class_fits_ms"] = round(statistics.median(refresh_ms), 1)
    figures.update(scrape_bench(args.database_url, args.scrapes))
    figures.update(overview_bench(args.renders))
    print(
        f"/metrics at {args.nodes} nodes: p50 {figures['scrape_p50_ms']} ms, p99 {figures['scrape_p99_ms']} ms "
        f"(goal <= 200 ms) | baseline SELECT count(*): p50 {figures['baseline_count_p50_ms']} ms"
    )
    print(
        f"fleet overview: p50 {figures['overview_p50_ms']} ms = {figures['overview_vs_baseline']}x the baseline "
        f"GROUP BY pool ({figures['baseline_group_by_p50_ms']} ms; goal <= 4x)"
    )
    emit(figures)


if __name__ == "__main__":
    main()
