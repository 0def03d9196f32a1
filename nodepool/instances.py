"""One running instance per var directory and port, and every process it started stopped (issue 33 item 1).

``make demo`` and ``make run`` each take an exclusive ``flock`` on ``<var dir>/instance.lock``
before they touch anything there (the demo empties its var directory; ``make run`` empties its
Prometheus directory). The kernel drops the lock when the holder dies, however it dies, so a stale
lock file never blocks anyone; the file's JSON (pid, kind, port, url, started_at) names the
holder in the refusal. A port already answering is refused the same way, naming the instance
whose lock file says it serves that port when one does.

Every process an instance starts carries ``NODEPOOL_INSTANCE=<id>`` in its environment, and so does
everything those start in turn (a Celery worker's simulator machines, in their own sessions): on
stop, :func:`stop_marked` finds them all in ``/proc`` and ends each one's process group, so no
child survives in a process group of its own. Linux only (``/proc``); elsewhere it finds nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from humanunits import moment

LOCK_NAME = "instance.lock"
MARKER = "NODEPOOL_INSTANCE"


class AlreadyRunning(SystemExit):
    """Another instance holds the var directory or serves the port: the message names it (exit 1)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def describe(info: dict) -> str:
    """``make demo (pid 1234) at http://127.0.0.1:8000, var dir /x, started 2026-… (5m ago)``."""
    head = f"{info.get('kind', 'an instance')} (pid {info.get('pid', '?')})"
    parts = [f"{head} at {info['url']}" if info.get("url") else head]
    if info.get("var_dir"):
        parts.append(f"var dir {info['var_dir']}")
    if info.get("started_at"):
        parts.append(f"started {moment(info['started_at'])}")
    return ", ".join(parts)


def read_info(var_dir: Path) -> dict:
    """The holder's JSON from ``<var_dir>/instance.lock`` (``{}`` when absent or unreadable)."""
    try:
        return json.loads((var_dir / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


@dataclass
class InstanceLock:
    """The held lock: keep the object (its open file) for as long as the instance runs."""

    path: Path
    fd: int
    info: dict

    def update(self, **fields) -> None:
        """Rewrite the holder's JSON (e.g. the port, known only once a free one is picked)."""
        self.info.update(fields)
        text = json.dumps(self.info, sort_keys=True).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text, 0)

    def keep_across_exec(self) -> str:
        """Let the lock survive ``execve`` (same process, same open file): returns the fd to pass on."""
        os.set_inheritable(self.fd, True)
        return str(self.fd)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def acquire(var_dir: Path, *, kind: str, port: int | None = None, host: str = "127.0.0.1") -> InstanceLock:
    """Take ``<var_dir>/instance.lock`` or refuse.

    Raises:
        AlreadyRunning: another live process holds the lock (named from its JSON), or ``port`` is
            already answering (named when some instance's lock file claims it).
    """
    var_dir.mkdir(parents=True, exist_ok=True)
    path = var_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = read_info(var_dir)
        raise AlreadyRunning(
            f"{kind} refused: {describe(holder) if holder else 'another instance'} is already running on {var_dir}. "
            "Stop it first (Ctrl-C in its terminal, or kill -INT "
            f"{holder.get('pid', '<pid>')}), or use another var directory."
        ) from None
    if port is not None and port_in_use(port, host):
        os.close(fd)
        holder = find_by_port(port, near=var_dir)
        who = describe(holder) if holder else "another program"
        raise AlreadyRunning(f"{kind} refused: port {port} is in use by {who}. Stop it, or pick another port.")
    info = {
        "kind": kind,
        "pid": os.getpid(),
        "var_dir": str(var_dir),
        "started_at": datetime.now(UTC).isoformat(),
        "id": uuid.uuid4().hex,
    }
    if port is not None:
        info.update(port=port, url=f"http://{host}:{port}")
    lock = InstanceLock(path, fd, info)
    lock.update()
    return lock


def adopt(fd: str, var_dir: Path) -> InstanceLock | None:
    """The lock taken before an ``execve`` (fd number passed in the environment), or None."""
    try:
        number = int(fd)
        os.fstat(number)
    except (TypeError, ValueError, OSError):
        return None
    return InstanceLock(var_dir / LOCK_NAME, number, read_info(var_dir))


def find_by_port(port: int, *, near: Path) -> dict:
    """The live instance whose lock file says it serves ``port``: looked for in ``near``'s parent
    and its subdirectories (``var/`` holds ``make run``'s lock and the demos' ``var/demo*``)."""
    roots = {near.parent, near.parent.parent}
    for root in roots:
        for path in [root / LOCK_NAME, *root.glob(f"*/{LOCK_NAME}")]:
            info = read_info(path.parent)
            if info.get("port") == port and _alive(info.get("pid")):
                return info
    return {}


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def marked(instance_id: str) -> list[int]:
    """Pids of live processes whose environment carries ``NODEPOOL_INSTANCE=<instance_id>``."""
    needle = f"{MARKER}={instance_id}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            continue
    return found


def stop_marked(instance_id: str, *, grace: float = 10.0) -> list[int]:
    """End every process carrying the marker, with its process group: SIGTERM, then SIGKILL after
    ``grace`` seconds. Returns the pids that were found running."""
    pids = marked(instance_id)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and marked(instance_id):
        time.sleep(0.2)
    _signal_all(marked(instance_id), signal.SIGKILL)
    return pids


def _signal_all(pids: list[int], number: int) -> None:
    """``number`` to each pid's process group, or to the pid alone when it shares ours (the caller's
    own terminal job is never signalled as a group)."""
    own = os.getpgrp()
    for pid in pids:
        with contextlib.suppress(OSError):
            group = os.getpgid(pid)
            if group == own:
                os.kill(pid, number)
            else:
                os.killpg(group, number)
