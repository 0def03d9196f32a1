"""Placement benchmark: grants/s over HTTP against a bare Django view doing the same transaction on
the same server in the same run, the 409 explanation at 1k/10k/100k nodes, and a double-allocation audit.

Usage (PostgreSQL; the database is created if missing and its tables are emptied):

    .venv/bin/python bench/placement.py [--sizes 1000,10000,100000] [--requests 300] [--explains 40]
        [--explain-seconds 60] [--http-seconds 10] [--rounds 2] [--clients 16] [--workers 2] [--http-fleet 10000]
        [--database postgres://postgres@127.0.0.1:5432/np_leases_bench]
    .venv/bin/python bench/placement.py --quick     # CI: 300 nodes, seconds
    # the device part alone, on the fleet the last such run built (minutes saved at 10,000 nodes):
    .venv/bin/python bench/placement.py --sizes "" --http-fleet 0 --device-fleet 10000 --reuse

Parts, in order (times in milliseconds, rates in grants per second):

1. Per fleet size (``--sizes``), a fleet is built (3 zones, racks of 40, every 10th node tainted
   ``gpu=true:NoSchedule`` and labelled ``region=gpu``, the others ``region=general``; random
   existing load) and ``--requests`` requests of a mix (plain, zone selector, affinity, zone
   spread, host anti-affinity) are timed in-process: ``place_*_ms`` the scheduler alone
   (``placement.find_candidates``, no write), ``grant_*_ms`` the whole grant (``lease_create``).
2. The 409 explanation at the same size: requests no node can take, up to ``--explains`` of each
   kind, round robin, for at most about ``--explain-seconds`` per way of timing (whole rounds;
   ``*_samples`` says how many were timed, and with fewer than 100 the p99 is the largest) —
   ``cpu_above_any_node``
   (64 cpu; nodes have 8), ``unmatched_selector`` (a zone that does not exist),
   ``taint_only_region`` (selects ``region=gpu``, whose nodes are all tainted, without the
   toleration). ``diagnose_*_ms`` times ``leases.placement.diagnose(pool, spec)`` alone;
   ``conflict_409_*_ms`` the whole 409 answer of ``lease_create`` (the candidate search that finds
   nothing, then the explanation, raised as the 409 ``unschedulable`` Problem). p50/p99 are over
   the three kinds together (also given per kind). Then every node is given a live lease of one
   group and ``anti_affinity_host`` times a request with ``spread: {group, topology_key: host,
   mode: anti-affinity}`` the same two ways, reported separately (its group counts read one lease
   per node). Same-run reference: ``pool_scan_p50_ms``, one set-based SQL query over the pool's
   nodes and cpu rows — the floor for anything that looks at every node. Goals (the issue):
   diagnose p99 ≤ 50 ms at 10,000 nodes and ≤ 300 ms at 100,000.
3. HTTP on a fleet of ``--http-fleet`` nodes: gunicorn (``--workers`` sync workers,
   ``NODEPOOL_BENCH=1``) driven by wrk with ``--clients`` connections, in ``--rounds`` alternating
   rounds (ABBA order) of ``--http-seconds`` each, after a warm-up of each:

   * ``grant``: ``POST /api/v1/node-leases`` (token auth, 100m cpu + 64Mi memory, a new workload
     each time) — ``http_grants_per_s`` counts 201 answers per second;
   * ``baseline``: ``POST /bench/one-grant`` (nodepool/bench_views.py), a bare Django view doing
     the grant's transaction — the conditional capacity UPDATE of a cpu row (100m, drawn at random
     among nodes at least half free) and the INSERT of the lease row — ``baseline_grants_per_s``,
     201 answers per second.

   ``grant_ratio`` = http / baseline (goal ≥ 0.4, and ≥ 300 grants/s on a quiet machine). Latency
   figures (``*_p50_ms``, ``*_p99_ms``) are wrk's, averaged over the rounds.
4. ``sql_grants_per_s``: pgbench running the same transaction as one SQL statement with the same
   number of clients (no Django, no HTTP; skipped when pgbench is missing); ``http_vs_sql``.
5. Audit after each size and after the HTTP runs: no resource above allocatable, no workload with
   two live leases, no drift between counters and live leases. ``double_allocations`` sums the
   first two over all parts; the bench exits 1 if it or any drift is not zero.

Prints a line per part and ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import WRK_LUA_LIB, Gunicorn, percentile, wrk  # noqa: E402

GiB = 2**30
ZONES = ("a", "b", "c")
GOAL_GRANT_RATIO = 0.4
GOAL_HTTP_GRANTS_PER_S = 300
GOAL_EXPLAIN_P99_MS = {10_000: 50, 100_000: 300}  # fleet size → p99 goal of the 409 explanation


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--requests", type=int, default=300, help="placements timed per fleet size")
    parser.add_argument(
        "--explains", type=int, default=40, help="409 explanations timed per kind, per path and fleet size"
    )
    parser.add_argument(
        "--explain-seconds",
        type=float,
        default=60.0,
        help="time budget per fleet size for the 409 rounds (once for the 3 kinds, once for anti-affinity)",
    )
    parser.add_argument("--http-seconds", type=float, default=10.0, help="length of one wrk round (0: no HTTP part)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of grant and baseline")
    parser.add_argument("--clients", type=int, default=16, help="concurrent HTTP connections / pgbench clients")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers (sync)")
    parser.add_argument(
        "--http-fleet", type=int, default=10000, help="fleet size for the HTTP and SQL runs (0: skip them)"
    )
    parser.add_argument(
        "--device-fleet",
        type=int,
        default=10000,
        help="nodes of 8 GPUs for the device part (bench/devices.py; 0: skip)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep the device fleet a previous run built in this database (its leases ended, its load "
        "back to the build's) instead of building it again: the build takes minutes at 10,000 nodes",
    )
    parser.add_argument(
        "--database", default=os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/np_leases_bench")
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke mode for CI: 300 nodes, 30 placements, 5 explanations per kind, one 1 s round of each",
    )
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.requests, args.explains, args.http_fleet, args.clients = "300", 30, 5, 300, 4
        args.device_fleet = 300
        args.http_seconds, args.rounds = 1.0, 1
    return args


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
    racks of 40, every 10th node tainted and in ``region=gpu``, random existing load) with
    credentials and capacity."""
    from django.contrib.auth.models import Group, User
    from django.db import connection
    from django.utils import timezone

    from fleet.choices import Health, Lifecycle, Liveness
    from fleet.models import Node, NodeCredential, NodeResource, Pool
    from nodepool.api.permissions import CLIENTS

    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS bench_device_fleet")  # bench/devices.py's --reuse mark
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
                labels={
                    "topology.kubernetes.io/zone": ZONES[i % 3],
                    "rack": f"r{i // 40}",
                    "gen": str(3 + i % 3),
                    "region": "gpu" if tainted else "general",
                },
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
    # A scheduler as production has one: a member of ``clients``, not a superuser (whose role
    # needs no group read).
    user, _ = User.objects.get_or_create(username="bench-client")
    User.objects.filter(pk=user.pk).update(is_superuser=False)
    user.refresh_from_db()
    user.groups.add(Group.objects.get(name=CLIENTS))
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


