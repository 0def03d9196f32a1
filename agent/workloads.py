"""Lease workloads run as subprocesses, supervised without blocking the heartbeat loop.

Each workload is started in its own session (process group), so that stop and checkpoint
signals reach the whole tree the command may spawn. Signals:

* stop: ``SIGTERM`` to the group, then ``SIGKILL`` once ``grace`` seconds have passed
  (the kubelet's terminationGracePeriodSeconds pattern);
* checkpoint: ``SIGUSR1`` to the group. A workload that wants to survive a checkpoint request
  must handle ``SIGUSR1``: its default action terminates the process.

The supervisor never sleeps: :meth:`Supervisor.poll` advances every workload (reaps exits,
escalates overdue stops) and returns the events to report, which the agent sends to
``POST /node-leases/{id}/events``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .devices import lease_environment

log = logging.getLogger(__name__)

RUNNING, STOPPING, EXITED = "running", "stopping", "exited"


@dataclass
class Workload:
    """One lease's process. ``fencing_token`` is the token the lease was granted with."""

    lease_id: str
    fencing_token: int
    command: list[str]
    process: subprocess.Popen
    devices: list[str] = field(default_factory=list)  # the ids the workload was confined to
    state: str = RUNNING
    started_at: float = field(default_factory=time.monotonic)
    stop_deadline: float | None = None
    stop_reason: str = ""
    killed: bool = False
    log_path: str = ""
    # The per-lease secret's file (0600, refreshed when a renewal re-derives the secret, removed when
    # the workload ends). The secret itself is never kept on this object, logged or reported.
    secret_path: str = ""
    secret_digest: str = field(default="", repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass(frozen=True)
class LeaseEvent:
    """A workload state change to report: ``state`` is running|checkpointed|succeeded|failed."""

    lease_id: str
    fencing_token: int
    state: str
    message: str = ""


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(process.pid, sig)


class Supervisor:
    """Starts, watches, checkpoints and stops lease workloads.

    Args:
        work_dir: each workload runs here; its stdout and stderr go to ``<work_dir>/<lease_id>.log``.
        grace: seconds between SIGTERM and SIGKILL when stopping.
        env: extra environment for every workload (the agent adds the node id and incarnation).
    """

    def __init__(
        self, *, work_dir: str | os.PathLike, grace: float = 10.0, env: dict | None = None, clock=time.monotonic
    ):
        self.work_dir = Path(work_dir)
        self.grace = grace
        self.env = dict(env or {})
        self.clock = clock
        self.workloads: dict[str, Workload] = {}
        # Leases that ended here: never start them again if the server still lists them.
        self.finished: dict[str, int] = {}

    def running(self) -> list[Workload]:
        return [w for w in self.workloads.values() if w.state != EXITED]

    def start(
        self, lease_id: str, fencing_token: int, command: list[str], secret: str = "", devices: list | None = None
    ) -> LeaseEvent:
        """Start ``command`` for a lease; returns the ``running`` event (or ``failed`` if it cannot start).

        ``secret`` is the lease's secret from the heartbeat answer: given to the workload as
        ``NODEPOOL_LEASE_SECRET`` (and ``NODEPOOL_LEASE_SECRET_FILE``), never logged, removed at its end.
        ``devices`` are the lease's (``[{"id", "type", "index"}]``): the workload sees exactly
        those GPUs (``CUDA_VISIBLE_DEVICES`` / ``NVIDIA_VISIBLE_DEVICES``, :func:`lease_environment`)
        and none when the lease has none, whatever the agent's own environment says.
        """
        self.work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if isinstance(command, str):  # tolerate "sleep 30"; the contract's shape is an argv list
            command = shlex.split(command)
        log_path = self.work_dir / f"{lease_id}.log"
        env = {
            **os.environ,
            **self.env,
            **lease_environment(devices),
            "NODEPOOL_LEASE_ID": lease_id,
            "NODEPOOL_FENCING_TOKEN": str(fencing_token),
        }
        secret_path = ""
        if secret:
            # The workload reads its lease secret from its environment; the file holds the current
            # one after renewals (the environment of a running process cannot be changed).
            secret_path = str(self._write_secret(lease_id, secret))
            env["NODEPOOL_LEASE_SECRET"] = secret
            env["NODEPOOL_LEASE_SECRET_FILE"] = secret_path
        try:
            with open(log_path, "ab") as out:
                process = subprocess.Popen(
                    [str(arg) for arg in command],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=self.work_dir,
                    env=env,
                    start_new_session=True,
                )
        except (OSError, ValueError) as exc:
            self._remember_finished(lease_id, fencing_token)
            self._remove_secret(secret_path)
            return LeaseEvent(lease_id, fencing_token, "failed", f"could not start {command[:1]}: {exc}")
        self.workloads[lease_id] = Workload(
            lease_id,
            fencing_token,
            list(command),
            process,
            log_path=str(log_path),
            secret_path=secret_path,
            secret_digest=hashlib.sha256(secret.encode()).hexdigest() if secret else "",
        )
        self.workloads[lease_id].devices = [d for d in env["NODEPOOL_DEVICES"].split(",") if d]
        log.info("lease %s: started pid %s: %s", lease_id, process.pid, command)
        return LeaseEvent(lease_id, fencing_token, "running", f"pid {process.pid}")

    def _write_secret(self, lease_id: str, secret: str) -> Path:
        path = self.work_dir / f"{lease_id}.secret"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secret)
        return path

    @staticmethod
    def _remove_secret(path: str) -> None:
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def refresh_secret(self, lease_id: str, secret: str) -> None:
        """A renewal re-derived the lease's secret: replace the file the workload reads."""
        w = self.workloads.get(lease_id)
        if w is None or not w.secret_path or w.state != RUNNING or not secret:
            return
        digest = hashlib.sha256(secret.encode()).hexdigest()
        if digest != w.secret_digest:  # only when it changed: not a file write per heartbeat
            self._write_secret(lease_id, secret)
            w.secret_digest = digest

    def _remember_finished(self, lease_id: str, fencing_token: int, keep: int = 10_000) -> None:
        self.finished[lease_id] = fencing_token
        while len(self.finished) > keep:  # dicts keep insertion order: forget the oldest
            del self.finished[next(iter(self.finished))]

    def stop(self, lease_id: str, reason: str) -> None:
        """SIGTERM now; :meth:`poll` sends SIGKILL once the grace has passed."""
        w = self.workloads.get(lease_id)
        if w is None or w.state != RUNNING:
            return
        log.info("lease %s: stopping pid %s (%s)", lease_id, w.pid, reason)
        _signal_group(w.process, signal.SIGTERM)
        w.state, w.stop_reason, w.stop_deadline = STOPPING, reason, self.clock() + self.grace

    def checkpoint(self, lease_id: str) -> LeaseEvent | None:
        """SIGUSR1 to the workload; returns the ``checkpointed`` event, or None if it is not running."""
        w = self.workloads.get(lease_id)
        if w is None or w.state != RUNNING:
            return None
        _signal_group(w.process, signal.SIGUSR1)
        return LeaseEvent(lease_id, w.fencing_token, "checkpointed", "SIGUSR1 sent")

    def poll(self) -> list[LeaseEvent]:
        """Reap exits and escalate overdue stops. Returns the terminal events to report."""
        events = []
        now = self.clock()
        for w in list(self.workloads.values()):
            if w.state == EXITED:
                continue
            code = w.process.poll()
            if code is None:
                if w.state == STOPPING and w.stop_deadline is not None and now >= w.stop_deadline and not w.killed:
                    log.warning("lease %s: pid %s ignored SIGTERM for %ss; SIGKILL", w.lease_id, w.pid, self.grace)
                    _signal_group(w.process, signal.SIGKILL)
                    w.killed = True
                continue
            # The leader exited: make sure nothing it left behind in its group keeps running.
            _signal_group(w.process, signal.SIGKILL)
            w.state = EXITED
            self._remove_secret(w.secret_path)  # the lease's secret goes with its workload
            self._remember_finished(w.lease_id, w.fencing_token)
            del self.workloads[w.lease_id]
            events.append(self._terminal_event(w, code))
        return events

    def _terminal_event(self, w: Workload, code: int) -> LeaseEvent:
        if w.stop_reason:
            how = "SIGKILL after grace" if w.killed else "SIGTERM"
            return LeaseEvent(w.lease_id, w.fencing_token, "failed", f"stopped ({w.stop_reason}) by {how}; exit {code}")
        if code == 0:
            return LeaseEvent(w.lease_id, w.fencing_token, "succeeded", "exit 0")
        if code < 0:
            return LeaseEvent(w.lease_id, w.fencing_token, "failed", f"killed by signal {-code}")
        return LeaseEvent(w.lease_id, w.fencing_token, "failed", f"exit {code}")

    def stop_all(self, reason: str, *, wait: float | None = None, sleep=time.sleep) -> list[LeaseEvent]:
        """Stop every workload and wait for them (up to grace, then SIGKILL). Used at shutdown."""
        for lease_id in list(self.workloads):
            self.stop(lease_id, reason)
        events: list[LeaseEvent] = []
        deadline = self.clock() + (wait if wait is not None else self.grace + 5)
        while self.workloads and self.clock() < deadline:
            events.extend(self.poll())
            if self.workloads:
                sleep(0.05)
        return events
