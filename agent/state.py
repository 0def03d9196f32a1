"""The agent's state file: identity, credential, incarnation and sequence, kept 0600.

The file is the agent's durable identity. It is written atomically (temporary file in the
same directory, fsync, rename) so that a crash never leaves half a credential behind, and
created with mode 0600 from the start (never chmod-ed after being written). A lock file next
to it (``flock``) keeps two agents from sharing one identity, which would make the control
plane see two incarnations fighting.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

STATE_MODE = 0o600


class StateError(RuntimeError):
    """The state file is unreadable, malformed, too open, or locked by another agent."""


@dataclass
class AgentState:
    """What the agent must remember across restarts.

    ``incarnation`` starts at the value enrollment returned and increases by one at every
    start of the agent (:meth:`begin_incarnation`); ``sequence`` is the last heartbeat sequence
    sent in the current incarnation. Times are RFC 3339 strings as the server sent them.
    """

    server_url: str = ""
    node_id: str = ""
    credential: str = ""
    credential_expires_at: str = ""
    credential_issued_at: str = ""
    incarnation: int = 0
    sequence: int = 0
    enrolled_at: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def enrolled(self) -> bool:
        return bool(self.node_id and self.credential)

    def begin_incarnation(self) -> int:
        """A new agent start: bump the incarnation and restart the heartbeat sequence at 0."""
        self.incarnation += 1
        self.sequence = 0
        return self.incarnation

    def next_sequence(self) -> int:
        """The sequence number of the next heartbeat (never reused, even for a retry)."""
        self.sequence += 1
        return self.sequence

    def public(self) -> dict:
        """The state without the credential secret (for ``nodepool-agent status``)."""
        data = asdict(self)
        if data["credential"]:
            head, _, _ = data["credential"].partition(".")
            data["credential"] = head + ".…"
        return data


class StateFile:
    """Load and save :class:`AgentState` at ``path`` (mode 0600, atomic replace)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock_fd: int | None = None

    def load(self) -> AgentState:
        """The saved state, or a fresh one if the file does not exist.

        Raises:
            StateError: the file is not valid JSON, or is readable by others (mode wider than 0600).
        """
        if not self.path.exists():
            return AgentState()
        mode = self.path.stat().st_mode & 0o777
        if mode & 0o077:
            raise StateError(f"{self.path} has mode {mode:o}; it holds a credential and must be 0600")
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise StateError(f"cannot read {self.path}: {exc}") from exc
        known = {f.name for f in fields(AgentState)}
        return AgentState(**{k: v for k, v in data.items() if k in known})

    def save(self, state: AgentState) -> None:
        """Write ``state`` atomically with mode 0600 (the directory is created 0700 if missing)."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, STATE_MODE)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(asdict(state), handle, indent=2, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, STATE_MODE)  # in case the umask or an old tmp file widened it
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def lock(self) -> None:
        """Take an exclusive lock so that a second agent on the same state file refuses to start.

        Raises:
            StateError: another process holds the lock.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, STATE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise StateError(f"another agent is running with {self.path}") from exc
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None


def default_state_path() -> Path:
    """``/var/lib/nodepool-agent/state.json`` for root, else under ``$XDG_STATE_HOME`` (or ~/.local/state)."""
    if os.geteuid() == 0:
        return Path("/var/lib/nodepool-agent/state.json")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "nodepool-agent" / "state.json"
