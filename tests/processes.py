"""Start real processes (Celery workers, beat, honcho) from tests and always clean them up."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import Popen

from django.db import connection

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def database_url() -> str:
    """A DATABASE_URL for the database this test runs on (the test database, not the main one)."""
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] or ""
    if s.get("PASSWORD"):
        auth += f":{s['PASSWORD']}"
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def child_env(var_dir: Path, **overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "PYTEST_", "DJANGO_"))}
    env.update(
        NODEPOOL_VAR_DIR=str(var_dir),
        DATABASE_URL=database_url(),
        SECRET_KEY="test-secret-key-for-child-processes",
        PYTHONUNBUFFERED="1",
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    env.update(overrides)
    return env


@contextlib.contextmanager
def running(args: list[str], env: dict[str, str], log: Path, *, stop_signal=signal.SIGTERM) -> Iterator[Popen]:
    """Run ``args`` in its own process group; on exit, stop it (``stop_signal``, then SIGKILL the group)."""
    with open(log, "ab") as out:
        proc = Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop_group(proc, stop_signal)


def stop_group(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 15) -> int | None:
    """Send ``sig`` to ``proc`` (its main process only, as a supervisor would), wait up to
    ``timeout`` seconds, then SIGKILL whatever is left of its process group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=5)
    return proc.returncode


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    log: Path | None = None,
    step=0.1,
    *,
    state: Callable[[], str] | None = None,
):
    """Poll ``predicate`` until truthy; fail with ``state()`` (what the test can say about where
    things stand) and the log's tail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
    where = f"\n--- state ---\n{state()}" if state else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{where}\n--- log tail ---\n{tail}")
