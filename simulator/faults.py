"""A virtual node's faults and the instructions that act on the host: restarts and reboots, a GPU's
XID events and health flags, upgrades, repairs and spot preemption notices (simulator/node.py's
docstring lists every fault). A mixin of :class:`simulator.node.VirtualNode` (split from
simulator/node.py, issue 28 step 8).
"""

from __future__ import annotations

import time

import httpx

from agent.devices import MAX_XID_EVENTS

from .wire import healthy, rfc3339


class Faults:
    """The faults a fleet or a test sets on a node, and ``upgrade`` / ``repair`` (part of ``VirtualNode``)."""

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
        self.device_health = {d["id"]: healthy() for d in self.devices}
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
        unknown = set(flags) - set(healthy())
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
