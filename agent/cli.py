"""``nodepool-agent`` (or ``python -m agent``): run the agent, or inspect the host and state.

Subcommands: ``run`` (the default), ``inventory`` (print what would be declared), ``benchmark``
(run the admission benchmark locally) and ``status`` (print the state file without the secret).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from . import __version__, benchmark, inventory
from .conditions import Thresholds, measure
from .runner import EXIT_CONFIG, Agent, AgentConfig
from .state import StateError, StateFile, default_state_path


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


COMMANDS = ("run", "inventory", "benchmark", "status")


def _common(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """--log-level and --state-file, accepted before or after the subcommand."""
    parser.add_argument(
        "--log-level", default=os.environ.get("NODEPOOL_AGENT_LOG_LEVEL", "INFO") if defaults else argparse.SUPPRESS
    )
    parser.add_argument(
        "--state-file",
        type=Path,
        default=Path(os.environ.get("NODEPOOL_AGENT_STATE") or default_state_path()) if defaults else argparse.SUPPRESS,
        help="identity, credential, incarnation and sequence (mode 0600) [$NODEPOOL_AGENT_STATE]",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodepool-agent", description="The nodepool node agent.")
    parser.add_argument("--version", action="version", version=f"nodepool-agent {__version__}")
    _common(parser, defaults=True)
    sub = parser.add_subparsers(dest="command")
    common = argparse.ArgumentParser(add_help=False)
    _common(common, defaults=False)

    run = sub.add_parser("run", parents=[common], help="enroll if needed, then heartbeat and run work until SIGTERM")
    run.add_argument("--url", default=os.environ.get("NODEPOOL_URL", ""), help="control plane URL [$NODEPOOL_URL]")
    run.add_argument(
        "--bootstrap-token",
        default=os.environ.get("NODEPOOL_BOOTSTRAP_TOKEN", ""),
        help="npb_… token for the first enrollment [$NODEPOOL_BOOTSTRAP_TOKEN]",
    )
    run.add_argument("--bootstrap-token-file", type=Path, help="read the bootstrap token from this file")
    run.add_argument(
        "--label",
        action="append",
        type=_label,
        default=[],
        metavar="KEY=VALUE",
        help="a label to declare at enrollment (repeatable)",
    )
    run.add_argument("--display-name", default="")
    run.add_argument("--hostname", default="", help="declare this hostname instead of the system's")
    run.add_argument("--work-dir", type=Path, help="where lease workloads run (default: next to the state file)")
    run.add_argument("--stop-grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    run.add_argument("--max-backoff", type=float, default=300.0, help="cap of the retry delay in seconds")
    run.add_argument(
        "--memory-pressure-bytes",
        type=int,
        default=Thresholds.memory_available_bytes,
        help="MemoryPressure below this many available bytes (kubelet default 100Mi)",
    )
    run.add_argument(
        "--disk-pressure-fraction",
        type=float,
        default=Thresholds.disk_available_fraction,
        help="DiskPressure below this share of free space (kubelet default 0.10)",
    )
    run.add_argument(
        "--pid-pressure-fraction",
        type=float,
        default=Thresholds.pid_used_fraction,
        help="PIDPressure above this share of pid_max in use",
    )
    run.add_argument("--disk-path", default="/", help="the filesystem watched for DiskPressure and declared")
    run.add_argument("--benchmark-cpu-seconds", type=float, default=2.0)
    run.add_argument("--benchmark-memory-bytes", type=int, default=None)
    run.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request")
    run.add_argument("--insecure", action="store_true", help="do not verify TLS certificates")
    run.add_argument("--ca-bundle", help="CA bundle to verify the control plane's certificate")
    run.add_argument("--once", action="store_true", help="send one heartbeat, then stop")

    inv = sub.add_parser("inventory", parents=[common], help="print the host inventory and conditions as JSON")
    inv.add_argument("--disk-path", default="/")
    bench = sub.add_parser("benchmark", parents=[common], help="run the admission benchmark here and print it")
    bench.add_argument("--cpu-seconds", type=float, default=2.0)
    bench.add_argument("--memory-bytes", type=int, default=None)
    sub.add_parser("status", parents=[common], help="print the state file (without the credential secret)")
    return parser


def _run(args) -> int:
    token = args.bootstrap_token
    if args.bootstrap_token_file:
        token = args.bootstrap_token_file.read_text().strip()
    if not args.url:
        print("nodepool-agent: --url (or $NODEPOOL_URL) is required", file=sys.stderr)
        return EXIT_CONFIG
    config = AgentConfig(
        url=args.url,
        state_path=args.state_file,
        bootstrap_token=token,
        labels=dict(args.label),
        display_name=args.display_name,
        hostname=args.hostname,
        work_dir=args.work_dir,
        stop_grace=args.stop_grace,
        max_backoff=args.max_backoff,
        thresholds=Thresholds(
            memory_available_bytes=args.memory_pressure_bytes,
            disk_available_fraction=args.disk_pressure_fraction,
            pid_used_fraction=args.pid_pressure_fraction,
            disk_path=args.disk_path,
        ),
        benchmark_cpu_seconds=args.benchmark_cpu_seconds,
        benchmark_memory_bytes=args.benchmark_memory_bytes,
        timeout=args.timeout,
        verify=args.ca_bundle or not args.insecure,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        return Agent(config).run(stop, once=args.once)
    except StateError as exc:
        logging.getLogger("agent").error("%s", exc)
        return EXIT_CONFIG


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(arg in COMMANDS for arg in argv) and not {"-h", "--help", "--version"} & set(argv):
        argv.insert(0, "run")  # `nodepool-agent --url …` means `nodepool-agent run --url …`
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = args.command
    if command == "inventory":
        facts = inventory.collect(disk_path=args.disk_path)
        facts["conditions"] = measure(Thresholds(disk_path=args.disk_path))
        print(json.dumps(facts, indent=2))
        return 0
    if command == "benchmark":
        print(json.dumps(benchmark.run(cpu_seconds=args.cpu_seconds, memory_sample_bytes=args.memory_bytes), indent=2))
        return 0
    if command == "status":
        try:
            state = StateFile(args.state_file).load()
        except StateError as exc:
            print(f"nodepool-agent: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        print(json.dumps(state.public(), indent=2))
        return 0
    return _run(args)
