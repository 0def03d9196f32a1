"""Coming back after the control plane refused the agent's credential (docs/agent.md, "Coming back").

A node credential stops working when an operator quarantines the node (revoked), when the node
was partitioned longer than the credential's lifetime (``credential_expired``), or when a
superseded copy was reused (``credential_superseded``: the lineage is revoked). Retrying it never
helps, so the agent says once, clearly, what an operator can do, backs off, and comes back as the
**same node** in one of two ways:

* **A credential handed over.** ``nodepoolctl release NODE --issue-credential --credential-file F``
  (or ``POST /nodes/{id}/credentials``) gives a new credential once; ``nodepool-agent
  set-credential --file F`` on the machine puts it in the state file, or, while the agent runs
  (the state file is locked), next to it as ``<state>.credential`` (0600), which the running agent
  takes within one tick (:func:`take_pending`).
* **A bootstrap token naming the node** (fleet/takeover.py on the server): when the agent has one
  (``--bootstrap-token-file``, read again at every attempt, so an operator may drop a fresh token
  there), it re-enrolls with ``"node": <its id>``; the server keeps the node's identity and starts
  a new incarnation, which the agent takes from the answer (:func:`reenroll_payload`). A token the
  server refuses for good (403) is not sent again.

Everything here reads and writes local files only; the HTTP calls stay in agent.runner.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .client import ApiError
from .state import STATE_MODE, AgentState, StateError, StateFile

# The ``reason`` of a 401 from a node endpoint (docs/api-contract.md) that no retry will fix.
REFUSED = {"credential_revoked", "credential_expired", "credential_superseded", "credential_invalid"}
CREDENTIAL_PREFIX = "npn_"


def refusal(exc: ApiError) -> str | None:
    """The credential refusal ``exc`` is (a ``REFUSED`` reason), or None for any other error."""
    if exc.status != 401:
        return None
    body = exc.body if isinstance(exc.body, dict) else {}
    reason = str(body.get("reason") or exc.code)
    return reason if reason in REFUSED else None


def advice(reason: str, node_id: str, state_path: Path) -> str:
    """What an operator does to bring this agent back, for the log (one line per way)."""
    cause = {
        "credential_revoked": "was revoked (a quarantine, or an operator)",
        "credential_expired": "expired (this node was cut off longer than the credential's lifetime)",
        "credential_superseded": "was replaced and an old copy reused, so the whole lineage is revoked",
    }.get(reason, "is unknown to the control plane")
    return (
        f"node {node_id}: the credential {cause}; retrying it will not help. To bring this agent back as the "
        f"same node, either: (1) an operator releases the node with a new credential "
        f"(nodepoolctl release {node_id} --issue-credential --credential-file cred.json, or "
        f"POST /nodes/{node_id}/credentials) and you run `nodepool-agent --state-file {state_path} set-credential "
        f"--file cred.json` here; or (2) an operator creates a bootstrap token naming the node "
        f'(POST /bootstrap-tokens {{"node": "{node_id}"}}, or the admin action "Allow an agent to take over") and '
        f"you put it in this agent's --bootstrap-token-file: it re-enrolls by itself"
    )


def pending_path(state_path: Path) -> Path:
    """``<state>.credential``: a credential handed over while the agent runs."""
    return state_path.with_name(state_path.name + ".credential")


@dataclass
class HandedCredential:
    """A credential an operator handed over: the secret, and the node and expiry when known."""

    credential: str
    node_id: str = ""
    expires_at: str = ""

    @classmethod
    def parse(cls, text: str) -> HandedCredential:
        """``nodepoolctl``'s credential file (JSON ``{"node_id", "credential", "expires_at"}``, or the
        API's ``{"id", "credential"}`` release answer) or a bare ``npn_…`` line.

        Raises:
            StateError: neither, or the credential does not look like a node credential.
        """
        text = text.strip()
        if text.startswith("{"):
            try:
                data = json.loads(text)
            except ValueError as exc:
                raise StateError(f"not a credential file: {exc}") from exc
            handed = cls(
                credential=str(data.get("credential") or ""),
                node_id=str(data.get("node_id") or data.get("id") or ""),
                expires_at=str(data.get("expires_at") or data.get("credential_expires_at") or ""),
            )
        else:
            handed = cls(credential=text)
        if not handed.credential.startswith(CREDENTIAL_PREFIX) or any(c.isspace() for c in handed.credential):
            raise StateError("not a node credential (expected npn_…)")
        return handed

    def apply(self, state: AgentState, *, issued_at: str) -> None:
        """Put the credential in ``state``.

        Raises:
            StateError: it belongs to another node than the state's.
        """
        if not state.node_id:
            raise StateError("the state file holds no node identity: enroll first (nodepool-agent run)")
        if self.node_id and self.node_id != state.node_id:
            raise StateError(f"this credential is node {self.node_id}'s, not this agent's node {state.node_id}")
        state.credential = self.credential
        state.credential_expires_at = self.expires_at
        state.credential_issued_at = issued_at

    def as_json(self) -> str:
        return json.dumps({"node_id": self.node_id, "credential": self.credential, "expires_at": self.expires_at})


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, created 0600 (it holds a secret)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, STATE_MODE)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def set_credential(state_path: Path, handed: HandedCredential, *, issued_at: str) -> str:
    """``nodepool-agent set-credential``: into the state file, or beside it while an agent runs.

    Returns ``"saved"`` (the state file now holds it) or ``"handed"`` (a running agent takes it
    from ``<state>.credential`` within a tick).

    Raises:
        StateError: unreadable state, no identity, or the credential is another node's.
    """
    state_file = StateFile(state_path)
    try:
        state_file.lock()
    except StateError:
        handed.apply(state_file.load(), issued_at=issued_at)  # checks only: the running agent saves it
        write_private(pending_path(state_path), handed.as_json())
        return "handed"
    try:
        state = state_file.load()
        handed.apply(state, issued_at=issued_at)
        state_file.save(state)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pending_path(state_path))
    finally:
        state_file.unlock()
    return "saved"


def take_pending(state_file: StateFile, state: AgentState, *, issued_at: str) -> bool:
    """Move a credential handed over while running (``<state>.credential``) into ``state`` and save.

    Returns True when one was taken. A file that is unreadable or another node's is renamed
    ``….refused`` (so it is not read at every tick) and raises.

    Raises:
        StateError: the handed credential is unusable (the message says why).
    """
    path = pending_path(state_file.path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return False
    try:
        HandedCredential.parse(text).apply(state, issued_at=issued_at)
    except StateError:
        os.replace(path, path.with_name(path.name + ".refused"))
        raise
    state_file.save(state)
    os.unlink(path)
    return True


def bootstrap_token(token: str, token_file: Path | None) -> str:
    """The bootstrap token to re-enroll with: the file's first line when given (read now, so an
    operator may replace it while the agent waits), else ``token``."""
    if token_file is not None:
        try:
            return token_file.read_text().strip()
        except OSError:
            return token
    return token
