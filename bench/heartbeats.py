"""Heartbeat throughput through the real HTTP stack, next to a one-UPDATE baseline on the same server.

    .venv/bin/python bench/heartbeats.py [--nodes 10000] [--duration 10] [--connections 16] [--rounds 2]

Seeds ``--nodes`` enrolled, ready nodes with credentials in PostgreSQL (a dedicated database,
default ``np_heartbeats_bench``), starts gunicorn (2 sync workers) and drives it with wrk: each
request is a realistic heartbeat (5 conditions, usage, 2 leases, ~700 bytes) from the next node,
with that node's credential and a rising sequence, so every heartbeat is applied. The baseline is
``POST /bench/one-update/<id>`` with the same body: a bare Django view doing one UPDATE. Rounds
alternate baseline and heartbeats so that drift hits both alike. Goal: heartbeats ≥ 0.7 × baseline.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEFAULT_DATABASE_URL, WRK_LUA_LIB, Gunicorn, django_setup, emit, prepare_database, wrk

# What a healthy node reports every time; the seeded nodes already hold it, so each benchmarked
# heartbeat is the steady-state one (applied, nothing but counters changed, no events).
CONDITIONS = [
    {"type": "Ready", "status": "True", "reason": "AgentReady", "message": "agent is posting ready status"},
    {"type": "MemoryPressure", "status": "False", "reason": "SufficientMemory", "message": ""},
    {"type": "DiskPressure", "status": "False", "reason": "NoDiskPressure", "message": ""},
    {"type": "PIDPressure", "status": "False", "reason": "SufficientPID", "message": ""},
    {"type": "NetworkUnavailable", "status": "False", "reason": "RouteCreated", "message": ""},
]

LUA = (
    r"""
local nodes, mine, idx = {}, {}, 0
local base = tonumber(os.getenv("BENCH_SEQ_BASE"))
local mode = os.getenv("BENCH_MODE")
local nthreads = tonumber(os.getenv("BENCH_THREADS"))
local BODY = '{"incarnation": 1, "sequence": %d, "observed_at": "%s", "agent_version": "1.4.2", '
  .. '"ready": true, "ready_reason": "", "conditions": CONDITIONS, '
  .. '"usage": {"cpu": %d, "memory": 17179869184, "ephemeral-storage": 21474836480}, '
  .. '"leases": [{"lease_id": "6f1c2a7e-8a55-4a43-9d3e-0c1f2b3a4d5e", "fencing_token": 3, "state": "running"}, '
  .. '{"lease_id": "0b9d8c7e-6f5a-4b3c-8d2e-1f0a9b8c7d6e", "fencing_token": 12, "state": "running"}], '
  .. '"benchmark": null}'
function init(args)
  local i = 0
  for line in io.lines(os.getenv("BENCH_NODES")) do
    local id, secret = line:match("(%S+) (%S+)")
    if i % nthreads == tid then table.insert(mine, {id = id, secret = secret, seq = base}) end
    i = i + 1
  end
end
function request()
  idx = idx % #mine + 1
  local n = mine[idx]
  n.seq = n.seq + 1
  local body = string.format(BODY, n.seq, os.date("!%Y-%m-%dT%H:%M:%SZ"), 1000 + n.seq % 4000)
  if mode == "baseline" then
    return wrk.format("POST", "/bench/one-update/" .. n.id, {["Content-Type"] = "application/json"}, body)
  end
  return wrk.format("POST", "/api/v1/nodes/" .. n.id .. "/heartbeats",
    {["Content-Type"] = "application/json", ["Authorization"] = "Node " .. n.secret}, body)
end
function response(status, headers, body)
  local key = tostring(status)
  if status == 200 then
    if mode == "baseline" then key = "ok"
    elseif body:find('"applied":true', 1, true) then key = "applied" else key = "ok_not_applied" end
  end
  counters[key] = (counters[key] or 0) + 1