def ms_figures(prefix: str, values: list[float]) -> dict:
    """``{prefix_p50_ms, prefix_p99_ms}`` (nearest rank), rounded to 0.01 ms."""
    return {f"{prefix}_p50_ms": round(percentile(values, 50), 2), f"{prefix}_p99_ms": round(percentile(values, 99), 2)}


def time_placement(pool, user, count: int) -> dict:
    """Time the scheduler alone (filter + score, no write) and the whole grant (place + reserve), ms."""
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
        placement.find_candidates(pool, spec)
        place_ms.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        try:
            lease_create(data=body, client=user, actor=Actor.system("bench"))
        except Exception as exc:  # an anti-affinity group can run out of hosts: still a timed answer
            if getattr(exc, "status_code", None) != 409:
                raise
        grant_ms.append((time.perf_counter() - start) * 1000)
    return {**ms_figures("place", place_ms), **ms_figures("grant", grant_ms)}


# Requests no node of the bench fleet can take, and the reason code each must be explained with.
SMALL = {"cpu": "500m", "memory": "1Gi"}
UNFIT = {
    "cpu_above_any_node": ({"resources": {"cpu": "64", "memory": "1Gi"}}, "insufficient_cpu"),
    "unmatched_selector": (
        {"resources": SMALL, "node_selector": {"topology.kubernetes.io/zone": "nowhere"}},
        "node_selector_mismatch",
    ),
    "taint_only_region": ({"resources": SMALL, "node_selector": {"region": "gpu"}}, "untolerated_taint"),
}
ANTI_AFFINITY_GROUP = "everywhere"
ANTI_AFFINITY = (
    {"resources": SMALL, "spread": {"group": ANTI_AFFINITY_GROUP, "topology_key": "host", "mode": "anti-affinity"}},
    "anti_affinity_conflict",
)


