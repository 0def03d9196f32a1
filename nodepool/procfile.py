"""``make run``'s process runner: honcho, stopping each process the way it expects to be stopped.

On Ctrl-C (SIGINT) or SIGTERM honcho sends SIGTERM to every process, then SIGKILLs whatever is
still running some seconds after the first one exited. Stock honcho signals each process's whole
group, so a Celery worker's pool children got SIGTERM at the same moment as the worker itself:
the worker saw its pool processes die under it ("Process 'ForkPoolWorker-1' exited with signal
15"), and on a loaded machine its warm shutdown then hung until honcho's SIGKILL (about 31 s).
Here SIGTERM goes to each main process only (gunicorn's master and Celery's main process stop
their own children; the demo's supervisor does the same), and only the SIGKILL after the grace,
a last resort, goes to the group. Measured: the stop takes about 6-8 s on a busy 2-core machine
(tests/project/test_make_run.py requires under 10 s and no SIGKILL).

Usage: ``python -m nodepool.procfile -f Procfile start``.

Every process it starts shares one Prometheus multiprocess directory (``var/prometheus`` unless
``PROMETHEUS_MULTIPROC_DIR`` says otherwise), emptied here first, so that ``/metrics`` on the web
processes sums the counters of the web workers and the Celery worker (nodepool.metrics).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
from pathlib import Path

import honcho.manager
from honcho.command import main
from honcho.compat import ProcessManager

from nodepool import instances

GRACE_SECONDS = 30  # a safety net only: a clean stop takes well under 10 s


class MainProcessFirst(ProcessManager):
    """SIGTERM to the main process; SIGKILL (after the grace) to its whole process group."""

    def terminate(self, pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ESRCH):
                raise


def prepare_metrics_dir() -> str:
    """Create (or empty) the shared multiprocess directory and export it to the children."""
    var = var_dir()
    path = Path(os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(var / "prometheus")))
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def var_dir() -> Path:
    return Path(os.environ.get("NODEPOOL_VAR_DIR") or Path(__file__).resolve().parent.parent / "var")


def bind_port() -> int | None:
    """The web port ``make run`` will bind (``NODEPOOL_BIND``, default 127.0.0.1:8000)."""
    bind = os.environ.get("NODEPOOL_BIND", "127.0.0.1:8000")
    try:
        return int(bind.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def run() -> None:
    """Refuse a second ``make run`` on the same var dir or port (naming the running one), then run
    the Procfile; on the way out, stop whatever the processes started in other process groups."""
    try:
        lock = instances.acquire(var_dir(), kind="make run", port=bind_port())
    except instances.AlreadyRunning as exc:
        sys.stderr.write(exc.message + "\n")
        raise SystemExit(1) from None
    os.environ[instances.MARKER] = lock.info["id"]  # inherited by every process honcho starts
    honcho.manager.KILL_WAIT = GRACE_SECONDS
    honcho.manager.ProcessManager = MainProcessFirst
    prepare_metrics_dir()
    try:
        main()
    finally:
        instances.stop_marked(lock.info["id"], grace=5)
        lock.release()


if __name__ == "__main__":
    run()
