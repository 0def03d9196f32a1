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

import httpx

from agent import __version__
from agent.backoff import Backoff, jittered

from .faults import Faults
from .shapes import NodeSpec
from .wire import FLAG_ROTATE_CREDENTIAL, Unavailable, VirtualLease, error_code, healthy, parse_time, rfc3339
from .work import Work

log = logging.getLogger("simulator")


class VirtualNode(Faults, Work):
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
        self.device_health = {d["id"]: healthy() for d in self.devices}
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
            self.enroll_error = f"{response.status_code} {error_code(response)}"
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
            code = error_code(response)
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
            code = error_code(response)
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
