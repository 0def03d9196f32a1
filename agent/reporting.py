"""The agent's reporting: the heartbeat's payload, renewals between status reports
(docs/heartbeats.md), the server's timing and the instructions its answers carry.

A mixin of :class:`agent.runner.Agent` (split from agent/runner.py, issue 28 step 8).
"""

from __future__ import annotations

import logging
import time

from . import conditions, devices, repair
from .client import ApiError, ServerUnavailable
from .times import parse_time, rfc3339

log = logging.getLogger("agent")

# The renewal answer's flags (docs/api-contract.md): any bit but ROTATE_CREDENTIAL means "send a
# status report now": its answer carries the instructions themselves.
FLAG_ROTATE_CREDENTIAL = 16


class Reporting:
    """Build heartbeats, send renewals, follow the answers' timing and instructions (part of ``Agent``)."""

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
