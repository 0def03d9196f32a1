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
from .state import AgentState, StateError, StateFile
from .times import parse_time, rfc3339
from .upgrade import current_version, run_upgrade
from .workloads import LeaseEvent, Supervisor

log = logging.getLogger("agent")

EXIT_OK, EXIT_CONFIG, EXIT_RETIRED = 0, 2, 3
# The agent stopped to be started again (after an upgrade): the CLI re-executes itself.
EXIT_RESTART = 75
# Instructions that mean "this lease is no longer yours" when a lease event is refused.
# The renewal answer's flags (docs/api-contract.md): any bit but ROTATE_CREDENTIAL means "send a
# status report now": its answer carries the instructions themselves.
FLAG_ROTATE_CREDENTIAL = 16
NOT_OURS = {"stale_fencing_token", "lease_superseded", "stale_incarnation", "lease_ended", "not_found"}


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


class Agent:
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
            device_providers = [nvidia.NvidiaProvider(xid_source=lambda: nvidia.open_xid_source(config.xid_source))]
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

    # -- credential ----------------------------------------------------------------------------
    def rotation_due(self) -> bool:
        """True when the server hinted, or ``rotate_at_fraction`` of the credential's life has passed."""
        if self.rotate_requested:
            return True
        issued, expires = parse_time(self.state.credential_issued_at), parse_time(self.state.credential_expires_at)
        if issued is None or expires is None or expires <= issued:
            return False
        server_now = self.clock() + self.clock_offset
        return server_now >= issued + self.config.rotate_at_fraction * (expires - issued)

    def rotate(self) -> None:
        answer = self.client.rotate_credential(self.state.node_id)
        self.state.credential = answer["credential"]
        self.state.credential_expires_at = answer.get("expires_at", "")
        self.state.credential_issued_at = rfc3339(self.clock() + self.clock_offset)
        self.state_file.save(self.state)  # saved before first use: a crash never loses the new secret
        self.client.credential = self.state.credential
        self.rotate_requested = False
        log.info("credential rotated; expires %s", self.state.credential_expires_at)

    # -- heartbeat -----------------------------------------------------------------------------
    def heartbeat_payload(self, *, ready: bool = True, ready_reason: str = "") -> dict:
        sequence = self.state.next_sequence()
        conditions_now = self.measure_conditions()
        for condition in conditions_now:
            if condition["type"] == "Ready" and not ready:  # the Ready condition says what `ready` says
                condition.update(status="False", reason=ready_reason or "AgentNotReady")
        return {
            "incarnation": self.state.incarnation,
            "sequence": sequence,
            "observed_at": rfc3339(self.clock()),
            "agent_version": self.version,
            "ready": ready,
            "ready_reason": ready_reason,
            "conditions": conditions_now,
            "usage": conditions.usage(),
            "leases": [
                {"lease_id": w.lease_id, "fencing_token": w.fencing_token, "state": "running"}
                for w in self.supervisor.running()
            ],
            "benchmark": None,
            # DEVICES-WIRE.md: a changed boot id tells the server the host rebooted; each device
            # carries its health and the XID events not yet in an answered report.
            "boot_id": self.boot_id,
            **self._devices_part(),
        }

    def _devices_part(self) -> dict:
        devices_now = self.devices.report()
        return {"devices": devices_now} if self.devices.ever_found else {}

    def _failure_delay(self, exc: ServerUnavailable) -> float:
        delay = self.backoff.next_delay()
        if exc.retry_after is not None:
            delay = max(delay, min(exc.retry_after, self.config.max_backoff))
        return delay

    @staticmethod
    def fingerprint(payload: dict) -> tuple:
        """What a status report says that matters for change detection: readiness, each
        condition's status and reason, and the leases run. Usage drifts all the time; it goes
        with the periodic report (at least every ``status_report_interval``)."""
        return (
            payload["ready"],
            payload["ready_reason"],
            tuple(sorted((c["type"], c["status"], c.get("reason", "")) for c in payload["conditions"])),
            tuple(sorted((lease["lease_id"], lease["fencing_token"]) for lease in payload["leases"])),
            devices.DeviceTracker.fingerprint(payload.get("devices") or []),
        )

    def wants_status_report(self, payload: dict) -> bool:
        """A status report when renewals are unavailable, when asked (a flag, a new incarnation),
        when the last one is ``status_report_interval`` old, when an XID event waits, or when the
        observations changed."""
        if not self.renewals_supported or self.report_wanted or self.last_report_at is None:
            return True
        if time.monotonic() - self.last_report_at >= self.status_report_interval:
            return True
        if devices.DeviceTracker.has_unreported_events(payload.get("devices") or []):
            return True  # an XID waits: the server decides device taints from it, now
        return self.fingerprint(payload) != self.reported_fingerprint

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

    def renew(self, payload: dict) -> float | None:
        """Send the renewal of ``payload``'s incarnation and sequence; act on its flags. Returns
        the delay to the next step, or None when the server has no renewals (send the report).

        Raises the client's errors (the caller's ``step`` handles them)."""
        try:
            answer = self.client.renew(
                self.state.node_id, {"incarnation": payload["incarnation"], "sequence": payload["sequence"]}
            )
        except ApiError as exc:
            if exc.status in (404, 405):
                log.warning("the control plane has no renewal endpoint; sending full heartbeats")
                self.renewals_supported = False
                return None
            raise
        self.backoff.reset()
        self.refused = None
        self.follow(answer, "next_renewal_in")
        code = answer.get("code", "applied")
        if answer.get("applied"):
            self.renewals_applied += 1
        elif code in ("stale_incarnation", "stale_sequence"):
            self.state.begin_incarnation()
            self.state_file.save(self.state)
            self._set_workload_env()
            self.report_wanted = True
            log.warning("renewal not applied (%s); now incarnation %s", code, self.state.incarnation)
        flags = int(answer.get("flags") or 0)
        if flags & FLAG_ROTATE_CREDENTIAL:
            self.rotate_requested = True
        if flags & ~FLAG_ROTATE_CREDENTIAL or code == "status_report_required":
            self.report_wanted = True
            return 0.0  # something waits: the status report's answer says what, now
        return self.next_delay()

    # -- coming back from a refused credential (agent.recovery) ---------------------------------
    def credential_refused(self, reason: str) -> float:
        """The server refused the credential (``reason``: revoked, expired, superseded, unknown).

        Re-enrolls at once as the same node when a bootstrap token is at hand (returns 0);
        otherwise logs, once per reason, what an operator can do, and backs off (the delay in
        seconds). A credential handed over meanwhile is taken within a tick (:meth:`run`).
        """
        if self.reenroll():
            return 0.0
        delay = self.backoff.next_delay()
        if reason != self.refused:
            log.error("%s", recovery.advice(reason, self.state.node_id, self.config.state_path))
        self.refused = reason
        log.warning("credential refused (%s); next attempt in %.1fs", reason, delay)
        return delay

    def reenroll(self) -> bool:
        """Re-enroll this node (``"node"``: its id) with the bootstrap token, if any; True on success.

        The server keeps the node's identity and answers a new credential and incarnation, taken
        here (sequence restarts). A token refused for good (403) is remembered and not sent again;
        409 ``node_quarantined`` is retried later (an operator may release the node).
        """
        token = recovery.bootstrap_token(self.config.bootstrap_token, self.config.bootstrap_token_file)
        if not token or token in self.refused_tokens:
            return False
        try:
            answer = self.client.enroll({**self.enroll_payload(), "bootstrap_token": token, "node": self.state.node_id})
        except ServerUnavailable as exc:
            log.warning("re-enrollment: server unavailable (%s)", exc)
            return False
        except ApiError as exc:
            if exc.status == 403:
                self.refused_tokens.add(token)
            log.error("re-enrollment of node %s with the bootstrap token refused: %s", self.state.node_id, exc)
            return False
        self.state.credential = answer["credential"]
        self.state.credential_expires_at = answer.get("credential_expires_at", "")
        self.state.credential_issued_at = rfc3339(self.server_now())
        self.state.incarnation, self.state.sequence = int(answer["incarnation"]), 0
        self.state_file.save(self.state)
        self._credential_back()
        self.follow(answer, "next_renewal_in")
        log.info("re-enrolled as the same node %s (incarnation %s)", self.state.node_id, self.state.incarnation)
        return True

    def take_handed_credential(self) -> bool:
        """Take a credential ``nodepool-agent set-credential`` handed over while this agent runs."""
        try:
            taken = recovery.take_pending(self.state_file, self.state, issued_at=rfc3339(self.server_now()))
        except StateError as exc:
            log.error("the credential handed over was not used: %s", exc)
            return False
        if taken:
            self._credential_back()
            log.info("node %s: took the credential handed over; resuming", self.state.node_id)
        return taken

    def _credential_back(self) -> None:
        self.client.credential = self.state.credential
        self._set_workload_env()
        self.refused = None
        self.report_wanted = True
        self.backoff.reset()

    def follow(self, answer: dict, key: str) -> None:
        """Take the timing of a server answer: ``renewal_interval`` (the interval told) and ``key``
        (``next_renewal_in`` or ``next_heartbeat_in``: the delay to the next message, aimed by the
        server at this node's own slot). An older server sends only the delay: it is the interval too."""
        if answer.get("renewal_interval"):
            self.interval = max(1.0, float(answer["renewal_interval"]))
        if answer.get(key):
            self.next_in = max(1.0, float(answer[key]))
            if not answer.get("renewal_interval"):
                self.interval = self.next_in

    def next_delay(self) -> float:
        """Seconds to the next renewal: what the server asked for, without jitter of our own (the
        server spreads the fleet; an agent-side jitter would only undo its aim)."""
        return self.next_in if self.next_in is not None else self.interval

    def handle_answer(self, answer: dict) -> None:
        """Act on a heartbeat answer: sequence verdict, timing, instructions, assigned leases."""
        self.last_response = answer
        server_time = parse_time(answer.get("server_time"))
        if server_time is not None:
            self.clock_offset = server_time - self.clock()
        self.follow(answer, "next_heartbeat_in")
        if answer.get("status_report_interval"):
            self.status_report_interval = max(self.interval, float(answer["status_report_interval"]))
        code = answer.get("code", "applied")
        if answer.get("applied", True):
            self.heartbeats_applied += 1
        elif code in ("stale_incarnation", "stale_sequence"):
            # The server has seen a later session of this identity (a restored state file): start
            # a new incarnation rather than keep sending heartbeats it will ignore.
            self.state.begin_incarnation()
            self.state_file.save(self.state)
            self._set_workload_env()
            self.report_wanted = True
            log.warning("heartbeat not applied (%s); now incarnation %s", code, self.state.incarnation)
        instructions = answer.get("instructions") or {}
        for lease_id in instructions.get("stop_leases") or []:
            self.supervisor.stop(str(lease_id), "stop instruction")
        for lease_id in instructions.get("checkpoint_leases") or []:
            event = self.supervisor.checkpoint(str(lease_id))
            if event:
                self.outbox.append(event)
        if instructions.get("run_benchmark"):
            self.begin_benchmark(instructions["run_benchmark"])
        if instructions.get("rotate_credential"):
            self.rotate_requested = True
        if instructions.get("upgrade"):
            self.upgrade(instructions["upgrade"])
        if instructions.get("repair") and not self.restart_requested:
            self.restart_requested = repair.handle(self.repairs, instructions["repair"])
        if "leases" in answer:
            self.reconcile_leases(answer.get("leases") or [])

    def upgrade(self, instruction: dict) -> None:
        """Run the configured command for the instruction's action; on success, restart.

        A refused or failed upgrade is not retried for the same (upgrade, version): the control
        plane's node timeout fails the node, and the operator sees why in the agent's log.
        """
        key = (str(instruction.get("upgrade_id", "")), str(instruction.get("version", "")))
        if key in self.upgrades_refused or self.restart_requested:
            return
        result = run_upgrade(instruction, actions=self.config.upgrade_actions, version=self.version)
        if result.ok and result.ran:
            log.info("%s; restarting", result.detail)
            self.restart_requested = True
        elif not result.ok:
            log.error("upgrade to %s not done: %s", key[1], result.detail)
            self.upgrades_refused.add(key)

    def reconcile_leases(self, assigned: list[dict]) -> None:
        """Start assigned leases that carry a command; stop local work no longer assigned here."""
        assigned_ids = {}
        for lease in assigned:
            lease_id = str(lease.get("lease_id", ""))
            token = int(lease.get("fencing_token") or 0)
            assigned_ids[lease_id] = token
            local = self.supervisor.workloads.get(lease_id)
            if local and token > local.fencing_token:
                self.supervisor.stop(lease_id, f"superseded by fencing token {token}")
                continue
            command = lease.get("command")
            secret = lease.get("lease_secret") if isinstance(lease.get("lease_secret"), str) else ""
            if local:
                self.supervisor.refresh_secret(lease_id, secret)
            if not command or local or lease_id in self.supervisor.finished:
                continue
            lease_devices = lease.get("devices") if isinstance(lease.get("devices"), list) else []
            self.outbox.append(self.supervisor.start(lease_id, token, command, secret=secret, devices=lease_devices))
        for w in self.supervisor.running():
            if w.lease_id not in assigned_ids:
                self.supervisor.stop(w.lease_id, "lease no longer assigned to this node")

    # -- benchmark -----------------------------------------------------------------------------
    def begin_benchmark(self, request: dict) -> None:
        nonce = str(request.get("nonce", ""))
        if not nonce or nonce in self.benchmarks_started:
            return
        self.benchmarks_started.add(nonce)

        # A re-verification of a busy node sends limits (its free capacity): measure no more than that.
        limits = request.get("limits") if isinstance(request.get("limits"), dict) else None

        def work():
            try:
                result = self.run_benchmark(limits=limits) if limits else self.run_benchmark()
                self.benchmark_results.put((nonce, result))
            except Exception as exc:  # a failed measurement is reported, never invented
                log.exception("benchmark %s failed", nonce)
                self.benchmark_results.put((nonce, {"error": str(exc)}))

        threading.Thread(target=work, name=f"benchmark-{nonce[:8]}", daemon=True).start()
        log.info("benchmark %s started (deadline %s)", nonce, request.get("deadline"))

    def post_benchmark(self) -> None:
        if self.pending_benchmark is None:
            try:
                self.pending_benchmark = self.benchmark_results.get_nowait()
            except queue.Empty:
                return
        nonce, result = self.pending_benchmark
        if "error" in result:
            self.pending_benchmark = None
            return
        try:
            self.client.post_benchmark(self.state.node_id, nonce, result)
            log.info("benchmark %s posted: %s mCPU, %s bytes", nonce, result["cpu_millicores"], result["memory_bytes"])
        except ServerUnavailable:
            return  # keep it; retried on the next tick
        except ApiError as exc:
            log.warning("benchmark %s refused: %s", nonce, exc)
        self.pending_benchmark = None

    # -- lease events --------------------------------------------------------------------------
    def flush_events(self, until: float | None = None) -> None:
        """Send queued lease events in order; stop work whose lease the server says is not ours.

        ``until`` (``time.monotonic()`` seconds): stop sending when it is reached and keep the rest
        for the next tick, so that a long backlog (after a partition, or paced by the proxy's
        per-node bucket, deploy/nginx) never holds back the renewal that keeps this node alive.
        """
        while self.outbox:
            if until is not None and time.monotonic() >= until:
                return
            event = self.outbox[0]
            body = {
                "fencing_token": event.fencing_token,
                "node_incarnation": self.state.incarnation,
                "state": event.state,
                "message": event.message[:500],
            }
            try:
                self.client.lease_event(event.lease_id, body)
            except ServerUnavailable:
                return
            except ApiError as exc:
                # Only the answers that mean "not yours": another 409 (say, a transition the server
                # does not take) must not kill work that is still this node's.
                if exc.code in NOT_OURS or exc.status in (404, 410):
                    # Expected after a revocation, a drain or a restart: the lease ended or moved
                    # on; the work stops and there is nothing for the operator to look at.
                    self.supervisor.stop(event.lease_id, f"lease is not ours: {exc.code}")
                    log.info("lease %s event %s: the lease is no longer this node's (%s)", event.lease_id,
                             event.state, exc.code)  # fmt: skip
                else:
                    log.warning("lease %s event %s refused: %s", event.lease_id, event.state, exc)
            self.outbox.pop(0)

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

    def watch_preemption(self) -> None:
        """Poll the preemption probe (every ``preemption_poll`` s) and send the notice once.

        A notice the server refuses (409 ``pool_not_spot``, 422 ``deadline_out_of_range``: the reclaim
        time already passed) is logged and not sent again; an unreachable server is retried at the
        next poll with the same deadline.
        """
        if self.preemption_probe is None or self.preemption_sent or not self.state.enrolled:
            return
        if time.monotonic() < self.next_preemption_poll:
            return
        self.next_preemption_poll = time.monotonic() + self.config.preemption_poll
        if self.preemption_deadline is None:
            self.preemption_deadline = self.preemption_probe(self.server_now())
            if self.preemption_deadline is None:
                return
            log.warning("spot preemption announced for %s", rfc3339(self.preemption_deadline))
        try:
            self.client.preemption_notice(self.state.node_id, rfc3339(self.preemption_deadline))
        except ServerUnavailable as exc:
            log.warning("preemption notice not delivered (%s); retrying in %.0fs", exc, self.config.preemption_poll)
            return
        except ApiError as exc:
            log.error("preemption notice refused: %s", exc)
        self.preemption_sent = True

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
