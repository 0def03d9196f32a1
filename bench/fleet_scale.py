"""Fleet scale: N virtual nodes renewing at the server's interval; detection time and false transitions.

    .venv/bin/python bench/fleet_scale.py [--nodes 20000] [--interval 20] [--grace 60] [--duration 180]
    .venv/bin/python bench/fleet_scale.py --sizes 5000,10000,20000      # the largest N held
    .venv/bin/python bench/fleet_scale.py --quick                        # CI: 500 nodes, 24 s

Seeds ``--nodes`` ready nodes with credentials in a pool of ``--interval`` / ``--grace`` seconds,
starts gunicorn with ``NODEPOOL_MAX_HEARTBEATS_PER_SECOND=--ceiling``, and drives it with wrk: a
LuaJIT script gives each node a random first phase, then schedules each node by its own answer
(the receipt plus that answer's ``next_renewal_in``; a 429's ``Retry-After``), matched to its
request by ``X-Request-ID``, from a min-heap of due times; wrk's ``delay()`` waits between
renewals, so the generator uses little CPU. **Restart**: at ``--restart-after`` (a third of the
run by default) the control plane has been away for one interval and every node renews at that
one instant; the largest one-second bucket of renewals sent over the two intervals after it is
reported against the mean there (and from one interval after it, where the server's slots
promise at most about twice the mean). Status reports are not
sent (the seeded nodes hold theirs; this measures liveness). At half time, 1 % of the nodes stop
renewing. The liveness sweep runs every 5 s in this process, as beat would run it.

Reported, per N: false transitions (liveness events of nodes that kept renewing: must be 0),
p50/p99 detection time (a stopped node's last renewal to its ``unreachable`` event), renewals/s
sustained (and how many were applied or refused), the generator's share of the machine's CPU,
and the largest N that held (0 false transitions, every stopped node detected). Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEFAULT_DATABASE_URL, WRK_LUA_LIB, Gunicorn, django_setup, emit, percentile, prepare_database

LUA = (
    r"""
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_usec; } timeval;
int gettimeofday(timeval *tv, void *tz);
]]
local tv = ffi.new("timeval")
local function now() ffi.C.gettimeofday(tv, nil); return tonumber(tv.tv_sec) + tonumber(tv.tv_usec) / 1e6 end

local mine, by_key = {}, {}
local interval = tonumber(os.getenv("BENCH_INTERVAL"))
local nthreads = tonumber(os.getenv("BENCH_THREADS"))
local start = tonumber(os.getenv("BENCH_T0"))
local stop_at = start + tonumber(os.getenv("BENCH_STOP_AFTER"))
local restart_at = start + tonumber(os.getenv("BENCH_RESTART_AFTER"))
local blackout_at = restart_at - interval
local blacked_out = false
local base = tonumber(os.getenv("BENCH_SEQ_BASE"))
-- A binary min-heap of the nodes waiting for their turn, by due time: each node is due at its
-- own time, the last answer's receipt plus its own next_renewal_in (nothing global).
local heap = {}
local function push(n)
  table.insert(heap, n)
  local i = #heap
  while i > 1 do
    local p = math.floor(i / 2)
    if heap[p].due <= heap[i].due then break end
    heap[p], heap[i] = heap[i], heap[p]
    i = p
  end
end
local function pop()
  local top = heap[1]
  if top == nil then return nil end
  local last = table.remove(heap)
  if #heap > 0 then
    heap[1] = last
    local i = 1
    while true do
      local l, r, m = 2 * i, 2 * i + 1, i
      if l <= #heap and heap[l].due < heap[m].due then m = l end
      if r <= #heap and heap[r].due < heap[m].due then m = r end
      if m == i then break end
      heap[m], heap[i] = heap[i], heap[m]
      i = m
    end
  end
  return top
end
function init(args)
  local i = 0
  math.randomseed(tid + 1)
  for line in io.lines(os.getenv("BENCH_NODES")) do
    local id, secret, stops = line:match("(%S+) (%S+) (%S+)")
    if i % nthreads == tid then
      -- the first renewal at a random phase (agents start at different times); later ones as told
      local n = {key = "n" .. i, id = id, secret = secret, seq = base, stops = stops == "1",
                 due = start + math.random() * interval}
      table.insert(mine, n)
      by_key[n.key] = n
      push(n)
    end
    i = i + 1
  end
