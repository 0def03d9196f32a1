"""Placement benchmark: latency at 1k/10k/100k schedulable nodes, grants per second over HTTP
next to the raw SQL transaction of the same shape, and a double-allocation audit.

Usage (PostgreSQL; the database is created if missing and its tables are emptied):

    .venv/bin/python bench/placement.py [--sizes 1000,10000,100000] [--requests 300]
        [--http-seconds 10] [--clients 8] [--database postgres://postgres@127.0.0.1:5432/np_leases_bench]

Prints a table per part and ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

GiB = 2**30
ZONES = ("a", "b", "c")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--requests", type=int, default=300, help="placements timed per fleet size")
    parser.add_argument("--http-seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16, help="concurrent HTTP connections / pgbench clients")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers (sync)")
    parser.add_argument("--http-fleet", type=int, default=10000, help="fleet size for the HTTP and SQL runs")
    parser.add_argument(
        "--database", default=os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/np_leases_bench")
    )
    return parser.parse_args()


def ensure_database(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    admin = url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def setup_django(url: str) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nodepool.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def build_fleet(size: int):
    """Empty the fleet and lease tables, then bulk-insert ``size`` schedulable nodes (3 zones,
    racks of 40, 10 % tainted, random existing load) with credentials and capacity."""
    from django.contrib.auth.models import User
    from django.db import connection
    from django.utils import timezone

    from fleet.choices import Health, Lifecycle, Liveness
    from fleet.models import Node, NodeCredential, NodeResource, Pool

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE leases_lease, leases_leaserequest, leases_fencingsequence, fleet_nodeevent, "
            "fleet_nodecredential, fleet_noderesource, fleet_node, fleet_pool CASCADE"
        )
    pool = Pool.objects.create(name="bench", scheduling_policy="binpack")
    now = timezone.now()
    rng = random.Random(size)
    nodes = []
    for i in range(size):
        tainted = i % 10 == 0
        nodes.append(
            Node(
                id=uuid.UUID(int=rng.getrandbits(128)),
                pool=pool,
                hostname=f"n{i}.bench",
                labels={"topology.kubernetes.io/zone": ZONES[i % 3], "rack": f"r{i // 40}", "gen": str(3 + i % 3)},
                taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}] if tainted else [],
                verified={"features": {"arch": "amd64" if i % 4 else "arm64", "os": "linux"}},
                lifecycle=Lifecycle.READY,
                liveness=Liveness.ALIVE,
                ready=True,
                health=Health.HEALTHY,
                last_heartbeat_at=now,
            )
        )
    Node.objects.bulk_create(nodes, batch_size=5000)
    creds, resources = [], []
    for i, node in enumerate(nodes):
        creds.append(
            NodeCredential(
                node=node,
                prefix=f"b{i:012d}",
                secret_hash="x" * 64,
                issuer="bench",
                issued_at=now,
                expires_at=now + timedelta(days=1),
            )  # fmt: skip
        )
        # Existing load as reservations (allocatable below capacity), so that allocated stays
        # exactly the sum of live leases and the audit can demand zero drift.
        used = rng.choice((0, 2000, 4000, 6000, 7000))
        resources.append(NodeResource(node=node, name="cpu", capacity=8000, reserved=used, allocatable=8000 - used))
        mem_used = used * 4 * 2**20
        resources.append(
            NodeResource(
                node=node, name="memory", capacity=32 * GiB, reserved=mem_used, allocatable=32 * GiB - mem_used
            )
        )
    NodeCredential.objects.bulk_create(creds, batch_size=5000)
    NodeResource.objects.bulk_create(resources, batch_size=5000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    user, _ = User.objects.get_or_create(username="bench-client", defaults={"is_superuser": True})
    return pool, user


def requests_mix(count: int) -> list[dict]:
    rng = random.Random(7)
    bodies = []
    for i in range(count):
        body = {
            "workload_id": f"w{i}",
            "pool": "bench",
            "resources": {"cpu": rng.choice(("500m", "1", "2")), "memory": "1Gi"},
        }
        kind = i % 5
        if kind == 1:
            body["node_selector"] = {"topology.kubernetes.io/zone": rng.choice(ZONES)}
        elif kind == 2:
            body["affinity"] = {
                "required": [{"key": "arch", "operator": "In", "values": ["amd64"]}],
                "preferred": [{"weight": 10, "term": {"key": "gen", "operator": "Gt", "values": ["3"]}}],
            }
        elif kind == 3:
            body["spread"] = {"group": f"g{i % 7}", "topology_key": "zone"}
            body["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
        elif kind == 4:
            body["spread"] = {"group": f"h{i % 11}", "topology_key": "host", "mode": "anti-affinity"}
        bodies.append(body)
    return bodies


def pct(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def time_placement(pool, user, count: int) -> dict:
    """Time the scheduler alone (filter + score, no write) and the whole grant (place + reserve)."""
    from fleet.events import Actor
    from leases import placement
    from leases.services import lease_create, resolve_shape
    from leases.spec import parse_spec

    bodies = requests_mix(count)
    place_ms, grant_ms = [], []
    for body in bodies[:50]:  # warm caches and connections
        placement.find_candidates(pool, resolve_shape(parse_spec(body))[0])
    for body in bodies:
        spec = resolve_shape(parse_spec(body))[0]
        start = time.perf_counter()
        candidates, _ = placement.find_candidates(pool, spec)
        place_ms.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        try:
            lease_create(data=body, client=user, actor=Actor.system("bench"))
        except Exception as exc:  # an anti-affinity group can run out of hosts: still a timed answer
            if getattr(exc, "status_code", None) != 409:
                raise
        grant_ms.append((time.perf_counter() - start) * 1000)
    return {
        "place_p50_ms": round(statistics.median(place_ms), 2),
        "place_p99_ms": round(pct(place_ms, 0.99), 2),
        "grant_p50_ms": round(statistics.median(grant_ms), 2),
        "grant_p99_ms": round(pct(grant_ms, 0.99), 2),
    }


def audit() -> dict:
    """Zero double allocations: no node above allocatable, counters equal live leases, one live lease per workload."""
    from django.db import connection

    from leases.sweeps import check_consistency

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM fleet_noderesource WHERE allocated > allocatable")
        over = cursor.fetchone()[0]
        cursor.execute(
            "SELECT count(*) FROM (SELECT workload_id FROM leases_lease WHERE state IN ('granted','active') "
            "GROUP BY workload_id HAVING count(*) > 1) t"
        )
        doubled = cursor.fetchone()[0]
    drift = len(check_consistency().drift)
    return {"oversubscribed_resources": over, "workloads_with_two_live_leases": doubled, "drift": drift}


LEASE_LUA = r"""
local n = 0
local token = os.getenv("BENCH_TOKEN")
request = function()
  n = n + 1
  local body = string.format(
    '{"workload_id": "http-%s-%d-%d", "pool": "bench", "resources": {"cpu": "100m", "memory": "64Mi"}}',
    os.getenv("BENCH_RUN"), tid or 0, n)
  return wrk.format("POST", "/api/v1/node-leases",
    {["Content-Type"] = "application/json", ["Authorization"] = "Token " .. token}, body)