def occupy_every_host(pool) -> int:
    """One live lease of :data:`ANTI_AFFINITY_GROUP` on every node (no resources, so no drift)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO leases_lease (id, workload_id, fencing_token, node_id, node_incarnation, pool_id, state,
              workload_state, resources, "group", priority, command, spec, decision, ttl_seconds, expires_at,
              granted_at, end_reason, outcome, missed_reports, idempotency_key, request_hash, version, devices)
            SELECT gen_random_uuid(), 'aa-' || id, 1, id, incarnation, pool_id, 'granted', '', '{}', %s, 0, '[]',
              '{}', '{}', 3600, now() + interval '1 hour', now(), '', '', 0, '', '', 1, '[]'
            FROM fleet_node WHERE pool_id = %s
            """,
            [ANTI_AFFINITY_GROUP, pool.pk],
        )
        occupied = cursor.rowcount
        cursor.execute("ANALYZE leases_lease")
    return occupied


def pool_scan_ms(pool, samples: int = 5) -> float:
    """p50 ms of one set-based query over every node of the pool and its cpu row (the same-run floor)."""
    from django.db import connection

    times = []
    with connection.cursor() as cursor:
        for _ in range(samples + 1):
            start = time.perf_counter()
            cursor.execute(
                "SELECT n.lifecycle, n.taints = '[]'::jsonb, count(*), sum(r.allocatable - r.allocated) "
                "FROM fleet_node n JOIN fleet_noderesource r ON r.node_id = n.id AND r.name = 'cpu' "
                "WHERE n.pool_id = %s GROUP BY 1, 2",
                [pool.pk],
            )
            cursor.fetchall()
            times.append((time.perf_counter() - start) * 1000)
    return round(percentile(times[1:], 50), 2)


def diagnose_once(pool, body: dict, expected: str, size: int) -> tuple[float, dict]:
    """``leases.placement.diagnose`` alone for one request that cannot fit: ``(ms, reasons)``.
    Checked: ``expected`` is among the reasons and all ``size`` nodes are counted."""
    from leases import placement
    from leases.services import resolve_shape
    from leases.spec import parse_spec

    spec = resolve_shape(parse_spec(body))[0]
    start = time.perf_counter()
    explanation = placement.diagnose(pool, spec)
    took = (time.perf_counter() - start) * 1000
    check_explanation(body, explanation, expected, size)
    return took, explanation["reasons"]


