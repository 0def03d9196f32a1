"""The agent's loop: enroll, heartbeat, rotate the credential, follow instructions, stop cleanly.

One thread owns the state, the HTTP client and the workloads; the only other thread is the
benchmark's, which hands its result back through a queue. The loop wakes at least every
``tick`` seconds to reap workloads and send queued lease events, and sends a heartbeat when
one is due: after exactly the delay the server asked for (``next_renewal_in`` /
``next_heartbeat_in``: the server already aims each node at its own slot, so the agent adds no
jitter of its own), or after an exponential backoff with a cap while the server does not answer.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import benchmark, conditions, devices, inventory, nvidia, preemption, recovery, repair
from .backoff import Backoff
from .client import ApiError, NodeClient, NodeRetired, ServerUnavailable
from .credentials import Credentials
from .leasework import LeaseWork
from .reporting import Reporting
from .state import AgentState, StateFile
from .times import rfc3339
from .upgrade import Upgrades, current_version
from .workloads import LeaseEvent, Supervisor
from .xid import open_xid_source

log = logging.getLogger("agent")

EXIT_OK, EXIT_CONFIG, EXIT_RETIRED = 0, 2, 3
# The agent stopped to be started again (after an upgrade): the CLI re-executes itself.
EXIT_RESTART = 75


class AgentExit(Exception):
    """Stop the agent with ``code`` (2: configuration or enrollment refused, 3: node retired)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class AgentConfig:
    """Everything the agent is told on its command line (see ``nodepool-agent run --help``).

    Durations are seconds. ``rotate_at_fraction`` is the share of a credential's lifetime after
    which it is rotated (2/3: a 24 h credential is renewed after 16 h, leaving 8 h of retries).
    """

    url: str
    state_path: Path
    bootstrap_token: str = ""
    # Read again at every re-enrollment attempt (agent.recovery): an operator may drop a fresh
    # token naming this node there while the agent waits.
    bootstrap_token_file: Path | None = None
    labels: dict = field(default_factory=dict)
    display_name: str = ""
    hostname: str = ""
    work_dir: Path | None = None
    stop_grace: float = 10.0
    default_interval: float = 10.0
    max_backoff: float = 300.0
    rotate_at_fraction: float = 2 / 3
    thresholds: conditions.Thresholds = field(default_factory=conditions.Thresholds)
    benchmark_cpu_seconds: float = 2.0
    benchmark_memory_bytes: int | None = None
    timeout: float = 10.0
    verify: bool | str = True
    tick: float = 0.5
    # Rolling upgrades: action name -> argv run for an ``upgrade`` instruction; the version file it updates.
    upgrade_actions: dict = field(default_factory=dict)
    version_file: Path | None = None
    # Renew between status reports (docs/heartbeats.md); False sends a full heartbeat every time,
    # as agents did before renewals.
    renewals: bool = True
    # Spot preemption (agent/preemption.py): the instance-metadata URL polled every
    # ``preemption_poll`` seconds, with these request headers; "" polls nothing.
    preemption_url: str = ""
    preemption_headers: dict = field(default_factory=dict)
    preemption_poll: float = 5.0
    # Devices (agent/devices.py): where XID events come from (auto | nvml | kmsg | none) and how
    # long an inventory (nvidia-smi) is reused between status reports, in seconds.
    xid_source: str = "auto"
    device_refresh: float = 30.0
    # Automated repair (agent/repair.py): the operator-configured reboot command (argv); [] refuses.
    repair_reboot_command: list = field(default_factory=list)