end
response = function(status, headers, body)
  counters[tostring(status)] = (counters[tostring(status)] or 0) + 1
end
"""


def http_grants(args, user) -> dict:
    """Grants per second through gunicorn (2 workers) and the API, driven by wrk (bench/common.py)."""
    from common import WRK_LUA_LIB, Gunicorn, wrk
    from rest_framework.authtoken.models import Token

    token, _ = Token.objects.get_or_create(user=user)
    with Gunicorn(args.database, workers=args.workers, extra_env={"THROTTLE_USER": "10000000/min"}) as server:
        result = wrk(
            server.base, LEASE_LUA + WRK_LUA_LIB, duration=args.http_seconds, connections=args.clients,
            env={"BENCH_TOKEN": token.key, "BENCH_RUN": uuid.uuid4().hex[:8]},
        )  # fmt: skip
    granted = result["counters"].get("201", 0)
    return {
        "http_grants_per_s": round(granted / result["seconds"], 1),
        "http_p50_ms": result["p50_ms"],
        "http_p99_ms": result["p99_ms"],
        "http_status_counts": result["counters"],
    }


PGBENCH_SCRIPT = """\\set r :base + 2 * random(0, :n - 1)
WITH u AS (UPDATE fleet_noderesource SET allocated = allocated + 10
           WHERE id = :r AND allocated + 10 <= allocatable RETURNING node_id)