def conflict_once(user, body: dict, expected: str, size: int) -> float:
    """The whole 409 answer of ``lease_create`` for one request that cannot fit, in ms. Checked:
    a 409 ``unschedulable`` Problem naming ``expected`` and counting all ``size`` nodes."""
    from fleet.events import Actor
    from leases.services import lease_create

    start = time.perf_counter()
    try:
        lease_create(data=body, client=user, actor=Actor.system("bench"))
    except Exception as exc:
        took = (time.perf_counter() - start) * 1000
        if getattr(exc, "status_code", None) != 409 or exc.get_codes() != "unschedulable":
            raise
        check_explanation(body, exc.extra, expected, size)
        return took
    raise AssertionError(f"{body}: a request that cannot fit was granted")


def check_explanation(body: dict, answer: dict, expected: str, size: int) -> None:
    if expected not in answer.get("reasons", {}) or answer.get("nodes_considered") != size:
        raise AssertionError(f"{body}: explained as {answer} (expected {expected}, {size} nodes)")


def time_explanations(pool, user, kinds: dict, samples: int, size: int, budget_s: float, *, warm=True) -> dict:
    """Time each kind up to ``samples`` times, kinds round robin, first ``diagnose`` alone, then
    the whole 409 of ``lease_create`` (whose candidate search costs far more on a large pool);
    each of the two stops after the round in which ``budget_s`` seconds have passed (at least one
    round). ``warm``: one untimed call of each first. Returns ms figures per kind and over all
    kinds, with the number of samples of each (with fewer than 100, the p99 is the largest)."""
    run = uuid.uuid4().hex[:6]

    def bodies(i):
        for kind, (extra, expected) in kinds.items():
            yield kind, {"workload_id": f"unfit-{run}-{kind}-{i}", "pool": "bench", **extra}, expected

    if warm:
        kind, body, expected = next(bodies("warm"))
        diagnose_once(pool, body, expected, size)
        conflict_once(user, body, expected, size)
    diag: dict[str, list[float]] = {k: [] for k in kinds}
    conflict: dict[str, list[float]] = {k: [] for k in kinds}
    reasons: dict[str, dict] = {}
    started = time.perf_counter()
    for i in range(samples):
        for kind, body, expected in bodies(i):
            took, reasons[kind] = diagnose_once(pool, body, expected, size)
            diag[kind].append(took)
        if time.perf_counter() - started > budget_s:
            break
    started = time.perf_counter()
    for i in range(samples):
        for kind, body, expected in bodies(i):
            conflict[kind].append(conflict_once(user, body, expected, size))
        if time.perf_counter() - started > budget_s:
            break
    figures = {
        kind: {**ms_figures("diagnose", diag[kind]), "diagnose_samples": len(diag[kind]),
               **ms_figures("conflict_409", conflict[kind]), "conflict_409_samples": len(conflict[kind]),
               "reasons": reasons[kind]}
        for kind in kinds
    }  # fmt: skip
    every_diag = [t for kind in kinds for t in diag[kind]]
    every_conflict = [t for kind in kinds for t in conflict[kind]]
    return {
        "kinds": figures,
        **ms_figures("diagnose", every_diag),
        "diagnose_samples": len(every_diag),
        **ms_figures("conflict_409", every_conflict),
        "conflict_409_samples": len(every_conflict),
    }


def explain_part(pool, user, size: int, args) -> dict:
    """Part 2 at one fleet size: the unfit kinds, then the host anti-affinity request (separately)."""
    unfit = time_explanations(pool, user, UNFIT, args.explains, size, args.explain_seconds)
    result = {
        "diagnose_p50_ms": unfit["diagnose_p50_ms"],
        "diagnose_p99_ms": unfit["diagnose_p99_ms"],
        "conflict_409_p50_ms": unfit["conflict_409_p50_ms"],
        "conflict_409_p99_ms": unfit["conflict_409_p99_ms"],
        "diagnose_samples": unfit["diagnose_samples"],
        "conflict_409_samples": unfit["conflict_409_samples"],
        "by_kind": unfit["kinds"],
        "goal_p99_ms": GOAL_EXPLAIN_P99_MS.get(size),
        "pool_scan_p50_ms": pool_scan_ms(pool),
    }
    occupied = occupy_every_host(pool)
    anti = time_explanations(  # warm already; a 409 of this kind takes minutes at 100,000 nodes
        pool, user, {"anti_affinity_host": ANTI_AFFINITY}, args.explains, size, args.explain_seconds, warm=False
    )
    result["anti_affinity_host"] = {**anti["kinds"]["anti_affinity_host"], "group_leases": occupied}
    return result


