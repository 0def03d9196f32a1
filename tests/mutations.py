"""Named mutations of the product, each checked against only its module's tests (issue 28, step 3).

Each mutation replaces one exact piece of product code (it must occur exactly ``count`` times),
runs the tests that guard it serially, and puts the file back, whatever happens. A mutation is
*caught* when those tests fail, *survived* when they pass: a survivor is a missing test.

    .venv/bin/python tests/mutations.py                 # every mutation, on SQLite
    .venv/bin/python tests/mutations.py older_fencing_token idempotency_client_scope
    DATABASE_URL=postgres://... .venv/bin/python tests/mutations.py --list

Prints one line per mutation and ``caught N of M``; exits 1 when any survived (or did not apply).
Run it on a clean work tree: it edits files in place for the length of one pytest run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # product file, relative to the repository
    old: str  # exact text replaced...
    new: str  # ...by this
    tests: tuple[str, ...]  # pytest arguments: the guarding module's tests (optionally ``-k``)
    count: int = 1  # how many times ``old`` occurs (all are replaced)
    why: str = ""


MUTATIONS = (
    Mutation(
        "older_fencing_token",
        "leases/fencing.py",
        "if fencing_token != lease.fencing_token:",
        "if fencing_token > lease.fencing_token:",
        ("tests/leases/test_leases_lifecycle.py", "-k", "fencing_token or stale"),
        why="an older token N-1 must be 409 stale_fencing_token, not a lost compare-and-swap",
    ),
    Mutation(
        "stale_incarnation",
        "leases/fencing.py",
        "if node_incarnation != lease.node_incarnation or node_incarnation < node.incarnation:",
        "if node_incarnation < node.incarnation:",
        ("tests/leases/test_leases_lifecycle.py", "-k", "stale"),
        why="a write from another incarnation of the node is refused",
    ),
    Mutation(
        "terminal_lease_writes",
        "leases/fencing.py",
        "if lease.state in TERMINAL_LEASE_STATES:",
        "if False:",
        ("tests/leases/test_leases_lifecycle.py", "-k", "release"),
        why="a write on an ended lease is 410 lease_ended",
    ),
    Mutation(
        "idempotency_client_scope",
        "leases/idempotency.py",
        "filter(client=client, idempotency_key=idempotency_key)",
        "filter(idempotency_key=idempotency_key)",
        ("tests/leases/test_leases_concurrency.py", "-k", "idempotency"),
        count=2,
        why="client B's request with client A's key must not replay A's lease (or A's 422)",
    ),
    Mutation(
        "idempotency_body_check",
        "leases/idempotency.py",
        "if previous.request_hash != request_hash:",
        "if False:",
        ("tests/leases/test_leases_api.py", "-k", "idempotency"),
        why="a key reused with another body is 422 idempotency_key_reused",
    ),
    Mutation(
        "expiry_recheck_at_claim",
        "leases/lifecycle.py",
        "            claim = claim.filter(expires_at__lte=now)",
        "            pass",
        ("tests/leases/test_leases_concurrency.py", "-k", "expiry"),
        why="a renewal landing between the sweep's read and its claim keeps the lease",
    ),
    Mutation(
        "benchmark_expiry_recheck_at_claim",
        "fleet/benchmarks.py",
        "claim = Benchmark.objects.filter(pk=bench.pk, deadline__lte=now)",
        "claim = Benchmark.objects.filter(pk=bench.pk)",
        ("tests/fleet/test_fleet_benchmarks.py", "-k", "expir"),
        why="a deadline extended between the sweep's read and its claim keeps the benchmark",
    ),
    Mutation(
        "end_lease_claims_live_only",
        "leases/models.py",
        "@transition(field=state, source=LIVE_LEASE_STATES, target=LeaseState.EXPIRED)",
        '@transition(field=state, source="*", target=LeaseState.EXPIRED)',
        ("tests/leases/test_leases_concurrency.py", "-k", "expiry"),
        why="two sweeps at once return a lease's capacity once",
    ),
    Mutation(
        "capacity_race_guard",
        "leases/sql/grant.py",
        "AND allocated + {amount} <= allocatable",
        "AND allocated + {amount} >= 0",
        ("tests/leases/test_leases_concurrency.py", "-k", "oversubscribe or loser"),
        why="the capacity UPDATE's WHERE is the whole race guard: racing grants never oversubscribe a node",
    ),
    Mutation(
        "device_rules_read_claimed",
        "leases/sql/devices.py",
        '_TAKEN = "d.claimed"',
        '_TAKEN = "(1 = 0)"',
        ("tests/leases/test_device_sql.py",),
        why="placement and the 409 decided in SQL count a device a live lease holds as taken, as choose does",
    ),
)


def apply(mutation: Mutation) -> str:
    """Mutate the file; returns its original text. Raises ValueError when ``old`` does not occur
    exactly ``count`` times (the code moved on: update the mutation)."""
    path = ROOT / mutation.path
    original = path.read_text()
    found = original.count(mutation.old)
    if found != mutation.count:
        raise ValueError(
            f"{mutation.name}: {mutation.old!r} occurs {found} times in {mutation.path}, not {mutation.count}"
        )
    path.write_text(original.replace(mutation.old, mutation.new))
    return original


def check(mutation: Mutation, python: str) -> tuple[str, float]:
    """``("caught" | "survived" | "did not apply: ...", seconds)``."""
    started = time.monotonic()
    try:
        original = apply(mutation)
    except ValueError as exc:
        return f"did not apply: {exc}", 0.0
    try:
        run = subprocess.run(
            [python, "-m", "pytest", "-p", "no:xdist", "-q", "-x", "--no-header", *mutation.tests],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    finally:
        (ROOT / mutation.path).write_text(original)
    if run.returncode == 5:  # no test collected: the selection is stale
        return "did not apply: no test selected", time.monotonic() - started
    return ("caught" if run.returncode else "survived"), time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:28} {m.path:22} {m.why}")
        return 0
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutation(s): {', '.join(unknown)}")
    chosen = [known[n] for n in args.names] or list(MUTATIONS)
    caught = 0
    for mutation in chosen:
        verdict, seconds = check(mutation, args.python)
        caught += verdict == "caught"
        print(f"{mutation.name:28} {verdict:10} {seconds:6.1f}s  {' '.join(mutation.tests)}", flush=True)
    print(f"caught {caught} of {len(chosen)}")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
