"""The agent's credential: rotation when due, and coming back from a refused credential
(re-enrollment with a bootstrap token, or a credential handed over by ``nodepool-agent
set-credential``; the local-file side is agent.recovery).

A mixin of :class:`agent.runner.Agent` (split from agent/runner.py, issue 28 step 8): it reads and
writes the agent's state, client and backoff.
"""

from __future__ import annotations

import logging

from . import recovery
from .client import ApiError, ServerUnavailable
from .state import StateError
from .times import parse_time, rfc3339

log = logging.getLogger("agent")


class Credentials:
    """Rotate the node credential and take a new one after a refusal (part of ``Agent``)."""

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