def audit() -> dict:
    """Zero double allocations: no resource above allocatable, one live lease per workload, and no
    drift — every ``allocated`` equal to the sum of its node's live leases for that resource.

    The drift check is the one ``leases.sweeps.check_consistency`` makes, written here as one
    set-based query so that the audit does not rest on the code it audits (and stays cheap: the
    earlier ``check_consistency`` did not finish in 5 minutes after a 10,000-node HTTP run)."""
    from django.db import connection

    from leases.choices import LIVE_LEASE_STATES

    live = [str(state) for state in LIVE_LEASE_STATES]
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM fleet_noderesource WHERE allocated > allocatable")
        over = cursor.fetchone()[0]
        cursor.execute(
            "SELECT count(*) FROM (SELECT workload_id FROM leases_lease WHERE state = ANY(%s) "
            "GROUP BY workload_id HAVING count(*) > 1) t",
            [live],
        )
        doubled = cursor.fetchone()[0]
        cursor.execute(
            """
            WITH leased AS (
              SELECT l.node_id, r.key AS name, sum(r.value::bigint) AS amount
              FROM leases_lease l, jsonb_each_text(l.resources) r
              WHERE l.state = ANY(%s) GROUP BY 1, 2
            )
            SELECT count(*) FROM fleet_noderesource n FULL JOIN leased l ON l.node_id = n.node_id AND l.name = n.name
            WHERE coalesce(n.allocated, 0) <> coalesce(l.amount, 0)
            """,
            [live],
        )
        drift = cursor.fetchone()[0]
    return {"oversubscribed_resources": over, "workloads_with_two_live_leases": doubled, "drift": drift}


GRANT_LUA = r"""
local mode = os.getenv("BENCH_MODE")
local token = os.getenv("BENCH_TOKEN")
local run = os.getenv("BENCH_RUN")
local ids, n = {}, 0
function init(args)
  for line in io.lines(os.getenv("BENCH_RESOURCES")) do table.insert(ids, line) end
  math.randomseed(tonumber(os.getenv("BENCH_SEED")) + 7919 * (tid or 0))
end
function request()
  n = n + 1
  local workload = string.format("%s-%s-%d-%d", mode, run, tid or 0, n)
  if mode == "baseline" then
    return wrk.format("POST", "/bench/one-grant", {["Content-Type"] = "application/json"},
      string.format('{"workload_id": "%s", "resource": %s, "amount": 100}', workload, ids[math.random(#ids)]))
  end
  local gpu = ""
  if mode == "device" then gpu = ', "nvidia.com/gpu": 1' end  -- bench/devices.py's device grants
  return wrk.format("POST", "/api/v1/node-leases",
    {["Content-Type"] = "application/json", ["Authorization"] = "Token " .. token},
    string.format('{"workload_id": "%s", "pool": "bench", "resources": {"cpu": "100m", "memory": "64Mi"%s}}',
      workload, gpu))
end
function response(status, headers, body)
  counters[tostring(status)] = (counters[tostring(status)] or 0) + 1
end
"""


