"""Renewals and status reports through the real HTTP stack, next to a one-UPDATE baseline on the same server.

    .venv/bin/python bench/heartbeats.py [--nodes 20000] [--duration 10] [--connections 16] [--rounds 2]
    .venv/bin/python bench/heartbeats.py --quick      # CI: seconds, small fleet, no flood phase

Seeds ``--nodes`` enrolled, ready nodes with credentials in PostgreSQL (a dedicated database,
default ``np_heartbeats_bench``), starts gunicorn (2 sync workers) and drives it with wrk, each
request from the next node with that node's credential and a rising sequence, so every message
is applied:

* ``renewal``: ``POST /nodes/{id}/renewals`` ``{"incarnation", "sequence"}`` (one statement);
* ``status_report``: a realistic heartbeat (5 conditions, usage, 2 leases, ~700 bytes);
* ``baseline``: ``POST /bench/one-update/<id>`` with the heartbeat's body, a bare Django view
  doing one UPDATE.

Rounds alternate the three so that drift hits them alike; both ratios are to the same baseline,
measured with the hot-path counter ``nodepool_heartbeats_total`` in. Goal: renewal ≥ 0.8.

Then the flood phase (skipped with ``--quick``): the other nodes renew as agents do (each every
10 s, paced, together half the renewal rate just measured), first alone, then while one
credential sends renewals with 50 requests in flight; the liveness sweep runs every 2 s in this
process throughout. Reported: the other nodes' renewal p99 flooded vs unflooded (goal ≤ 2×), the
flooder's applied/429 counts, and liveness transitions of the other nodes (must be 0). The phase
runs twice: straight to gunicorn, and through the production shape's proxy (nginx with the
shipped deploy/nginx/nodepool.conf.template, whose per-credential bucket holds the flooder's
requests; ``apt-get install -y nginx``, ``--no-proxy`` skips it).

The pool's interval is 15 s, so the flood guard (half the interval) lets each node through every
7.5 s: with 20,000 nodes round-robin that holds up to ~2,600 requests/s. ``--quick`` uses 2,000
nodes and sets ``NODEPOOL_MIN_SPACING_FRACTION=0.01`` on the server so wrk may cycle them faster
(the guard is still evaluated in every statement). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    DEFAULT_DATABASE_URL,
    WRK_LUA_LIB,
    Gunicorn,
    Nginx,
    django_setup,
    emit,
    prepare_database,
    wrk,
)

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
local RENEWAL = '{"incarnation":1,"sequence":%d}'
-- BENCH_PACE_MS: each connection waits that long before its next request, so that a set of nodes
-- renews at a set rate, as agents do (open loop), instead of as fast as the server answers.
local pace = tonumber(os.getenv("BENCH_PACE_MS") or "0")
if pace > 0 then
  function delay() return pace end
end
function init(args)
  local i = 0
  for line in io.lines(os.getenv("BENCH_NODES")) do
    local id, secret = line:match("(%S+) (%S+)")
    if mode == "flood" then
      if i == 0 then table.insert(mine, {id = id, secret = secret, seq = base}) end
    elseif i % nthreads == tid then table.insert(mine, {id = id, secret = secret, seq = base}) end
    i = i + 1
  end
  -- BENCH_START: where the previous run of the same nodes stopped, so that consecutive paced runs
  -- go on with the same rotation (each node renewed once per turn) instead of starting over.
  idx = math.floor(tonumber(os.getenv("BENCH_START") or "0") / nthreads) % math.max(#mine, 1)
end
function request()
  if verification_call() then return wrk.format("GET", "/") end
  idx = idx % #mine + 1
  local n = mine[idx]
  n.seq = n.seq + 1
  if mode == "renewal" or mode == "flood" then
    return wrk.format("POST", "/api/v1/nodes/" .. n.id .. "/renewals",
      {["Content-Type"] = "application/json", ["Authorization"] = "Node " .. n.secret},
      string.format(RENEWAL, n.seq))
  end
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


def seed(count: int, interval: int = 15) -> list[tuple[str, str]]:
    """``count`` ready, alive nodes with one credential each; returns ``[(node id, secret)]``."""
    from django.db import connection
    from django.utils import timezone

    from fleet import secrets
    from fleet.models import Node, NodeCredential, NodeResource, Pool

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE fleet_node, fleet_pool, fleet_livenesssweepstate, fleet_controlplaneclock CASCADE")
    pool = Pool.objects.create(name="bench", heartbeat_interval=interval, heartbeat_grace=3 * interval,
                               loss_threshold=300)  # fmt: skip
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
    # An inventory that holds the usage the status reports claim: usage of a resource a node does
    # not have is impossible usage, and quarantines it (maintenance.rules).
    inventory = {"cpu": 32000, "memory": 128 * 2**30, "ephemeral-storage": 200 * 2**30}
    NodeResource.objects.bulk_create(
        [
            NodeResource(node=node, name=name, capacity=amount, allocatable=amount)
            for node in nodes
            for name, amount in inventory.items()
        ],
        batch_size=5000,
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return pairs


MODES = ("baseline", "renewal", "status_report")
# The flood phase's other nodes: each renews every OTHERS_PERIOD seconds, and together they offer
# OTHERS_SHARE of the renewal rate the rounds measured (a fleet sized with headroom, as the
# sizing rule in docs/heartbeats.md asks).
OTHERS_PERIOD = 10
OTHERS_SHARE = 0.5


def flood_phase(nodes_file: str, others_file: str, args, run, *, pace_ms: float, cursor: list[int]) -> dict:
    """The unflooded reference run, then the same while one credential floods with 50 in flight.

    The liveness sweep runs every 2 s in this process during both, so the two runs differ by the
    flood alone. ``run`` sends to one server (gunicorn, or nginx in front of it). ``cursor[0]`` is
    where the other nodes' rotation goes on from (updated): every phase renews them in turn.
    """
    from django.db import close_old_connections
    from django.utils import timezone

    from fleet.liveness_sweep import sweep_liveness
    from fleet.models import NodeEvent

    with open(nodes_file) as handle:
        flooder = handle.readline().split()[0]
    with open(others_file) as handle:
        other_ids = [line.split()[0] for line in handle]
    phase_start = timezone.now()
    stop = threading.Event()
    sweeps: list[dict] = []

    def sweeper():
        while not stop.wait(2.0):
            sweeps.append(sweep_liveness())
        close_old_connections()

    results: dict = {}

    def flood():
        results["flood"] = run("flood", args.duration, nodes=nodes_file, connections=50, threads=1)

    def others(key: str) -> None:
        results[key] = run("renewal", args.duration, nodes=others_file, pace_ms=pace_ms, start=cursor[0])
        cursor[0] += results[key]["requests"]

    sweeping = threading.Thread(target=sweeper)
    sweeping.start()
    try:
        others("unflooded")
        flooding = threading.Thread(target=flood)
        flooding.start()
        others("others")
        flooding.join()
    finally:
        stop.set()
        sweeping.join()
    changed = NodeEvent.objects.filter(type="liveness", created_at__gte=phase_start, node_id__in=other_ids).count()
    return {
        "unflooded_renewal_p99_ms": results["unflooded"]["p99_ms"],
        "flooded_renewal_p99_ms": results["others"]["p99_ms"],
        "flooded_p99_ratio": round(results["others"]["p99_ms"] / max(results["unflooded"]["p99_ms"], 0.001), 2),
        "others_per_second": results["others"]["rps"],
        "flooder_requests": results["flood"]["requests"],
        "flooder_counters": results["flood"]["counters"],
        "other_nodes_liveness_changes": changed,
        "other_nodes": len(other_ids),
        "flooder": flooder,
        "sweeps": len(sweeps),
    }


def park_bystanders(*, flooder: str, others: list[str]) -> None:
    """Take the sweep's work on nodes outside the flood phase out of it: the seeded nodes that
    renewed only in the rounds would otherwise all go stale and unreachable during the phase, in
    sweeps of hundreds of transitions that land in whichever run is then measuring (their next
    liveness check is moved an hour on). Status reports are not sent in the phase, so no node's
    report falls due in it either."""
    from django.utils import timezone

    from fleet.models import Node

    later = timezone.now() + timedelta(hours=1)
    Node.objects.exclude(pk__in=[flooder, *others]).update(next_liveness_check_at=later)
    Node.objects.update(status_report_due_at=later)


def print_flood(where: str, flood: dict) -> None:
    print(f"{where}: others' renewal p99 {flood['unflooded_renewal_p99_ms']:6.2f} ms unflooded, "
          f"{flood['flooded_renewal_p99_ms']:6.2f} ms flooded (ratio {flood['flooded_p99_ratio']}); flooder "
          f"{flood['flooder_counters']}; other nodes' liveness changes {flood['other_nodes_liveness_changes']}",
          flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DATABASE_URL))
    parser.add_argument("--nodes", type=int, default=20_000)
    parser.add_argument("--duration", type=float, default=10)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="CI: 2,000 nodes, 2 s runs, one round, no flood")
    parser.add_argument(
        "--no-flood",
        dest="flood",
        action="store_false",
        help="renewal, status-report and baseline rounds only (A/B runs of the hot path)",
    )
    parser.add_argument("--no-proxy", dest="proxy", action="store_false",
                        help="flood only straight to gunicorn, not also through nginx (deploy/nginx)")  # fmt: skip
    args = parser.parse_args()
    extra_env = {}
    if args.quick:
        args.nodes, args.duration, args.rounds = min(args.nodes, 2000), 2, 1
        extra_env["NODEPOOL_MIN_SPACING_FRACTION"] = "0.01"

    prepare_database(args.database_url)
    django_setup(args.database_url)
    started = time.monotonic()
    pairs = seed(args.nodes)
    print(f"seeded {len(pairs)} nodes in {time.monotonic() - started:.1f}s", flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".nodes", delete=False) as handle:
        handle.writelines(f"{node_id} {secret}\n" for node_id, secret in pairs)
        nodes_file = handle.name
    others_file = ""

    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    floods: dict[str, dict] = {}
    try:
        with Gunicorn(args.database_url, workers=args.workers, extra_env=extra_env) as server:
            print(f"gunicorn ({args.workers} workers) at {server.base}; wrk -t{args.threads} -c{args.connections}")

            def run(mode: str, duration: float, *, nodes=nodes_file, connections=None, threads=None,
                    pace_ms: float = 0, base: str = server.base, start: int = 0) -> dict:  # fmt: skip
                threads = threads or args.threads
                env = {"BENCH_NODES": nodes, "BENCH_MODE": mode, "BENCH_THREADS": str(threads),
                       "BENCH_SEQ_BASE": str(int(time.time() * 1000)), "BENCH_PACE_MS": str(int(pace_ms)),
                       "BENCH_START": str(start)}  # fmt: skip
                return wrk(base, LUA, duration=duration, connections=connections or args.connections,
                           threads=threads, env=env)  # fmt: skip

            for mode in MODES:  # warm-up: connections, caches, the fleet-size count, each node's pool
                run(mode, 2)
            for round_ in range(args.rounds):
                for mode in MODES:
                    result = run(mode, args.duration)
                    results[mode].append(result)
                    print(f"round {round_ + 1} {mode:13s} {result['rps']:8.1f} req/s  p50 {result['p50_ms']:6.2f} ms  "
                          f"p99 {result['p99_ms']:6.2f} ms  {result['counters']}", flush=True)  # fmt: skip
            if not args.quick and args.flood:
                # The other nodes renew as agents do: each every OTHERS_PERIOD s (between the flood
                # guard, 7.5 s, and the stale deadline, 30 s), paced, as many of them as make half
                # the renewal rate just measured. The unflooded reference run is the same load.
                rate = sum(r["rps"] for r in results["renewal"]) / len(results["renewal"])
                offered = max(10.0, rate * OTHERS_SHARE)
                others = pairs[1 : 1 + min(len(pairs) - 1, int(offered * OTHERS_PERIOD))]
                pace_ms = 1000 * args.connections / offered
                with tempfile.NamedTemporaryFile("w", suffix=".nodes", delete=False) as handle:
                    handle.writelines(f"{node_id} {secret}\n" for node_id, secret in others)
                    others_file = handle.name
                park_bystanders(flooder=pairs[0][0], others=[node_id for node_id, _ in others])
                print(f"flood: {len(others)} other nodes renew, {offered:.0f}/s offered", flush=True)
                cursor = [0]
                floods["gunicorn"] = flood_phase(nodes_file, others_file, args, run, pace_ms=pace_ms, cursor=cursor)
                print_flood("straight to gunicorn", floods["gunicorn"])
                if args.proxy:
                    # The production shape (docker-compose.yml): the shipped nginx configuration in
                    # front, whose per-credential bucket keeps the flooder's requests waiting there.
                    # Every virtual node sends from 127.0.0.1, as if the whole fleet sat behind
                    # one NAT: the per-address node rate is sized for that, as the docs say to.
                    with Nginx(f"127.0.0.1:{server.port}", node_rate_per_address="100000r/s") as proxy:
                        through = functools.partial(run, base=proxy.base)
                        floods["nginx"] = flood_phase(nodes_file, others_file, args, through, pace_ms=pace_ms,
                                                      cursor=cursor)  # fmt: skip
                    print_flood("through nginx (deploy/nginx)", floods["nginx"])
    finally:
        os.unlink(nodes_file)
        if others_file:
            os.unlink(others_file)

    def mean(mode, key):
        return round(sum(r[key] for r in results[mode]) / len(results[mode]), 3)

    def not_applied(mode):
        return sum(
            sum(v for k, v in r["counters"].items() if k not in ("applied", "ok")) + r["socket_errors"]
            for r in results[mode]
        )

    figures = {
        "bench": "heartbeats",
        "quick": args.quick,
        "nodes": args.nodes,
        "database": "postgresql",
        "server": f"gunicorn {args.workers} sync workers",
        "load": f"wrk -t{args.threads} -c{args.connections} {args.duration}s x {args.rounds}",
        "baseline_per_second": mean("baseline", "rps"),
        "baseline_p50_ms": mean("baseline", "p50_ms"),
        "baseline_p99_ms": mean("baseline", "p99_ms"),
        "renewals_per_second": mean("renewal", "rps"),
        "renewal_p50_ms": mean("renewal", "p50_ms"),
        "renewal_p99_ms": mean("renewal", "p99_ms"),
        "status_reports_per_second": mean("status_report", "rps"),
        "status_report_p50_ms": mean("status_report", "p50_ms"),
        "status_report_p99_ms": mean("status_report", "p99_ms"),
        "renewals_not_applied_or_errors": not_applied("renewal"),
        "status_reports_not_applied_or_errors": not_applied("status_report"),
    }
    figures["renewal_ratio"] = round(figures["renewals_per_second"] / figures["baseline_per_second"], 3)
    figures["status_report_ratio"] = round(figures["status_reports_per_second"] / figures["baseline_per_second"], 3)
    figures["goal_renewal_ratio"] = 0.8
    if floods:
        figures["goal_flooded_p99_ratio"] = 2.0
        figures["flood"] = floods
    print(
        f"\nrenewals {figures['renewals_per_second']:.0f}/s (p99 {figures['renewal_p99_ms']} ms), status reports "
        f"{figures['status_reports_per_second']:.0f}/s (p99 {figures['status_report_p99_ms']} ms) vs baseline "
        f"{figures['baseline_per_second']:.0f}/s (p99 {figures['baseline_p99_ms']} ms): renewal ratio "
        f"{figures['renewal_ratio']}, status report ratio {figures['status_report_ratio']}"
    )
    emit(figures)


if __name__ == "__main__":
    main()