end
local function blackout()
  -- The control plane goes away for one interval, then comes back at restart_at: every node that
  -- was waiting (all of them: their renewals failed meanwhile) renews at that one instant.
  blacked_out = true
  heap = {}
  for _, n in ipairs(mine) do
    if not n.inflight then n.due = restart_at; push(n) end
  end
end
local pending = nil
local function next_node()
  while true do
    local n = pop()
    if n == nil then return nil end
    if not (n.stops and n.due >= stop_at) then return n end  -- a stopped node leaves the heap
  end
end
function delay()
  if not blacked_out and now() >= blackout_at then blackout() end
  pending = pending or next_node()
  if pending == nil then return 1000 end
  local wait = (pending.due - now()) * 1000
  if wait < 0 then return 0 end
  return wait
end
function request()
  if verification_call() then return wrk.format("GET", "/") end
  local n = pending or next_node()
  pending = nil
  if n == nil then return wrk.format("GET", "/healthz") end
  n.seq = n.seq + 1
  n.inflight = true
  local second = math.floor(now())
  counters["at_" .. second] = (counters["at_" .. second] or 0) + 1
  return wrk.format("POST", "/api/v1/nodes/" .. n.id .. "/renewals",
    {["Content-Type"] = "application/json", ["Authorization"] = "Node " .. n.secret, ["X-Request-ID"] = n.key},
    string.format('{"incarnation":1,"sequence":%d}', n.seq))
end
function response(status, headers, body)
  local key = tostring(status)
  local n = by_key[headers["X-Request-ID"] or headers["x-request-id"] or ""]
  local wait = interval
  if status == 200 then
    local told = body:match('"next_renewal_in":([%d%.]+)')
    if told then wait = tonumber(told) end  -- this node's own delay, as the server prescribed it
    if body:find('"applied":true', 1, true) then key = "applied" else key = "not_applied" end
  elseif status == 429 then
    wait = tonumber(headers["Retry-After"] or headers["retry-after"] or "1") or 1
  end
  if n ~= nil then
    n.inflight = false
    n.due = now() + wait
    if n.due >= blackout_at and n.due < restart_at then n.due = restart_at end  -- away until then
    push(n)
  end
  counters[key] = (counters[key] or 0) + 1