def http_part(args, pool, user) -> dict:
    """Part 3: the real grant and the bare-view baseline on one gunicorn, alternating rounds."""
    from fleet.models import NodeResource
    from nodepool.tokens import create_user_token

    _, token = create_user_token(user)
    # The baseline draws among the cpu rows with at least half the node free (3 nodes in 5): the
    # real grant's binpack fills the fullest nodes first, so the two do not run each other out of
    # room during the run and the baseline's answers are grants, not 409s.
    cpu_ids = NodeResource.objects.filter(node__pool=pool, name="cpu", allocatable__gte=4000).values_list(
        "id", flat=True
    )
    with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as handle:
        handle.writelines(f"{pk}\n" for pk in cpu_ids)
        ids_file = handle.name
    results: dict[str, list[dict]] = {"grant": [], "baseline": []}
    try:
        with Gunicorn(args.database, workers=args.workers, extra_env={"THROTTLE_USER": "10000000/min"}) as server:

            def run(mode: str, seconds: float) -> dict:
                env = {"BENCH_MODE": mode, "BENCH_TOKEN": token, "BENCH_RUN": uuid.uuid4().hex[:8],
                       "BENCH_RESOURCES": ids_file, "BENCH_SEED": str(random.randrange(1 << 30))}  # fmt: skip
                return wrk(server.base, GRANT_LUA + WRK_LUA_LIB, duration=seconds, connections=args.clients, env=env)

            warm = 1 if args.quick else 2
            for mode in ("baseline", "grant"):  # connections, caches, the first request's imports
                run(mode, warm)
            for round_ in range(args.rounds):
                order = ("baseline", "grant") if round_ % 2 == 0 else ("grant", "baseline")  # ABBA: cancels drift
                for mode in order:
                    result = run(mode, args.http_seconds)
                    results[mode].append(result)
                    print(f"  round {round_ + 1} {mode:8s} {result['counters'].get('201', 0) / result['seconds']:7.1f} "
                          f"grants/s  p50 {result['p50_ms']:7.2f} ms  p99 {result['p99_ms']:7.2f} ms  "
                          f"{result['counters']}", flush=True)  # fmt: skip
    finally:
        os.unlink(ids_file)

    def rate(mode):
        granted = sum(r["counters"].get("201", 0) for r in results[mode])
        return round(granted / sum(r["seconds"] for r in results[mode]), 1)

    def mean(mode, key):
        return round(sum(r[key] for r in results[mode]) / len(results[mode]), 2)

    def statuses(mode):
        merged: dict[str, int] = {}
        for r in results[mode]:
            for key, value in r["counters"].items():
                merged[key] = merged.get(key, 0) + value
            if r["socket_errors"]:
                merged["socket_errors"] = merged.get("socket_errors", 0) + r["socket_errors"]
        return merged

    figures = {
        "http_grants_per_s": rate("grant"),
        "http_p50_ms": mean("grant", "p50_ms"),
        "http_p99_ms": mean("grant", "p99_ms"),
        "http_status_counts": statuses("grant"),
        "baseline_grants_per_s": rate("baseline"),
        "baseline_p50_ms": mean("baseline", "p50_ms"),
        "baseline_p99_ms": mean("baseline", "p99_ms"),
        "baseline_status_counts": statuses("baseline"),
    }
    figures["grant_ratio"] = round(figures["http_grants_per_s"] / max(figures["baseline_grants_per_s"], 0.1), 3)
    return figures


PGBENCH_SCRIPT = """\\set r :base + 2 * random(0, :n - 1)
WITH u AS (UPDATE fleet_noderesource SET allocated = allocated + 10
           WHERE id = :r AND allocated + 10 <= allocatable RETURNING node_id)
INSERT INTO leases_lease (id, workload_id, fencing_token, node_id, node_incarnation, pool_id, state, workload_state,
  resources, "group", priority, command, spec, decision, ttl_seconds, expires_at, granted_at, end_reason, outcome,
  missed_reports, idempotency_key, request_hash, version, devices)
SELECT gen_random_uuid(), 'sql-' || gen_random_uuid(), 1, node_id, 1, :pool, 'granted', '', '{"cpu": 10}', '', 0,
  '[]', '{}', '{}', 600, now() + interval '10 minutes', now(), '', '', 0, '', '', 1, '[]' FROM u;
"""


def sql_baseline(args, pool) -> dict:
    """pgbench running the raw transaction of the same shape: conditional UPDATE of the node's
    capacity + INSERT of the lease row (one statement, one transaction), same clients, same run."""
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


