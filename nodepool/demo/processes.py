"""Subprocesses of the demo: each in its own process group, stopped cleanly (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

ROOT = Path(settings.BASE_DIR)
BIN = Path(sys.executable).parent

# A Celery worker on the embedded broker needs about 6 s for its warm shutdown (docs/foundation.md).
STOP_GRACE_SECONDS = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Supervisor:
    """Starts named commands with their output in ``<log_dir>/<name>.log``; :meth:`stop_all` ends them."""

    log_dir: Path
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as out:
            # start_new_session: a process group of its own, so Ctrl-C in the terminal reaches only
            # the demo, which then stops each group in order (gunicorn's and Celery's children too).
            proc = subprocess.Popen(
                args, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join(self.log(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def dead(self) -> dict[str, int]:
        """Processes that exited on their own: name → exit status."""
        return {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}

    def stop(self, name: str, grace: float = STOP_GRACE_SECONDS) -> int | None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return None
        if proc.poll() is None:
            # SIGTERM to the main process only: gunicorn's master, Celery's main process and the
            # agent each stop their own children (a Celery worker whose pool processes are
            # signalled directly can hang in its warm shutdown). The group is killed after.
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace)
        # Whatever is left of the group (a pool child that outlived its parent) is killed.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            return proc.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def stop_all(self) -> dict[str, int | None]:
        """Stop in reverse start order (the agent before the web server it reports to)."""
        return {name: self.stop(name) for name in reversed(list(self.procs))}


def web_command(port: int, workers: int) -> list[str]:
    return [
        str(BIN / "gunicorn"), "nodepool.wsgi:application", "--bind", f"127.0.0.1:{port}",
        "--workers", str(workers), "--graceful-timeout", "5", "--timeout", "60",
    ]  # fmt: skip


def worker_command(concurrency: int) -> list[str]:
    return [
        str(BIN / "celery"), "-A", "nodepool", "worker", "--loglevel=INFO", f"--concurrency={concurrency}",
        "--without-gossip", "--without-mingle",
    ]  # fmt: skip


def beat_command(schedule_dir: Path) -> list[str]:
    return [
        str(BIN / "celery"), "-A", "nodepool", "beat", "--loglevel=INFO",
        "--scheduler", "nodepool.beat:DatabaseScheduler", "--pidfile", str(schedule_dir / "beat.pid"),
    ]  # fmt: skip


def agent_command(url: str, token: str, state_file: Path, hostname: str) -> list[str]:
    return [
        sys.executable, "-m", "agent", "run", "--url", url, "--bootstrap-token", token,
        "--state-file", str(state_file), "--label", "demo=this-machine", "--hostname", hostname,
        "--stop-grace", "3", "--max-backoff", "5",
    ]  # fmt: skip


def wait_until(predicate, *, timeout: float, interval: float = 0.5):
    """Call ``predicate`` until it returns something truthy; returns it, or None at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)