end
""".replace("CONDITIONS", json.dumps(CONDITIONS))
    + WRK_LUA_LIB
)


def seed(count: int) -> list[tuple[str, str]]:
    """``count`` ready, alive nodes with one credential each; returns ``[(node id, secret)]``."""
    from django.db import connection
    from django.utils import timezone

    from fleet import secrets
    from fleet.models import Node, NodeCredential, Pool

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE fleet_node, fleet_pool, fleet_livenesssweepstate CASCADE")
    pool = Pool.objects.create(name="bench", heartbeat_interval=10, heartbeat_grace=40, loss_threshold=300)
    now = timezone.now()
    nodes = [
        Node(
            pool=pool,
            hostname=f"bench-{i}",
            labels={"zone": f"z{i % 3}"},
            lifecycle="ready",
            liveness="alive",
            ready=True,
            health="healthy",
            agent_version="1.4.2",
            conditions=[{**c, "last_transition_time": now.isoformat()} for c in CONDITIONS],
            last_heartbeat_at=now,
            declared={"resources": {"cpu": 32000, "memory": 128 * 2**30}},
        )
        for i in range(count)
    ]
    Node.objects.bulk_create(nodes, batch_size=2000)
    pairs, credentials = [], []
    for node in nodes:
        secret, prefix, digest = secrets.new_secret("npn")
        credentials.append(
            NodeCredential(
                node=node,
                prefix=prefix,
                secret_hash=digest,
                issuer="bench",
                issued_at=now,
                expires_at=now + timedelta(days=1),
            )  # fmt: skip
        )
        pairs.append((str(node.pk), secret))
    NodeCredential.objects.bulk_create(credentials, batch_size=2000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DATABASE_URL))
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    prepare_database(args.database_url)
    django_setup(args.database_url)
    started = time.monotonic()
    pairs = seed(args.nodes)
    print(f"seeded {len(pairs)} nodes in {time.monotonic() - started:.1f}s", flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".nodes", delete=False) as handle:
        handle.writelines(f"{node_id} {secret}\n" for node_id, secret in pairs)
        nodes_file = handle.name

    results: dict[str, list[dict]] = {"baseline": [], "heartbeat": []}
    try:
        with Gunicorn(args.database_url, workers=args.workers) as server:
            print(f"gunicorn ({args.workers} workers) at {server.base}; wrk -t{args.threads} -c{args.connections}")

            def run(mode: str, duration: float) -> dict:
                env = {"BENCH_NODES": nodes_file, "BENCH_MODE": mode, "BENCH_THREADS": str(args.threads),
                       "BENCH_SEQ_BASE": str(int(time.time() * 1000))}  # fmt: skip
                return wrk(server.base, LUA, duration=duration, connections=args.connections,
                           threads=args.threads, env=env)  # fmt: skip

            run("baseline", 2)  # warm-up: connections, caches, the fleet-size count
            run("heartbeat", 2)
            for round_ in range(args.rounds):
                for mode in ("baseline", "heartbeat"):
                    result = run(mode, args.duration)
                    results[mode].append(result)
                    print(f"round {round_ + 1} {mode:9s} {result['rps']:8.1f} req/s  p50 {result['p50_ms']:6.2f} ms  "
                          f"p99 {result['p99_ms']:6.2f} ms  {result['counters']}", flush=True)  # fmt: skip
    finally:
        os.unlink(nodes_file)

    def mean(mode, key):
        return round(sum(r[key] for r in results[mode]) / len(results[mode]), 3)

    from fleet.models import Node

    figures = {
        "bench": "heartbeats",
        "nodes": args.nodes,
        "database": "postgresql",
        "server": f"gunicorn {args.workers} sync workers",
        "load": f"wrk -t{args.threads} -c{args.connections} {args.duration}s x {args.rounds}",
        "heartbeats_per_second": mean("heartbeat", "rps"),
        "heartbeat_p50_ms": mean("heartbeat", "p50_ms"),
        "heartbeat_p99_ms": mean("heartbeat", "p99_ms"),
        "baseline_per_second": mean("baseline", "rps"),
        "baseline_p50_ms": mean("baseline", "p50_ms"),
        "baseline_p99_ms": mean("baseline", "p99_ms"),
        "applied": sum(r["counters"].get("applied", 0) for r in results["heartbeat"]),
        "not_applied_or_errors": sum(
            sum(v for k, v in r["counters"].items() if k != "applied") + r["socket_errors"]
            for r in results["heartbeat"]
        ),
        "nodes_heard": Node.objects.filter(sequence__gte=0).count(),
    }
    figures["ratio_to_baseline"] = round(figures["heartbeats_per_second"] / figures["baseline_per_second"], 3)
    figures["goal_ratio"] = 0.7
    print(
        f"\nheartbeats {figures['heartbeats_per_second']:.0f}/s (p50 {figures['heartbeat_p50_ms']} ms, p99 "
        f"{figures['heartbeat_p99_ms']} ms) vs baseline {figures['baseline_per_second']:.0f}/s (p50 "
        f"{figures['baseline_p50_ms']} ms, p99 {figures['baseline_p99_ms']} ms): ratio {figures['ratio_to_baseline']}"
    )
    emit(figures)


if __name__ == "__main__":
    main()
