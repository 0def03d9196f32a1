"""One virtual node: enrollment, renewals and status reports, instructions and its faults, over a
shared AsyncClient.

Like the agent (docs/heartbeats.md): a status report first and whenever the node's leases change,
a flag asks, or ``status_report_interval`` has passed; a renewal (``POST /nodes/{id}/renewals``)
otherwise. A control plane without renewals (404/405) gets full heartbeats every time.

Faults are plain attributes that the fleet (or a test) sets at any time; the heartbeat loop
reads them at each beat:

* ``partitioned`` — silence: no request leaves the node (its leases are not reported);
* ``restart()`` — a new incarnation, sequence back to 0, running work gone;
* ``clock_skew`` — seconds added to ``observed_at``;
* ``duplicate_next`` — the next N heartbeats are sent twice with the same sequence;
* ``reorder_next`` — the next N pairs of heartbeats are sent later one first;
* ``impossible`` — declared at enrollment: absurd capacity;
* ``benchmark_factor`` — benchmarks answer declared × factor (< 1: declared but not confirmed; set
  after admission, a machine "swapped" for weaker hardware, which re-verification deverifies);
* ``broken_upgrade`` — an ``upgrade`` instruction restarts the node but the new version does
  not take (it comes back with the old one, so admission refuses the target);
* ``inject_xid(device, xid)`` — a GPU reports an XID: the next beat is a status report carrying
  it in that device's ``health.xid_events`` (DEVICES-WIRE.md), as the agent's would;
* ``set_device_health(device, ecc_uncorrectable=2, ...)`` — a GPU's health flags change;
* ``reboot()`` — the host reboots: a new ``boot_id``, a new incarnation, healthy devices.
* ``not_ready`` — the node reports ``Ready=False`` (and not ready) until a repair reboot cures
  it; ``reboot_cures`` False keeps it failing after the reboot (a repair then escalates).

A node of a GPU shape reports its devices (``NodeSpec.devices``: ids, models, NVLink islands) in
every status report, and records the devices each lease was given
(``VirtualLease.devices``; ``counters["device_double_assigned"]`` counts a device handed to two
running leases at once, which must stay 0).

An ``upgrade`` instruction (docs/pool-operations.md) is carried out as the real agent does it:
the node restarts (a new incarnation, its work gone) running the instructed version. A node
already at that version ignores it. A ``repair`` instruction (a pool's repair rule) is carried
out once per repair as an agent with ``--repair-reboot-command`` does: the host reboots
(``counters["repair_reboots"]``). :meth:`VirtualNode.preemption_notice` sends a spot
preemption notice, as a node's agent does when its cloud announces a reclaim.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx

from agent import __version__
from agent.backoff import Backoff, jittered
from agent.devices import MAX_XID_EVENTS, lease_environment

from .shapes import NodeSpec

log = logging.getLogger("simulator")
# Renewal flags (fleet.instructions): any bit but ROTATE_CREDENTIAL asks for a status report.
FLAG_ROTATE_CREDENTIAL = 16
# Lease event refusals that mean "this lease is not yours any more" (docs/api-contract.md).
NOT_OURS = {"stale_fencing_token", "lease_superseded", "stale_incarnation", "lease_ended", "not_found"}


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def parse_time(value) -> float | None:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp() if value else None
    except ValueError:
        return None


@dataclass
class VirtualLease:
    lease_id: str
    fencing_token: int
    command: list
    ends_at: float | None  # loop time when a ``sleep N`` command completes; None runs until stopped
    devices: tuple = ()  # the device ids the lease was given, in its order
    env: dict | None = None  # what the agent would set: CUDA_VISIBLE_DEVICES, NODEPOOL_DEVICES...


class Unavailable(Exception):
    pass


LEASE_EVENT_ATTEMPTS = 4  # a lease event is sent again after 0.5, 1 and 2 s (capped by max_backoff)


class VirtualNode:
    """A simulated machine. ``spec`` is what it declares; the rest is its session and faults."""

    def __init__(
        self,
        spec: NodeSpec,
        *,
        rng: random.Random | None = None,
        max_backoff: float = 60.0,
        gate: asyncio.Semaphore | None = None,
    ):
        self.spec = spec
        self.gate = gate  # shared by the fleet: requests in flight at once
        self.name = spec.name
        self.rng = rng or random.Random(spec.name)
        self.node_id = ""
        self.credential = ""
        self.credential_issued_at: float | None = None
        self.credential_expires_at: float | None = None
        self.incarnation = 0
        self.sequence = 0
        self.interval = 10.0  # the renewal interval told (renewal_interval)
        self.next_in: float | None = None  # the delay the last answer asked for
        self.clock_offset = 0.0
        self.rotate_requested = False
        self.renewals_supported = True
        self.report_wanted = True
        self.status_report_interval = 60.0
        self.last_report_at: float | None = None
        self.reported_leases: tuple = ()
        self.backoff = Backoff(base=1.0, cap=max_backoff, rng=self.rng)
        # Faults.
        self.partitioned = False
        self.clock_skew = 0.0
        self.duplicate_next = 0
        self.reorder_next = 0
        self.impossible = False
        self.benchmark_factor = 1.0
        self.broken_upgrade = False
        self.upgrades_done: set[tuple[str, str]] = set()
        self.not_ready = False
        self.reboot_cures = True
        self.repairs_done: set[str] = set()
        self.agent_version = spec.agent_version or __version__
        # What the control plane said and what the node did.
        self.lifecycle = ""
        self.liveness = ""
        self.leases: dict[str, VirtualLease] = {}
        self.finished: set[str] = set()
        self.benchmarks: dict[str, dict] = {}
        self.counters: Counter = Counter()
        self.enroll_error = ""
        self._tasks: set[asyncio.Task] = set()
        # Devices: what the node has, their health, XID events not yet in an answered report.
        self.reboots = 0
        self.devices = spec.devices()
        self.device_health = {d["id"]: _healthy() for d in self.devices}
        self.pending_xids: dict[str, list[dict]] = {}
        self.reported_health: tuple = ()

    @property
    def enrolled(self) -> bool:
        return bool(self.node_id)

    @property
    def boot_id(self) -> str:
        """Stable for a name until :meth:`reboot` (the agent reads /proc/sys/kernel/random/boot_id)."""
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"nodepool-simulator/{self.name}/boot/{self.reboots}"))

    # -- HTTP ----------------------------------------------------------------------------------
    async def _post(self, client: httpx.AsyncClient, path: str, body: dict, *, auth: bool = True) -> httpx.Response:
        headers = {"Authorization": f"Node {self.credential}"} if auth else {}
        try:
            # Wait here, not in httpcore's connection pool: with httpcore 1.0.9, requests that
            # time out (are cancelled) while queued for a pooled connection can leak the pool's
            # slots until every request fails (encode/httpcore#1093). The gate is smaller than
            # the pool, and a non-streaming post has released its connection when it returns.
            async with self.gate or contextlib.nullcontext():
                response = await client.post(path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            self.counters["transport_error"] += 1
            raise Unavailable(str(exc)) from exc
        if response.status_code == 429 or response.status_code >= 500:
            self.counters[f"http_{response.status_code}"] += 1
            raise Unavailable(f"HTTP {response.status_code}")
        return response

    async def enroll(self, client: httpx.AsyncClient) -> bool:
        """``POST /node-enrollments``. True on success; ``enroll_error`` says why not (4xx).

        Raises:
            Unavailable: the server did not answer (the fleet retries).
        """
        body = {
            "bootstrap_token": self.spec.bootstrap_token,
            "hostname": self.spec.name,
            "display_name": "",
            "addresses": [self.spec.address],
            "agent_version": self.agent_version,
            "labels": self.spec.labels,
            "capability": self.spec.capability(impossible=self.impossible),
            # As the agent does: the devices are known from enrollment on, so admission verifies them.
            "boot_id": self.boot_id,
            **({"devices": self.enrollment_devices()} if self.devices else {}),
        }
        response = await self._post(client, "/node-enrollments", body, auth=False)
        if response.status_code != 201:
            self.enroll_error = f"{response.status_code} {_code(response)}"
            self.counters["enroll_refused"] += 1
            return False
        answer = response.json()
        self.node_id = str(answer["node_id"])
        self.credential = answer["credential"]
        self.credential_issued_at = time.time()
        self.credential_expires_at = parse_time(answer.get("credential_expires_at"))
        self.incarnation = int(answer.get("incarnation", 1))
        self.sequence = 0
        self.follow(answer, "next_renewal_in")
        if not answer.get("renewal_interval"):  # an older server: its pool's interval
            self.interval = float(answer.get("heartbeat_interval") or self.interval)
        self.lifecycle = answer.get("lifecycle", "")
        self.enroll_error = ""
        return True

    # -- faults --------------------------------------------------------------------------------
    def restart(self) -> None:
        """The agent restarted: a new incarnation, sequence from 0, its running work died with it."""
        self.incarnation += 1
        self.sequence = 0
        self.report_wanted = True
        self.leases.clear()
        for task in list(self._tasks):
            task.cancel()
        self.counters["restarts"] += 1

    def reboot(self) -> None:
        """The host rebooted: a new boot id, the agent restarts, devices come back healthy."""
        self.reboots += 1
        self.pending_xids.clear()
        self.device_health = {d["id"]: _healthy() for d in self.devices}
        self.restart()

    def device_id(self, device: int | str) -> str:
        """The id of ``device`` (an index on this node, or an id). Raises KeyError if unknown."""
        for d in self.devices:
            if device in (d["index"], d["id"]) or str(device) == str(d["index"]):
                return d["id"]
        raise KeyError(f"{self.name} has no device {device!r}")

    def inject_xid(self, device: int | str, xid: int, message: str = "") -> str:
        """``device`` reports Xid ``xid``; the next beat is a status report carrying it. Returns its id."""
        device_id = self.device_id(device)
        queue = self.pending_xids.setdefault(device_id, [])
        queue.append({"xid": int(xid), "at": rfc3339(time.time() + self.clock_skew), "message": message or "simulated"})
        del queue[:-MAX_XID_EVENTS]
        self.counters["xids_injected"] += 1
        return device_id

    def set_device_health(self, device: int | str, **flags) -> str:
        """Change ``device``'s health (``ecc_uncorrectable``, ``retired_pages_pending``,
        ``remapped_rows_failure``, ``thermal_throttle``, ``power_throttle``). Returns its id."""
        device_id = self.device_id(device)
        unknown = set(flags) - set(_healthy())
        if unknown:
            raise ValueError(f"unknown health fields: {sorted(unknown)}")
        self.device_health[device_id].update(flags)
        return device_id

    def devices_body(self) -> list[dict]:
        """The devices of a status report: each with its health and its unreported XID events."""
        return [
            {
                **d,
                "health": {**self.device_health[d["id"]], "xid_events": list(self.pending_xids.get(d["id"], []))},
            }
            for d in self.devices
        ]

    def enrollment_devices(self) -> list[dict]:
        """The device inventory of the enrollment body (health without XID events)."""
        return [{**d, "health": dict(self.device_health[d["id"]])} for d in self.devices]

    def _health_fingerprint(self) -> tuple:
        return tuple(sorted((i, tuple(sorted(h.items()))) for i, h in self.device_health.items()))

    def upgrade(self, instruction: dict) -> bool:
        """Carry out an ``upgrade`` instruction: restart running ``version`` (unless already there).

        With ``broken_upgrade`` the restart happens but the version stays (a failed upgrade).
        Returns True when the node restarted.
        """
        version = str(instruction.get("version") or "")
        key = (str(instruction.get("upgrade_id") or ""), version)
        if not version or version == self.agent_version or key in self.upgrades_done:
            return False
        self.upgrades_done.add(key)  # once per instruction, as the agent does (a failed one is not retried)
        if not self.broken_upgrade:
            self.agent_version = version
        self.counters["upgrades"] += 1
        self.restart()
        return True

    def repair(self, instruction: dict) -> bool:
        """Carry out a ``repair`` instruction (``{"repair_id", "action": "reboot"}``): the host
        reboots, once per repair; the reboot cures ``not_ready`` unless ``reboot_cures`` is off.
        Returns True when the node rebooted."""
        repair_id = str(instruction.get("repair_id") or "")
        if instruction.get("action") != "reboot" or not repair_id or repair_id in self.repairs_done:
            return False
        self.repairs_done.add(repair_id)
        self.counters["repair_reboots"] += 1
        if self.reboot_cures:
            self.not_ready = False
        self.reboot()
        return True

    async def preemption_notice(self, client: httpx.AsyncClient, seconds: float) -> int:
        """Tell the control plane this (spot) machine goes away in ``seconds``; returns the HTTP status."""
        body = {"deadline": rfc3339(time.time() + self.clock_offset + seconds)}
        response = await self._post(client, f"/nodes/{self.node_id}/preemption-notice", body)
        self.counters[f"preemption_notice_{response.status_code}"] += 1
        return response.status_code

    # -- heartbeats ----------------------------------------------------------------------------
    def heartbeat_body(self) -> dict:
        self.sequence += 1
        ready = not self.not_ready and not any(
            c["status"] == "True" for c in self._conditions() if c["type"] != "Ready"
        )
        return {
            "incarnation": self.incarnation,
            "sequence": self.sequence,
            "observed_at": rfc3339(time.time() + self.clock_skew),
            "agent_version": self.agent_version,
            "ready": ready,
            "ready_reason": "",
            "conditions": self._conditions(),
            "usage": {"cpu": int(self.spec.cpu * 1000 * 0.1 * len(self.leases)), "memory": self.spec.memory // 8},
            "leases": [
                {"lease_id": lease.lease_id, "fencing_token": lease.fencing_token, "state": "running"}
                for lease in self.leases.values()
            ],
            "benchmark": None,
            "boot_id": self.boot_id,
            **({"devices": self.devices_body()} if self.devices else {}),
        }

    def _conditions(self) -> list[dict]:
        ok = {"status": "False", "reason": "", "message": "simulated"}
        return [
            {
                "type": "Ready",
                "status": "False" if self.not_ready else "True",
                "reason": "SimulatedNotReady" if self.not_ready else "AgentReady",
                "message": "simulated",
            },
            {"type": "MemoryPressure", **ok},
            {"type": "DiskPressure", **ok},
            {"type": "PIDPressure", **ok},
        ]

    async def beat(self, client: httpx.AsyncClient) -> float:
        """Send one heartbeat (or two, for duplicate/reorder faults) and act on the answers.

        Returns seconds until the next beat (the delay the server asked for, aimed at this node's
        slot, without jitter of its own; or a backoff).
        """
        if self.partitioned:
            self.counters["silenced"] += 1
            return jittered(self.interval, rng=self.rng)
        try:
            if self._rotation_due():
                await self.rotate(client)
            if not self._wants_status_report():
                delay = await self.renew(client)
                if delay is not None:
                    self.backoff.reset()
                    return delay
            bodies = [self.heartbeat_body()]
            if self.reorder_next > 0:
                self.reorder_next -= 1
                bodies = [self.heartbeat_body(), bodies[0]]  # sequence n+1 first, then n
                self.counters["reordered"] += 1
            elif self.duplicate_next > 0:
                self.duplicate_next -= 1
                bodies.append(dict(bodies[0]))
                self.counters["duplicated"] += 1
            # This beat is the wanted report; what its answers start (an upgrade's restart) may
            # want another, and no later answer of the same beat may take that back.
            self.report_wanted = False
            try:
                for body in bodies:
                    response = await self._post(client, f"/nodes/{self.node_id}/heartbeats", body)
                    await self._handle(client, response)
            except Unavailable:
                self.report_wanted = True  # not delivered: send it again after the backoff
                raise
            self.last_report_at = time.monotonic()
            self._reported_devices(bodies[0].get("devices") or [])
            # What the report said, not what its answer started: newly assigned work is a change.
            self.reported_leases = tuple(sorted(lease["lease_id"] for lease in bodies[0]["leases"]))
        except Unavailable:
            return self.backoff.next_delay()
        self.backoff.reset()
        return self.next_delay()

    def follow(self, answer: dict, key: str) -> None:
        """Take ``renewal_interval`` (the interval told) and ``key`` (the delay asked for) from an answer;
        an older server sends only the delay, which is then the interval too (as the agent does)."""
        if answer.get("renewal_interval"):
            self.interval = max(0.01, float(answer["renewal_interval"]))
        if answer.get(key):
            self.next_in = max(0.01, float(answer[key]))
            if not answer.get("renewal_interval"):
                self.interval = self.next_in

    def next_delay(self) -> float:
        return self.next_in if self.next_in is not None else self.interval

    def _reported_devices(self, devices: list[dict]) -> None:
        """A report carrying ``devices`` was answered: their XID events are not pending any more."""
        for device in devices:
            sent = len(device["health"]["xid_events"])
            queue = self.pending_xids.get(device["id"])
            if queue and sent:
                del queue[:sent]
                if not queue:
                    del self.pending_xids[device["id"]]
        self.reported_health = self._health_fingerprint()

    def _wants_status_report(self) -> bool:
        if not self.renewals_supported or self.report_wanted or self.last_report_at is None:
            return True
        if self.pending_xids or self._health_fingerprint() != self.reported_health:
            return True  # device health changed: the server decides device taints from it
        if self.reorder_next or self.duplicate_next:  # those faults are about status reports
            return True
        if time.monotonic() - self.last_report_at >= self.status_report_interval:
            return True
        return tuple(sorted(self.leases)) != self.reported_leases

    async def renew(self, client: httpx.AsyncClient) -> float | None:
        """One renewal; the delay to the next beat, or None when the server has no renewals."""
        self.sequence += 1
        body = {"incarnation": self.incarnation, "sequence": self.sequence}
        response = await self._post(client, f"/nodes/{self.node_id}/renewals", body)
        if response.status_code in (404, 405):
            self.renewals_supported = False
            self.sequence -= 1  # not applied: the status report takes the number
            return None
        if response.status_code != 200:
            code = _code(response)
            self.counters[f"refused_{code}"] += 1
            if code == "node_retired":
                self.lifecycle = "retired"
            raise Unavailable(code)
        answer = response.json()
        self.counters[f"renewal_{answer.get('code', 'applied')}"] += 1
        self.follow(answer, "next_renewal_in")
        flags = int(answer.get("flags") or 0)
        if flags & FLAG_ROTATE_CREDENTIAL:
            self.rotate_requested = True
        if flags & ~FLAG_ROTATE_CREDENTIAL or answer.get("code") in (
            "status_report_required", "stale_sequence", "stale_incarnation",
        ):  # fmt: skip
            self.report_wanted = True
            return 0.01  # what waits comes with the status report: send it now
        return self.next_delay()

    async def _handle(self, client: httpx.AsyncClient, response: httpx.Response) -> None:
        if response.status_code != 200:
            code = _code(response)
            self.counters[f"refused_{code}"] += 1
            if code == "node_retired":
                self.lifecycle = "retired"
            raise Unavailable(code)  # back off: a refused node must not hammer the server
        answer = response.json()
        self.counters[f"verdict_{answer.get('code', 'applied')}"] += 1
        server_time = parse_time(answer.get("server_time"))
        if server_time is not None:
            self.clock_offset = server_time - time.time()
        self.follow(answer, "next_heartbeat_in")
        if answer.get("status_report_interval"):
            self.status_report_interval = max(self.interval, float(answer["status_report_interval"]))
        self.lifecycle = answer.get("lifecycle", self.lifecycle)
        self.liveness = answer.get("liveness", self.liveness)
        if not answer.get("applied", True):
            return
        instructions = answer.get("instructions") or {}
        for lease_id in instructions.get("stop_leases") or []:
            await self._end_lease(client, str(lease_id), "failed", "stopped on instruction")
        for lease_id in instructions.get("checkpoint_leases") or []:
            lease = self.leases.get(str(lease_id))
            if lease:
                await self._event(client, lease, "checkpointed", "simulated checkpoint")
        if instructions.get("run_benchmark"):
            self._spawn(self._benchmark(client, instructions["run_benchmark"]))
        if instructions.get("rotate_credential"):
            self.rotate_requested = True
        if instructions.get("upgrade"):
            self.upgrade(instructions["upgrade"])
            return  # a new process: what the old one was told about leases no longer applies
        if instructions.get("repair") and self.repair(instructions["repair"]):
            return  # rebooted: a new process
        if "leases" in answer:
            await self._reconcile(client, answer.get("leases") or [])

    # -- leases --------------------------------------------------------------------------------
    async def _reconcile(self, client: httpx.AsyncClient, assigned: list[dict]) -> None:
        loop = asyncio.get_running_loop()
        ids = {str(entry.get("lease_id")) for entry in assigned}
        for lease_id in list(self.leases):
            if lease_id not in ids:
                self.leases.pop(lease_id)  # not ours any more: stop, nothing to report
                self.counters["leases_dropped"] += 1
        for entry in assigned:
            lease_id = str(entry.get("lease_id"))
            command = entry.get("command")
            if not command or lease_id in self.leases or lease_id in self.finished:
                continue
            seconds = _sleep_seconds(command)
            given = [d for d in entry.get("devices") or [] if isinstance(d, dict)]
            lease = VirtualLease(
                lease_id,
                int(entry.get("fencing_token") or 0),
                list(command),
                loop.time() + seconds if seconds is not None else None,
                devices=tuple(str(d.get("id")) for d in given),
                env=lease_environment(given),
            )
            self._check_devices(lease)
            self.leases[lease_id] = lease
            await self._event(client, lease, "running", "simulated")
            if lease.ends_at is not None:
                self._spawn(self._finish_later(client, lease))

    def _check_devices(self, lease: VirtualLease) -> None:
        """Count what must never happen: a device given to two running leases, or not ours."""
        mine = {d["id"] for d in self.devices}
        held = {device for other in self.leases.values() if other is not lease for device in other.devices}
        for device in lease.devices:
            if device in held:
                self.counters["device_double_assigned"] += 1
                log.error("%s: device %s given to lease %s while another lease holds it", self.name, device, lease)
            if device not in mine:
                self.counters["device_unknown"] += 1

    async def _finish_later(self, client: httpx.AsyncClient, lease: VirtualLease) -> None:
        await asyncio.sleep(max(0.0, lease.ends_at - asyncio.get_running_loop().time()))
        if self.leases.get(lease.lease_id) is lease and not self.partitioned:
            await self._end_lease(client, lease.lease_id, "succeeded", "exit 0")

    async def _end_lease(self, client: httpx.AsyncClient, lease_id: str, state: str, message: str) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return
        self.finished.add(lease_id)
        await self._event(client, lease, state, message)

    async def _event(self, client: httpx.AsyncClient, lease: VirtualLease, state: str, message: str) -> None:
        body = {
            "fencing_token": lease.fencing_token,
            "node_incarnation": self.incarnation,
            "state": state,
            "message": message,
        }
        # A lease's end or checkpoint is reported until the server takes it (a few tries, backing
        # off): a 503 (a deadlock retried by the client, a restart) must not lose it, or the work
        # waits for the drain deadline instead of moving at once.
        for attempt in range(LEASE_EVENT_ATTEMPTS):
            try:
                response = await self._post(client, f"/node-leases/{lease.lease_id}/events", body)
                break
            except Unavailable:
                if attempt == LEASE_EVENT_ATTEMPTS - 1:
                    return
                await asyncio.sleep(min(self.backoff.cap, 0.5 * 2**attempt))
        self.counters[f"lease_{state}_{response.status_code}"] += 1
        if response.status_code in (404, 410) or (response.status_code == 409 and _code(response) in NOT_OURS):
            self.leases.pop(lease.lease_id, None)

    # -- benchmark and credential --------------------------------------------------------------
    async def _benchmark(self, client: httpx.AsyncClient, request: dict) -> None:
        nonce = str(request.get("nonce", ""))
        if not nonce or nonce in self.benchmarks:
            return
        duration = self.rng.uniform(0.2, 1.0)
        noise = self.rng.uniform(0.95, 1.0)
        # A re-verification of a busy node sends ``limits`` (its free capacity): the benchmark
        # measures at most that much, as the real agent does, and never what leases are using.
        limits = request.get("limits") or {}
        cpu = min(self.spec.cpu * 1000, limits.get("cpu", self.spec.cpu * 1000))
        memory = min(self.spec.memory, limits.get("memory", self.spec.memory))
        result = {
            "cpu_millicores": int(cpu * noise * self.benchmark_factor),
            "memory_bytes": int(memory * noise * self.benchmark_factor),
            "duration_seconds": round(duration, 3),
            "details": {"simulated": True, "factor": self.benchmark_factor},
        }
        self.benchmarks[nonce] = result
        await asyncio.sleep(duration)
        try:
            response = await self._post(client, f"/nodes/{self.node_id}/benchmarks/{nonce}", result)
            self.counters[f"benchmark_{response.status_code}"] += 1
        except Unavailable:
            self.counters["benchmark_undelivered"] += 1

    def _rotation_due(self) -> bool:
        if self.rotate_requested:
            return True
        issued, expires = self.credential_issued_at, self.credential_expires_at
        if issued is None or expires is None or expires <= issued:
            return False
        return time.time() + self.clock_offset >= issued + (expires - issued) * 2 / 3

    async def rotate(self, client: httpx.AsyncClient) -> None:
        response = await self._post(client, f"/nodes/{self.node_id}/credentials/rotate", {})
        if response.status_code == 201:
            answer = response.json()
            self.credential = answer["credential"]
            self.credential_issued_at = time.time() + self.clock_offset
            self.credential_expires_at = parse_time(answer.get("expires_at"))
            self.counters["rotations"] += 1
        else:
            self.counters[f"rotation_{response.status_code}"] += 1
        self.rotate_requested = False

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "node_id": self.node_id,
            "pool": self.spec.pool,
            "zone": self.spec.zone,
            "shape": self.spec.shape,
            "incarnation": self.incarnation,
            "sequence": self.sequence,
            "agent_version": self.agent_version,
            "lifecycle": self.lifecycle,
            "liveness": self.liveness,
            "leases": sorted(self.leases),
            "faults": {
                k: v
                for k, v in {
                    "partitioned": self.partitioned,
                    "clock_skew": self.clock_skew,
                    "impossible": self.impossible,
                    "benchmark_factor": self.benchmark_factor if self.benchmark_factor != 1.0 else None,
                    "pending_xids": {i: [e["xid"] for e in q] for i, q in self.pending_xids.items()},
                }.items()
                if v
            },
            "boot_id": self.boot_id,
            "devices": [d["id"] for d in self.devices],
            "lease_devices": {lease.lease_id: list(lease.devices) for lease in self.leases.values() if lease.devices},
        }


def _healthy() -> dict:
    return {
        "ecc_uncorrectable": 0,
        "retired_pages_pending": False,
        "remapped_rows_failure": False,
        "thermal_throttle": False,
        "power_throttle": False,
    }


def _code(response: httpx.Response) -> str:
    try:
        return str(response.json().get("code") or f"http_{response.status_code}")
    except ValueError:
        return f"http_{response.status_code}"


def _sleep_seconds(command: list) -> float | None:
    """A ``["sleep", "N"]`` command completes after N seconds; anything else runs until stopped."""
    if len(command) == 2 and str(command[0]).rsplit("/", 1)[-1] == "sleep":
        try:
            return max(0.0, float(command[1]))
        except ValueError:
            return None
    return None