INSERT INTO leases_lease (id, workload_id, fencing_token, node_id, node_incarnation, pool_id, state, workload_state,
  resources, "group", priority, command, spec, decision, ttl_seconds, expires_at, granted_at, end_reason, outcome,
  missed_reports, idempotency_key, request_hash, version)
SELECT gen_random_uuid(), 'sql-' || gen_random_uuid(), 1, node_id, 1, :pool, 'granted', '', '{"cpu": 10}', '', 0,
  '[]', '{}', '{}', 600, now() + interval '10 minutes', now(), '', '', 0, '', '', 1 FROM u;
"""


def sql_baseline(args, pool) -> dict:
    """pgbench running the raw transaction of the same shape: conditional UPDATE of the node's
    capacity + INSERT of the lease row (one statement, one transaction), same clients, same run."""
    import tempfile

    from fleet.models import NodeResource

    cpu_ids = list(NodeResource.objects.filter(name="cpu").order_by("id").values_list("id", flat=True))
    assert cpu_ids[-1] - cpu_ids[0] == 2 * (len(cpu_ids) - 1), "cpu rows are not interleaved with memory rows"
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as handle:
        handle.write(PGBENCH_SCRIPT)
        script = handle.name
    try:
        output = subprocess.run(
            ["pgbench", "-n", "-c", str(args.clients), "-j", "2", "-T", str(max(1, round(args.http_seconds))),
             "-D", f"base={cpu_ids[0]}", "-D", f"n={len(cpu_ids)}", "-D", f"pool={pool.pk}", "-f", script,
             args.database.replace("postgres://", "postgresql://", 1)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    finally:
        os.unlink(script)
    tps = next(line for line in output.stdout.splitlines() if line.startswith("tps"))
    return {"sql_grants_per_s": round(float(tps.split("=")[1].split()[0]), 1)}


def main() -> None:
    args = parse_args()
    ensure_database(args.database)
    setup_django(args.database)
    figures: dict = {"sizes": {}}
    for size in [int(s) for s in args.sizes.split(",") if s]:
        started = time.perf_counter()
        pool, user = build_fleet(size)
        built = time.perf_counter() - started
        result = time_placement(pool, user, args.requests)
        result["audit"] = audit()
        figures["sizes"][str(size)] = result
        print(f"{size:>7} nodes (built in {built:.1f}s): place p50 {result['place_p50_ms']} ms, "
              f"p99 {result['place_p99_ms']} ms; grant p50 {result['grant_p50_ms']} ms, "
              f"p99 {result['grant_p99_ms']} ms; audit {result['audit']}", flush=True)  # fmt: skip
    if args.http_seconds <= 0:
        print(json.dumps(figures, sort_keys=True))
        return
    pool, user = build_fleet(args.http_fleet)
    figures["http_fleet"] = args.http_fleet
    figures["clients"] = args.clients
    figures["gunicorn_workers"] = args.workers
    figures.update(sql_baseline(args, pool))
    print(f"raw SQL (UPDATE capacity + INSERT lease), {args.clients} connections: {figures['sql_grants_per_s']}/s")
    pool, user = build_fleet(args.http_fleet)
    figures.update(http_grants(args, user))
    print(f"HTTP POST /node-leases (wrk, {args.clients} connections, gunicorn {args.workers} workers): "
          f"{figures['http_grants_per_s']} grants/s, p50 {figures['http_p50_ms']} ms, p99 {figures['http_p99_ms']} ms, "
          f"statuses {figures['http_status_counts']}")  # fmt: skip
    figures["http_vs_sql"] = round(figures["http_grants_per_s"] / figures["sql_grants_per_s"], 3)
    figures["audit"] = audit()
    figures["double_allocations"] = (
        figures["audit"]["oversubscribed_resources"] + figures["audit"]["workloads_with_two_live_leases"]
        + sum(r["audit"]["oversubscribed_resources"] + r["audit"]["workloads_with_two_live_leases"]
              for r in figures["sizes"].values())
    )  # fmt: skip
    print(f"audit after HTTP run: {figures['audit']}")
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
