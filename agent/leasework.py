"""The agent's work for the control plane between heartbeats: start and stop leased workloads
(agent.workloads runs them), send their lease events, run and post benchmarks, and send a spot
preemption notice.

A mixin of :class:`agent.runner.Agent` (split from agent/runner.py, issue 28 step 8).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from .client import ApiError, ServerUnavailable
from .times import rfc3339

log = logging.getLogger("agent")

# Answers that mean "this lease is no longer yours" when a lease event is refused.
NOT_OURS = {"stale_fencing_token", "lease_superseded", "stale_incarnation", "lease_ended", "not_found"}


class LeaseWork:
    """Assigned leases, lease events, benchmarks and the preemption notice (part of ``Agent``)."""

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