class Agent(Credentials, Reporting, LeaseWork, Upgrades):
    """The node agent. Tests inject ``client`` (with an ``httpx.MockTransport``) and the probes."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        client: NodeClient | None = None,
        rng: random.Random | None = None,
        clock=time.time,
        collect_inventory=None,
        measure_conditions=None,
        run_benchmark=None,
        preemption_probe=None,
        device_providers=None,
    ):
        self.config = config
        self.client = client or NodeClient(config.url, timeout=config.timeout, verify=config.verify)
        self.rng = rng or random.Random()
        self.clock = clock
        self.state_file = StateFile(config.state_path)
        self.state = AgentState()
        self.backoff = Backoff(base=1.0, cap=config.max_backoff, rng=self.rng)
        self.collect_inventory = collect_inventory or (lambda: inventory.collect(disk_path=config.thresholds.disk_path))
        self.measure_conditions = measure_conditions or (lambda: conditions.measure(config.thresholds))
        self.run_benchmark = run_benchmark or (
            lambda limits=None: benchmark.run(
                cpu_seconds=config.benchmark_cpu_seconds,
                memory_sample_bytes=config.benchmark_memory_bytes,
                limits=limits,
            )
        )
        work_dir = config.work_dir or config.state_path.parent / "workloads"
        self.supervisor = Supervisor(work_dir=work_dir, grace=config.stop_grace)
        self.interval = config.default_interval  # the renewal interval told (renewal_interval)
        self.next_in: float | None = None  # the delay the last answer asked for (next_renewal_in)
        self.clock_offset = 0.0  # server time - local time, from the last heartbeat answer
        self.rotate_requested = False
        self.outbox: list[LeaseEvent] = []
        self.benchmarks_started: set[str] = set()
        self.benchmark_results: queue.Queue = queue.Queue()
        self.pending_benchmark: tuple[str, dict] | None = None
        self.last_response: dict = {}
        self.heartbeats_applied = 0
        self.restart_requested = False
        self.upgrades_refused: set[tuple[str, str]] = set()
        self.repairs = repair.Repairs(commands={repair.REBOOT: list(config.repair_reboot_command)})
        # Renewals plus status-on-change (docs/heartbeats.md). A server without the renewal
        # endpoint (404/405) gets full heartbeats, as before.
        self.renewals_supported = config.renewals
        self.renewals_applied = 0
        self.report_wanted = True  # the first message of an incarnation is a status report
        self.status_report_interval = 60.0
        self.last_report_at: float | None = None  # time.monotonic() of the last status report answered
        self.reported_fingerprint: tuple | None = None
        self.preemption_probe = preemption_probe
        if preemption_probe is None and config.preemption_url:
            self.preemption_probe = preemption.metadata_probe(config.preemption_url, headers=config.preemption_headers)
        self.next_preemption_poll = 0.0  # time.monotonic()
        self.preemption_deadline: float | None = None  # the reclaim time seen, until the notice is sent
        self.preemption_sent = False
        if device_providers is None:
            device_providers = [nvidia.NvidiaProvider(xid_source=lambda: open_xid_source(config.xid_source))]
        self.devices = devices.DeviceTracker(device_providers, refresh=config.device_refresh)
        self.boot_id = devices.boot_id()
        # Coming back from a refused credential (agent.recovery): the refusal's reason while it
        # lasts, and the bootstrap tokens the server refused for good (never sent again).
        self.refused: str | None = None
        self.refused_tokens: set[str] = set()

    @property
    def version(self) -> str:
        return current_version(self.config.version_file)

    # -- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Lock and load the state file; enroll if there is no identity yet, else begin a new incarnation.

        Raises:
            StateError: state file unreadable, too open, or used by another agent.
            AgentExit: no identity and no bootstrap token, or enrollment refused (4xx).
            ServerUnavailable: enrollment could not reach the server (the caller retries).
        """
        self.state_file.lock()
        self.state = self.state_file.load()
        if self.state.enrolled:
            if self.state.server_url and self.state.server_url != self.client.base:
                log.warning(
                    "state file was enrolled with %s, now talking to %s", self.state.server_url, self.client.base
                )
            self.state.begin_incarnation()
            self.state_file.save(self.state)
            log.info("node %s: incarnation %s", self.state.node_id, self.state.incarnation)
            self.take_handed_credential()
        else:
            self.enroll()
        self.client.credential = self.state.credential
        self._set_workload_env()

    def _set_workload_env(self) -> None:
        self.supervisor.env.update(
            {"NODEPOOL_NODE_ID": self.state.node_id, "NODEPOOL_INCARNATION": str(self.state.incarnation)}
        )

    def enroll_payload(self) -> dict:
        facts = self.collect_inventory()
        return {
            "bootstrap_token": self.config.bootstrap_token,
            "hostname": self.config.hostname or facts["hostname"],
            "display_name": self.config.display_name,
            "addresses": facts["addresses"],
            "agent_version": self.version,
            "labels": self.config.labels,
            "capability": facts["capability"],
            # The device inventory (DEVICES-WIRE.md); XID events wait for the first status report.
            "boot_id": self.boot_id,
            **({"devices": found} if (found := self.devices.inventory()) else {}),
        }

    def enroll(self) -> None:
        if not self.config.bootstrap_token:
            raise AgentExit(EXIT_CONFIG, f"{self.config.state_path} holds no identity and no --bootstrap-token given")
        try:
            answer = self.client.enroll(self.enroll_payload())
        except ApiError as exc:
            raise AgentExit(EXIT_CONFIG, f"enrollment refused: {exc}") from exc
        now = rfc3339(self.clock())
        self.state = AgentState(
            server_url=self.client.base,
            node_id=str(answer["node_id"]),
            credential=answer["credential"],
            credential_expires_at=answer.get("credential_expires_at", ""),
            credential_issued_at=now,
            incarnation=int(answer.get("incarnation", 1)),
            sequence=0,
            enrolled_at=now,
        )
        self.follow(answer, "next_renewal_in")
        if not answer.get("renewal_interval"):  # an older server: its pool's interval
            self.interval = float(answer.get("heartbeat_interval") or self.interval)
        self.state_file.save(self.state)
        log.info("enrolled as node %s (lifecycle %s)", self.state.node_id, answer.get("lifecycle"))

    def start_with_retries(self, stop: threading.Event) -> bool:
        """:meth:`start`, retrying enrollment with backoff while the server is away. False if stopped."""
        while not stop.is_set():
            try:
                self.start()
                return True
            except ServerUnavailable as exc:
                self.state_file.unlock()
                delay = self._failure_delay(exc)
                log.warning("enrollment: server unavailable (%s); retrying in %.1fs", exc, delay)
                stop.wait(delay)
        return False

    def step(self) -> float:
        """Rotate if due, send one renewal or status report, act on the answer. Returns seconds
        until the next step (0 when a flag asked for a status report at once).

        Raises:
            AgentExit: the node was retired (410).
        """
        try:
            if self.rotation_due():
                self.rotate()
            payload = self.heartbeat_payload()
            self.state_file.save(self.state)  # the sequence is spent even if the answer is lost
            if not self.wants_status_report(payload):
                delay = self.renew(payload)
                if delay is not None:
                    return delay
            answer = self.client.heartbeat(self.state.node_id, payload)
            self.devices.reported(payload.get("devices") or [])
            self.last_report_at = time.monotonic()
            self.reported_fingerprint = self.fingerprint(payload)
            self.report_wanted = False
        except NodeRetired as exc:
            raise AgentExit(EXIT_RETIRED, f"node {self.state.node_id} was retired: {exc.detail}") from exc
        except ServerUnavailable as exc:
            delay = self._failure_delay(exc)
            log.warning("control plane unavailable (%s); next attempt in %.1fs", exc, delay)
            return delay
        except ApiError as exc:
            reason = recovery.refusal(exc)
            if reason is not None:
                return self.credential_refused(reason)
            # A 4xx on our payload: not fixed by hammering the server, so back off and say why.
            delay = self.backoff.next_delay()
            log.error("heartbeat refused: %s; next attempt in %.1fs", exc, delay)
            return delay
        self.backoff.reset()
        self.refused = None
        self.handle_answer(answer)
        return self.next_delay()

    def tick(self, until: float | None = None) -> None:
        """Between heartbeats: reap workloads, escalate stops, send events (until ``until``, the
        next heartbeat's ``time.monotonic()``) and benchmark results, watch for a spot preemption."""
        self.outbox.extend(self.supervisor.poll())
        self.flush_events(until)
        self.post_benchmark()
        self.watch_preemption()

    def server_now(self) -> float:
        """The control plane's time as this agent knows it (local clock + the offset answers showed)."""
        return self.clock() + self.clock_offset

    # -- run and stop --------------------------------------------------------------------------
    def run(self, stop: threading.Event, *, once: bool = False) -> int:
        """Run until ``stop`` is set (SIGTERM/SIGINT) or the node is retired. Returns the exit code."""
        try:
            if not self.start_with_retries(stop):
                return EXIT_OK
            next_step = time.monotonic()
            while not stop.is_set():
                if self.restart_requested:
                    return EXIT_RESTART
                if self.refused is not None and self.take_handed_credential():
                    next_step = time.monotonic()  # a credential was handed over: use it now
                if time.monotonic() >= next_step:
                    next_step = time.monotonic() + self.step()
                    if once:
                        self.tick()
                        break
                self.tick(until=next_step)
                stop.wait(max(0.0, min(self.config.tick, next_step - time.monotonic())))
            return EXIT_OK
        except AgentExit as exc:
            log.error("%s", exc)
            return exc.code
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop workloads (SIGTERM, SIGKILL after grace), report them, say not-ready, save state."""
        if self.supervisor.workloads:
            self.outbox.extend(self.supervisor.stop_all("agent shutting down"))
        if self.state.enrolled:
            self.flush_events()
            try:
                self.client.heartbeat(
                    self.state.node_id, self.heartbeat_payload(ready=False, ready_reason="AgentShuttingDown")
                )
            except (ApiError, ServerUnavailable) as exc:
                log.info("final heartbeat not delivered: %s", exc)
            self.state_file.save(self.state)
        self.state_file.unlock()
        self.client.close()
        for provider in self.devices.providers:
            close = getattr(provider, "close", None)
            if close:
                close()