end
"""
    + WRK_LUA_LIB
)


def seed(count: int, *, interval: int, grace: int, stop_fraction: float, rng: random.Random):
    """``count`` ready, alive nodes (deadline unset until their first renewal); ``[(id, secret, stops)]``."""
    from django.db import connection
    from django.utils import timezone

    from fleet import secrets
    from fleet.models import Node, NodeCredential, Pool

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE fleet_node, fleet_pool, fleet_livenesssweepstate, fleet_controlplaneclock CASCADE")
    pool = Pool.objects.create(
        name="scale", heartbeat_interval=interval, heartbeat_grace=grace, loss_threshold=max(300, grace),
        status_report_interval=3600,
    )  # fmt: skip
    now = timezone.now()
    nodes = [
        Node(pool=pool, hostname=f"scale-{i}", lifecycle="ready", liveness="alive", ready=True, health="healthy",
             last_heartbeat_at=now, agent_version="1.4.2")
        for i in range(count)
    ]  # fmt: skip
    Node.objects.bulk_create(nodes, batch_size=5000)
    stopped = set(rng.sample(range(count), max(1, int(count * stop_fraction))))
    rows, credentials = [], []
    for i, node in enumerate(nodes):
        secret, prefix, digest = secrets.new_secret("npn")
        credentials.append(NodeCredential(node=node, prefix=prefix, secret_hash=digest, issuer="bench",
                                          issued_at=now, expires_at=now + timedelta(days=1)))  # fmt: skip
        rows.append((str(node.pk), secret, i in stopped))
    NodeCredential.objects.bulk_create(credentials, batch_size=5000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return rows


def run_size(args, count: int) -> dict:
    from django.db import close_old_connections, connection

    from fleet.liveness_sweep import sweep_liveness
    from fleet.models import Node, NodeEvent

    rng = random.Random(count)
    rows = seed(count, interval=args.interval, grace=args.grace, stop_fraction=args.stop_fraction, rng=rng)
    with tempfile.NamedTemporaryFile("w", suffix=".nodes", delete=False) as handle:
        handle.writelines(f"{node_id} {secret} {int(stops)}\n" for node_id, secret, stops in rows)
        nodes_file = handle.name
    stopped_ids = [node_id for node_id, _, stops in rows if stops]
    extra = {"NODEPOOL_MAX_HEARTBEATS_PER_SECOND": str(args.ceiling), "NODEPOOL_LIVENESS_SWEEP_INTERVAL": "5"}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as handle:
        handle.write(LUA)
        script = handle.name
    sweeps: list[dict] = []
    stop = threading.Event()
    # The restart: the control plane is away for one interval, then every node renews at once.
    restart_after = args.restart_after if args.restart_after is not None else args.duration / 3

    def sweeper():
        while not stop.wait(5.0):
            sweeps.append(sweep_liveness())
        close_old_connections()

    try:
        with Gunicorn(args.database_url, workers=args.workers, extra_env=extra) as server:
            started = time.time()
            from django.utils import timezone

            run_start = timezone.now()
            t0 = time.time()
            env = {**os.environ, "BENCH_NODES": nodes_file, "BENCH_INTERVAL": str(args.interval),
                   "BENCH_THREADS": str(args.threads), "BENCH_STOP_AFTER": str(args.duration / 2),
                   "BENCH_RESTART_AFTER": str(restart_after), "BENCH_T0": str(t0),
                   "BENCH_SEQ_BASE": str(int(time.time() * 1000))}  # fmt: skip
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu_start = _machine_cpu_seconds()
            sweep_thread = threading.Thread(target=sweeper)
            sweep_thread.start()
            output = subprocess.run(
                ["wrk", "-t", str(args.threads), "-c", str(args.connections), "-d", f"{int(args.duration)}s",
                 "--timeout", "10s", "-s", script, server.base],
                capture_output=True, text=True, env=env, check=False,
            )  # fmt: skip
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu_total = _machine_cpu_seconds() - cpu_start
            # Let the last stopped nodes reach unreachable if the run ended first (the sweep keeps going).
            deadline = time.time() + args.grace + 15
            while time.time() < deadline:
                unreachable = Node.objects.filter(pk__in=stopped_ids, liveness__in=("unreachable", "lost")).count()
                if unreachable == len(stopped_ids):
                    break
                time.sleep(2)
            stop.set()
            sweep_thread.join()
            elapsed = time.time() - started
    finally:
        os.unlink(nodes_file)
        os.unlink(script)
    line = next((x for x in output.stdout.splitlines() if x.startswith("WRKJSON ")), None)
    if output.returncode or line is None:
        raise RuntimeError(f"wrk failed ({output.returncode}):\n{output.stdout}\n{output.stderr}")
    import json

    result = json.loads(line[len("WRKJSON ") :])
    per_second = {int(k[3:]) - int(t0): v for k, v in result["counters"].items() if k.startswith("at_")}
    result["counters"] = {k: v for k, v in result["counters"].items() if not k.startswith("at_")}
    herd = herd_figures(per_second, restart=int(restart_after), interval=args.interval, nodes=count,
                        end=int(args.duration))  # fmt: skip
    generator_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    live_events = (
        NodeEvent.objects.filter(type="liveness", created_at__gte=run_start)
        .exclude(node_id__in=stopped_ids)
        .exclude(from_state="unknown")
        .count()
    )
    # Per stopped node: its last renewal to the unreachable event that followed it (a renewal
    # delayed in the generator's backlog may have revived it once: only the last event counts).
    lasts = dict(Node.objects.filter(pk__in=stopped_ids).values_list("pk", "last_heartbeat_at"))
    detected_at: dict = {}
    for node_id, created in NodeEvent.objects.filter(
        type="liveness", to_state="unreachable", node_id__in=stopped_ids, created_at__gte=run_start
    ).values_list("node_id", "created_at"):
        if created >= lasts[node_id]:
            detected_at[node_id] = max(created, detected_at.get(node_id, created))
    detection = [(created - lasts[node_id]).total_seconds() for node_id, created in detected_at.items()]
    connection.close()
    cores = os.cpu_count() or 1
    figures = {
        "nodes": count,
        "interval_s": args.interval,
        "grace_s": args.grace,
        "ceiling_per_s": args.ceiling,
        "duration_s": round(elapsed, 1),
        "false_transitions": live_events,
        "stopped": len(stopped_ids),
        "detected": len(detection),
        "detection_p50_s": round(percentile(detection, 50), 1) if detection else None,
        "detection_p99_s": round(percentile(detection, 99), 1) if detection else None,
        "renewals_per_second": result["rps"],
        "expected_renewals_per_second": round(count / args.interval, 1),
        "renewal_p99_ms": result["p99_ms"],
        "counters": result["counters"],
        "socket_errors": result["socket_errors"],
        "generator_cpu_share": round(generator_cpu / (args.duration * cores), 3),
        "machine_cpu_busy_share": round(cpu_total / (args.duration * cores), 3) if cpu_total else None,
        "sweeps": len(sweeps),
        "restart": herd,
    }
    figures["held"] = figures["false_transitions"] == 0 and figures["detected"] == figures["stopped"]
    return figures


def herd_figures(per_second: dict[int, int], *, restart: int, interval: int, nodes: int, end: int) -> dict:
    """The renewals sent per second after the restart at second ``restart`` of the run: the largest
    one-second bucket of the two intervals after the restart instant (that instant itself, when
    every node arrives at once by construction, left out) against the mean there, and the same
    from one interval after the restart (what the server's slots promise: at most about 2x)."""

    def window(first: int, last: int) -> dict:
        seconds = [per_second.get(s, 0) for s in range(first, min(last, end))]
        if not seconds:
            return {}
        mean = sum(seconds) / len(seconds)
        return {
            "from_s": first,
            "to_s": min(last, end),
            "largest_bucket": max(seconds),
            "mean": round(mean, 1),
            "largest_over_mean": round(max(seconds) / mean, 2) if mean else None,
        }

    return {
        "at_s": restart,
        "at_instant": per_second.get(restart, 0),
        "nodes_due_per_second": round(nodes / interval, 1),
        "two_intervals_after": window(restart + 1, restart + 2 * interval + 1),
        "after_one_interval": window(restart + interval, restart + 3 * interval),
    }


def _machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat; all cores)."""
    try:
        with open("/proc/stat") as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL", DEFAULT_DATABASE_URL))
    parser.add_argument("--nodes", type=int, default=20_000)
    parser.add_argument("--sizes", default="", help="comma-separated fleet sizes, smallest first")
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--grace", type=int, default=60)
    parser.add_argument("--ceiling", type=float, default=1500, help="NODEPOOL_MAX_HEARTBEATS_PER_SECOND")
    parser.add_argument("--duration", type=float, default=180)
    parser.add_argument("--stop-fraction", type=float, default=0.01)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--restart-after",
        type=float,
        default=None,
        help="seconds into the run when every node renews at once (default: a third of the run)",
    )
    parser.add_argument("--quick", action="store_true", help="CI: 500 nodes, 2 s interval, 24 s")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("wrk is not installed: apt-get install -y wrk")
    if args.quick:
        args.nodes, args.interval, args.grace, args.duration, args.sizes = 500, 2, 6, 24, ""
        args.stop_fraction = 0.02
    sizes = [int(x) for x in args.sizes.split(",") if x] or [args.nodes]

    prepare_database(args.database_url)
    django_setup(args.database_url)
    runs = []
    for count in sizes:
        figures = run_size(args, count)
        runs.append(figures)
        print(
            f"N={count}: {figures['renewals_per_second']:.0f} renewals/s (of {figures['expected_renewals_per_second']} "
            f"due), false transitions {figures['false_transitions']}, detected {figures['detected']}/"
            f"{figures['stopped']} (p50 {figures['detection_p50_s']} s, p99 {figures['detection_p99_s']} s), "
            f"generator CPU {figures['generator_cpu_share']:.1%} of the machine, {figures['counters']}; "
            f"restart at {figures['restart']['at_s']} s ({figures['restart']['at_instant']} at once): largest "
            f"one-second bucket over the two intervals after it {figures['restart']['two_intervals_after']}, "
            f"from one interval after it {figures['restart']['after_one_interval']}",
            flush=True,
        )
        if not figures["held"]:
            break
    held = [r["nodes"] for r in runs if r["held"]]
    emit({"bench": "fleet_scale", "quick": args.quick, "server": f"gunicorn {args.workers} sync workers",
          "largest_n_held": max(held) if held else 0, "runs": runs})  # fmt: skip


if __name__ == "__main__":
    main()
