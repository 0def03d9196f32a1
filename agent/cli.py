"""``nodepool-agent`` (or ``python -m agent``): run the agent, or inspect the host and state.

Subcommands: ``run`` (the default), ``inventory`` (print what would be declared), ``benchmark``
(run the admission benchmark locally), ``status`` (print the state file without the secret),
``preempt`` (tell the control plane this spot machine is being reclaimed; agent/preemption.py) and
``set-credential`` (take a credential an operator handed over; agent/recovery.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from . import __version__, benchmark, devices, inventory, nvidia, recovery, repair
from .client import ApiError, NodeClient, ServerUnavailable
from .conditions import Thresholds, measure
from .runner import EXIT_CONFIG, EXIT_RESTART, Agent, AgentConfig
from .state import StateError, StateFile, default_state_path
from .times import parse_time, rfc3339


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


COMMANDS = ("run", "inventory", "benchmark", "status", "preempt", "set-credential")


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not 'Name: value'")
    return name.strip(), value.strip()


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
    run.add_argument(
        "--bootstrap-token-file",
        type=Path,
        help="read the bootstrap token from this file (read again whenever the credential is refused: "
        "a token naming this node re-enrolls it as the same node)",
    )
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
    run.add_argument(
        "--no-renewals", action="store_true", help="send a full status report every interval (no renewals)"
    )
    run.add_argument(
        "--upgrade-action",
        action="append",
        type=_label,
        default=[],
        metavar="NAME=COMMAND",
        help="command run for an upgrade instruction with this action (repeatable; the only commands it runs)",
    )
    run.add_argument("--version-file", type=Path, help="the version reported is this file's first line")
    run.add_argument(
        "--repair-reboot-command",
        default=None,
        metavar="COMMAND",
        help="command run for a repair reboot instruction, e.g. 'systemctl reboot' (default: "
        "$NODEPOOL_REPAIR_REBOOT_COMMAND; none: reboot instructions are refused and logged)",
    )
    run.add_argument(
        "--preemption-url",
        default="",
        help="instance metadata polled for a spot reclaim (EC2 spot/instance-action, GCE instance/preempted)",
    )
    run.add_argument(
        "--preemption-header",
        action="append",
        type=_header,
        default=[],
        metavar="'NAME: VALUE'",
        help="header sent with each poll (repeatable; GCE needs 'Metadata-Flavor: Google')",
    )
    run.add_argument("--preemption-poll", type=float, default=5.0, help="seconds between two polls")
    run.add_argument(
        "--xid-source",
        choices=["auto", "nvml", "kmsg", "none"],
        default="auto",
        help="where GPU XID events come from: NVML events, the kernel log (/dev/kmsg, needs CAP_SYSLOG), "
        "or auto (NVML, else the kernel log)",
    )
    run.add_argument("--device-refresh", type=float, default=30.0, help="seconds an nvidia-smi inventory is reused")

    inv = sub.add_parser("inventory", parents=[common], help="print the host inventory and conditions as JSON")
    inv.add_argument("--disk-path", default="/")
    bench = sub.add_parser("benchmark", parents=[common], help="run the admission benchmark here and print it")
    bench.add_argument("--cpu-seconds", type=float, default=2.0)
    bench.add_argument("--memory-bytes", type=int, default=None)
    sub.add_parser("status", parents=[common], help="print the state file (without the credential secret)")
    preempt = sub.add_parser(
        "preempt", parents=[common], help="tell the control plane this spot machine is reclaimed soon"
    )
    when = preempt.add_mutually_exclusive_group(required=True)
    when.add_argument("--in", dest="seconds", type=float, help="the machine goes away in this many seconds")
    when.add_argument("--deadline", help="the machine goes away at this RFC 3339 time (with Z or an offset)")
    preempt.add_argument("--url", default="", help="control plane URL (default: the one the agent enrolled with)")
    preempt.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request")
    preempt.add_argument("--insecure", action="store_true", help="do not verify TLS certificates")
    preempt.add_argument("--ca-bundle", help="CA bundle to verify the control plane's certificate")
    handed = sub.add_parser(
        "set-credential",
        parents=[common],
        help="take a credential an operator issued (nodepoolctl release --issue-credential --credential-file)",
    )
    source = handed.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--file", type=Path, help="nodepoolctl's credential file (JSON) or a file holding npn_…; - reads stdin"
    )
    source.add_argument("--credential", help="the npn_… credential itself (visible in the process list: prefer --file)")
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
        bootstrap_token_file=args.bootstrap_token_file,
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
        upgrade_actions={name: shlex.split(command) for name, command in args.upgrade_action},
        version_file=args.version_file,
        repair_reboot_command=repair.reboot_command_from(args.repair_reboot_command),
        renewals=not args.no_renewals,
        preemption_url=args.preemption_url,
        preemption_headers=dict(args.preemption_header),
        preemption_poll=args.preemption_poll,
        xid_source=args.xid_source,
        device_refresh=args.device_refresh,
    )
    stop = threading.Event()
    # SIGTERM and Ctrl-C stop the loop gracefully. Signals reach only the main thread; when the
    # agent runs embedded elsewhere (a test, a thread) the caller stops it, and the handlers of
    # the process are put back when the agent returns.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    try:
        code = Agent(config).run(stop, once=args.once)
    except StateError as exc:
        logging.getLogger("agent").error("%s", exc)
        return EXIT_CONFIG
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == EXIT_RESTART:
        # After an upgrade: replace this process with a fresh one (same arguments), which starts
        # a new incarnation and reports the version the upgrade installed.
        logging.getLogger("agent").info("restarting after the upgrade")
        os.execv(sys.executable, [sys.executable, "-m", "agent", *sys.argv[1:]])  # noqa: S606 (our own interpreter)
    return code


def _preempt(args, *, transport=None) -> int:
    """``nodepool-agent preempt``: send the node's preemption notice with its own credential.

    Exit status: 0 sent (or already recorded), 1 refused or unreachable, 2 no usable state or
    deadline.
    """
    try:
        state = StateFile(args.state_file).load()
    except StateError as exc:
        print(f"nodepool-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if not state.enrolled:
        print("nodepool-agent: this machine has not enrolled (no node id in the state file)", file=sys.stderr)
        return EXIT_CONFIG
    if args.deadline is not None:
        if parse_time(args.deadline) is None or not re.search(r"(Z|[+-]\d\d:?\d\d)$", args.deadline.strip()):
            print("nodepool-agent: --deadline must be an RFC 3339 time with Z or an offset", file=sys.stderr)
            return EXIT_CONFIG
        deadline = args.deadline.strip()
    else:
        deadline = rfc3339(time.time() + args.seconds)
    url = args.url or state.server_url
    client = NodeClient(url, timeout=args.timeout, verify=args.ca_bundle or not args.insecure, transport=transport)
    client.credential = state.credential
    try:
        answer = client.preemption_notice(state.node_id, deadline)
    except (ApiError, ServerUnavailable) as exc:
        print(f"nodepool-agent: preemption notice not accepted: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(answer, indent=2))
    return 0


def _set_credential(args) -> int:
    """``nodepool-agent set-credential``: exit 0 taken (saved, or handed to the running agent), 2 refused."""
    try:
        text = sys.stdin.read() if str(args.file) == "-" else args.file.read_text() if args.file else args.credential
        handed = recovery.HandedCredential.parse(text or "")
        outcome = recovery.set_credential(args.state_file, handed, issued_at=rfc3339(time.time()))
    except (OSError, StateError) as exc:
        print(f"nodepool-agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if outcome == "handed":
        print(f"handed to the running agent ({recovery.pending_path(args.state_file)}); it resumes within a second")
    else:
        print(f"saved in {args.state_file}; the agent uses it at its next start")
    return 0


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
        facts["boot_id"] = devices.boot_id()
        facts["devices"] = nvidia.NvidiaProvider().inventory()
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
    if command == "preempt":
        return _preempt(args)
    if command == "set-credential":
        return _set_credential(args)
    return _run(args)
