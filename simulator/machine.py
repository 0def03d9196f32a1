"""One simulated machine in its own process: what the ``simulated`` autoscaling provider starts.

    NODEPOOL_BOOTSTRAP_TOKEN=npb_… python -m simulator.machine --url http://127.0.0.1:8000 --name m-1

It enrolls through the real API with its single-use bootstrap token (read from the environment,
never the command line), then heartbeats and runs its leases like any simulated node until it is
stopped (SIGTERM), retired (410), or ``--max-lifetime`` seconds pass (a safety net, so a machine
whose provider forgot it does not run forever).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from .fleet import FleetSimulator, run_coroutine, stop_on_signals
from .node import VirtualNode
from .shapes import NodeSpec

log = logging.getLogger("simulator.machine")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m simulator.machine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the control plane")
    parser.add_argument("--name", required=True, help="the machine's hostname")
    parser.add_argument("--cpu-millicores", type=int, default=2000)
    parser.add_argument("--memory-bytes", type=int, default=4 * 2**30)
    parser.add_argument("--labels", default="{}", help="JSON object of node labels")
    parser.add_argument("--version", default="", help="the agent version it runs (default: the package's)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs it reports as devices (8: two NVLink islands)")
    parser.add_argument("--gpu-model", default="NVIDIA-H100-80GB-HBM3", help="their model (label-safe name)")
    parser.add_argument("--gpu-memory-bytes", type=int, default=80 * 2**30, help="memory per GPU")
    parser.add_argument(
        "--max-lifetime",
        type=float,
        default=float(os.environ.get("NODEPOOL_SIMULATED_MACHINE_LIFETIME", 3600)),
        help="seconds before it stops by itself [$NODEPOOL_SIMULATED_MACHINE_LIFETIME]",
    )
    return parser


async def run(args: argparse.Namespace, token: str) -> int:
    labels = json.loads(args.labels or "{}")
    spec = NodeSpec(
        name=args.name, pool="", bootstrap_token=token, zone=str(labels.get("zone", "zone-a")), shape="template",
        cpu=max(1, args.cpu_millicores // 1000), memory=args.memory_bytes, disk=50 * 2**30, arch="amd64",
        kernel="6.1.0-18-amd64", network_class="10g", address="127.0.0.1", labels=labels,
        agent_version=args.version, gpu_count=max(0, args.gpus), gpu_model=args.gpu_model if args.gpus else "",
        gpu_memory=args.gpu_memory_bytes if args.gpus else 0,
    )  # fmt: skip
    sim = FleetSimulator(args.url, pools=[], progress=False, max_backoff=5.0)
    node = VirtualNode(spec, gate=sim.gate(), max_backoff=5.0)
    sim.nodes[spec.name] = node
    await sim.enroll()
    if not node.enrolled:
        log.error("machine %s could not enroll: %s", args.name, node.enroll_error)
        await sim.stop()
        return 2
    log.info("machine %s enrolled as node %s", args.name, node.node_id)
    stop = asyncio.Event()
    stop_on_signals(stop)
    await sim.start()
    try:
        while not stop.is_set() and node.lifecycle != "retired":
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except TimeoutError:
                args.max_lifetime -= 1.0
                if args.max_lifetime <= 0:
                    break
    finally:
        await sim.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    args = build_parser().parse_args(argv)
    token = os.environ.get("NODEPOOL_BOOTSTRAP_TOKEN", "")
    if not token:
        print("NODEPOOL_BOOTSTRAP_TOKEN is not set", file=sys.stderr)
        return 2
    return run_coroutine(run(args, token))


if __name__ == "__main__":
    sys.exit(main())