def verdict(value, goal, *, at_most: bool = False) -> str:
    if goal is None or value is None:
        return ""
    met = value <= goal if at_most else value >= goal
    return f" (goal {'≤' if at_most else '≥'} {goal}: {'met' if met else 'NOT met'})"


def device_part(args, audits: list) -> dict:
    """Part 6 (bench/devices.py): a fleet of ``--device-fleet`` nodes with 8 GPUs each."""
    from bench import devices

    started = time.perf_counter()
    reused = devices.reuse_fleet(args.device_fleet) if args.reuse else None
    if reused is None:
        pool, user = build_fleet(args.device_fleet)
        devices.add_gpus(pool)
    else:
        pool, user = reused
    gpus = devices.mark_built(pool)
    result = {"nodes": args.device_fleet, "gpus": gpus, "build_s": round(time.perf_counter() - started, 1),
              "reused": reused is not None}  # fmt: skip
    result.update(devices.time_device_placement(pool, user, args.requests, percentile))
    result.update(devices.time_device_409(user, args.explains, percentile))
    place_goal = verdict(result["device_place_p99_ms"], devices.GOAL_DEVICE_PLACE_P99_MS, at_most=True)
    conflict_goal = verdict(result["device_409_p99_ms"], devices.GOAL_DEVICE_409_P99_MS, at_most=True)
    print(f"devices: {args.device_fleet} nodes x 8 GPUs: place p50 {result['device_place_p50_ms']} ms, "
          f"p99 {result['device_place_p99_ms']} ms{place_goal}; grant p99 {result['device_grant_p99_ms']} ms; "
          f"409 with device reasons p50 {result['device_409_p50_ms']} ms, p99 {result['device_409_p99_ms']} ms"
          f"{conflict_goal} {result['device_409_reasons']}", flush=True)  # fmt: skip
    if args.http_seconds > 0:
        lua = GRANT_LUA + WRK_LUA_LIB
        result.update(devices.http_device_part(args, pool, user, Gunicorn=Gunicorn, wrk=wrk, lua=lua))
        goal = verdict(result["device_vs_count"], devices.GOAL_DEVICE_VS_COUNT)
        print(f"devices over HTTP: count-only {result['count_grants_per_s']} grants/s (ratio {result['count_ratio']}), "
              f"with a GPU {result['device_grants_per_s']} grants/s (ratio {result['device_ratio']}) to the bare view "
              f"{result['baseline_grants_per_s']} grants/s: device/count {result['device_vs_count']}{goal}",
              flush=True)  # fmt: skip
    result["audit"] = {**audit(), **devices.device_audit()}
    audits.append(result["audit"])
    print(f"{'':>9}device audit {result['audit']}", flush=True)
    return result


