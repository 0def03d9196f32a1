"""``python -m simulator``: enroll a seeded fleet, heartbeat, inject faults, print a summary.

Faults given on the command line are applied to nodes drawn from the seed, ``--fault-after``
seconds after the heartbeats start (impossible capacity is declared at enrollment), and
partitions heal after ``--heal-after`` seconds if given. The run ends after ``--duration``
seconds (0: until Ctrl-C) and prints one JSON line with the fleet's counters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys

from .fleet import FleetSimulator, run_coroutine, stop_on_signals
from .shapes import PoolSpec


def _pool(text: str) -> PoolSpec:
    """``name=general,token=npb_…[,weight=3][,gpu=true]``."""
    fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    if "name" not in fields or "token" not in fields:
        raise argparse.ArgumentTypeError("a pool is name=NAME,token=TOKEN[,weight=W][,gpu=true]")
    return PoolSpec(
        fields["name"],
        fields["token"],
        weight=float(fields.get("weight", 1)),
        gpu=fields.get("gpu", "false").lower() in ("1", "true", "yes"),
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulator", description="A simulated nodepool fleet.")
    p.add_argument("--url", required=True, help="control plane URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--bootstrap-token", help="enroll every node with this token (one pool)")
    p.add_argument(
        "--pool",
        type=_pool,
        action="append",
        default=[],
        help="name=NAME,token=TOKEN[,weight=W][,gpu=true] (repeatable; instead of --bootstrap-token)",
    )
    p.add_argument(
        "--gpu-fraction", type=float, default=0.0, help="with --bootstrap-token: share of nodes given GPU shapes"
    )
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--zones", default="zone-a,zone-b,zone-c")
    p.add_argument("--concurrency", type=int, default=32, help="enrollments in flight at once")
    p.add_argument("--duration", type=float, default=0, help="seconds to run after enrolling (0: until Ctrl-C)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--log-level", default="WARNING")
    f = p.add_argument_group("faults (counts of nodes drawn from the seed)")
    f.add_argument("--fault-after", type=float, default=5.0, help="seconds after start to inject faults")
    f.add_argument("--partition", type=int, default=0, help="nodes that go silent")
    f.add_argument("--heal-after", type=float, default=0, help="seconds after the faults to heal partitions (0: never)")
    f.add_argument("--restart", type=int, default=0, help="nodes whose agent restarts (incarnation bump)")
    f.add_argument("--skew", type=int, default=0, help="nodes whose clock is skewed")
    f.add_argument("--skew-seconds", type=float, default=300.0)
    f.add_argument("--duplicate", type=int, default=0, help="nodes that send a heartbeat twice")
    f.add_argument("--reorder", type=int, default=0, help="nodes whose heartbeats arrive out of order")
    f.add_argument("--impossible", type=int, default=0, help="nodes that declare impossible capacity at enrollment")
    f.add_argument("--underperform", type=int, default=0, help="nodes whose benchmark does not confirm the declared")
    f.add_argument("--underperform-factor", type=float, default=0.4)
    f.add_argument("--xid", type=int, default=0, help="GPU nodes on which one GPU reports an XID")
    f.add_argument("--xid-code", type=int, default=79, help="the XID reported (79: fell off the bus; 94: contained)")
    return p


def pools_from_args(args) -> list[PoolSpec]:
    if args.pool:
        return args.pool
    if not args.bootstrap_token:
        raise SystemExit("python -m simulator: give --bootstrap-token or at least one --pool")
    pools = [PoolSpec("default", args.bootstrap_token, weight=max(0.0, 1 - args.gpu_fraction))]
    if args.gpu_fraction > 0:
        pools.append(PoolSpec("default-gpu", args.bootstrap_token, weight=args.gpu_fraction, gpu=True))
    return pools


async def run(args) -> dict:
    sim = FleetSimulator(
        args.url,
        pools=pools_from_args(args),
        seed=args.seed,
        zones=[z for z in args.zones.split(",") if z],
        concurrency=args.concurrency,
        progress=not args.no_progress,
    )
    sim.add_nodes(args.nodes)
    impossible = sim.pick(args.impossible, enrolled=False)
    faults: dict[str, list[str]] = {"impossible": impossible}
    stop = asyncio.Event()
    stop_on_signals(stop)  # before enrolling: Ctrl-C then stops with the nodes enrolled so far

    def summary(**extra) -> dict:
        return {**sim.stats(), "faults": {k: v for k, v in faults.items() if v}, **extra}

    if not await until_stopped(sim.enroll(impossible=impossible), stop):
        await sim.stop()
        return summary(interrupted="enrolling")
    await sim.start()

    async def inject() -> None:
        await asyncio.sleep(args.fault_after)
        used: set[str] = set(impossible)
        for kind, count, apply in (
            ("partition", args.partition, sim.partition),
            ("restart", args.restart, sim.restart),
            ("skew", args.skew, lambda n: sim.skew_clock(n, args.skew_seconds)),
            ("duplicate", args.duplicate, sim.duplicate_heartbeats),
            ("reorder", args.reorder, sim.reorder_heartbeats),
            ("underperform", args.underperform, lambda n: sim.underperform(n, args.underperform_factor)),
        ):
            names = sim.pick(count, exclude=used)
            used.update(names)
            faults[kind] = names
            for name in names:
                apply(name)
        xid_nodes = [n for n in sim.pick(len(sim.nodes), exclude=used) if sim.node(n).devices] if args.xid else []
        faults["xid"] = []
        for name in xid_nodes[: args.xid]:
            gpu = sim.rng.randrange(len(sim.node(name).devices))
            faults["xid"].append(f"{name}/{sim.inject_xid(name, gpu, args.xid_code)}")
        if args.heal_after and faults.get("partition"):
            await asyncio.sleep(args.heal_after)
            for name in faults["partition"]:
                sim.heal(name)

    injector = asyncio.get_running_loop().create_task(inject())
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=args.duration or None)
    injector.cancel()
    await asyncio.gather(injector, return_exceptions=True)
    await sim.stop()
    return summary()


async def until_stopped(work, stop: asyncio.Event) -> bool:
    """Run ``work`` (a coroutine) unless ``stop`` is set first; True when it finished, False when
    it was cancelled because ``stop`` came first."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        task.result()  # its error, if any, is the caller's
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run_coroutine(run(args))
    print(json.dumps(summary))
    if summary.get("interrupted"):
        return 130  # the shell's code for a Ctrl-C
    return 0 if summary["enrolled"] else 1


if __name__ == "__main__":
    sys.exit(main())
