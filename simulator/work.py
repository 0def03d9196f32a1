"""A virtual node's work: the leases it is assigned (``sleep N`` commands complete, others run until
stopped), their lease events, benchmarks and credential rotation. A mixin of
:class:`simulator.node.VirtualNode` (split from simulator/node.py, issue 28 step 8).
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from agent.devices import lease_environment

from .wire import LEASE_EVENT_ATTEMPTS, NOT_OURS, Unavailable, VirtualLease, error_code, parse_time, sleep_seconds

log = logging.getLogger("simulator")


class Work:
    """Assigned leases, lease events, benchmarks and the credential (part of ``VirtualNode``)."""

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
            seconds = sleep_seconds(command)
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
        if response.status_code in (404, 410) or (response.status_code == 409 and error_code(response) in NOT_OURS):
            self.leases.pop(lease.lease_id, None)

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