def main() -> int:
    args = parse_args()
    ensure_database(args.database)
    setup_django(args.database)
    figures: dict = {"bench": "placement", "quick": args.quick, "database": "postgresql", "sizes": {}}
    audits = []
    for size in [int(s) for s in args.sizes.split(",") if s]:
        started = time.perf_counter()
        pool, user = build_fleet(size)
        built = time.perf_counter() - started
        result = {"build_s": round(built, 1), **time_placement(pool, user, args.requests)}
        print(f"{size:>7} nodes (built in {built:.1f}s): place p50 {result['place_p50_ms']} ms, "
              f"p99 {result['place_p99_ms']} ms; grant p50 {result['grant_p50_ms']} ms, "
              f"p99 {result['grant_p99_ms']} ms", flush=True)  # fmt: skip
        started = time.perf_counter()
        explain = result["explain"] = explain_part(pool, user, size, args)
        anti = explain["anti_affinity_host"]
        goal = verdict(explain["diagnose_p99_ms"], explain["goal_p99_ms"], at_most=True)
        print(f"{size:>7} nodes, 409 explanation (3 kinds; {time.perf_counter() - started:.1f}s): diagnose "
              f"p50 {explain['diagnose_p50_ms']} ms, p99 {explain['diagnose_p99_ms']} ms{goal} "
              f"(n={explain['diagnose_samples']}); whole 409 p50 {explain['conflict_409_p50_ms']} ms, "
              f"p99 {explain['conflict_409_p99_ms']} ms (n={explain['conflict_409_samples']}); "
              f"one set-based scan of the pool {explain['pool_scan_p50_ms']} ms", flush=True)  # fmt: skip
        for kind, by_kind in [*explain["by_kind"].items(), ("anti_affinity_host", anti)]:
            print(f"{'':>9}{kind:20s} diagnose p50 {by_kind['diagnose_p50_ms']} ms, "
                  f"p99 {by_kind['diagnose_p99_ms']} ms (n={by_kind['diagnose_samples']}); "
                  f"409 p50 {by_kind['conflict_409_p50_ms']} ms, p99 {by_kind['conflict_409_p99_ms']} ms "
                  f"(n={by_kind['conflict_409_samples']}); {by_kind['reasons']}", flush=True)  # fmt: skip
        print(f"{'':>9}(anti_affinity_host: {anti['group_leases']} live leases of the group, one per node)")
        result["audit"] = audit()
        audits.append(result["audit"])
        print(f"{'':>9}audit {result['audit']}", flush=True)
        figures["sizes"][str(size)] = result
    if args.http_seconds > 0 and args.http_fleet:
        pool, user = build_fleet(args.http_fleet)
        figures.update(http_fleet=args.http_fleet, clients=args.clients, gunicorn_workers=args.workers,
                       rounds=args.rounds, http_seconds=args.http_seconds)  # fmt: skip
        print(f"HTTP on {args.http_fleet} nodes: gunicorn {args.workers} sync workers, wrk {args.clients} connections, "
              f"{args.rounds} x {args.http_seconds:g}s alternating", flush=True)  # fmt: skip
        figures.update(http_part(args, pool, user))
        figures["goal_grant_ratio"] = GOAL_GRANT_RATIO
        figures["goal_http_grants_per_s"] = GOAL_HTTP_GRANTS_PER_S
        print(f"POST /api/v1/node-leases {figures['http_grants_per_s']} grants/s (p50 {figures['http_p50_ms']} ms, "
              f"p99 {figures['http_p99_ms']} ms){verdict(figures['http_grants_per_s'], GOAL_HTTP_GRANTS_PER_S)} vs "
              f"bare view POST /bench/one-grant {figures['baseline_grants_per_s']} grants/s (p50 "
              f"{figures['baseline_p50_ms']} ms, p99 {figures['baseline_p99_ms']} ms): ratio {figures['grant_ratio']}"
              f"{verdict(figures['grant_ratio'], GOAL_GRANT_RATIO)}", flush=True)  # fmt: skip
        if shutil.which("pgbench"):
            figures.update(sql_baseline(args, pool))
            figures["http_vs_sql"] = round(figures["http_grants_per_s"] / figures["sql_grants_per_s"], 3)
            print(f"raw SQL (pgbench, the same transaction as one statement), {args.clients} clients: "
                  f"{figures['sql_grants_per_s']} grants/s", flush=True)  # fmt: skip
        figures["audit"] = audit()
        audits.append(figures["audit"])
        print(f"audit after the HTTP and SQL runs: {figures['audit']}", flush=True)
    if args.device_fleet:
        figures["devices"] = device_part(args, audits)
    figures["double_allocations"] = sum(
        a["oversubscribed_resources"] + a["workloads_with_two_live_leases"] + a.get("double_assigned_devices", 0)
        for a in audits
    )
    figures["drift"] = sum(a["drift"] + a.get("claimed_drift", 0) + a.get("fingerprint_drift", 0) for a in audits)
    print(json.dumps(figures, sort_keys=True), flush=True)
    return 1 if figures["double_allocations"] or figures["drift"] else 0


if __name__ == "__main__":
    sys.exit(main())
