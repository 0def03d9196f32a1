"""``make run`` starts web, worker and beat on the embedded default, serves the API docs and the
admin, and stops every process on Ctrl-C or SIGTERM."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from tests.processes import ROOT, free_port, group_alive, stop_group, wait_for

pytestmark = pytest.mark.slow

STARTED = re.compile(r"system\s+\| (\w+)\.\d+ started \(pid=(\d+)\)")


def started_pids(log) -> dict[str, int]:
    text = log.read_text(errors="replace") if log.exists() else ""
    return {name: int(pid) for name, pid in STARTED.findall(text)}


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_make_run_serves_docs_and_admin_and_stops_every_process(tmp_path, sig):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "make-run.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "DATABASE_", "PYTEST_", "DJANGO_"))}
    env.pop("SECRET_KEY", None)
    env.update(
        NODEPOOL_VAR_DIR=str(tmp_path / "var"),
        NODEPOOL_BIND=f"127.0.0.1:{port}",
        WEB_CONCURRENCY="2",
        CELERY_CONCURRENCY="1",
        PYTHONUNBUFFERED="1",
    )
    # -o venv: the suite already runs inside the project's virtual environment.
    with open(log, "wb") as out:
        make = subprocess.Popen(
            ["make", "-o", "venv", "run"], cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True
        )
    try:
        wait_for(lambda: answers(f"{base}/healthz"), 90, "/healthz", log, step=0.3)
        for path in ("/readyz", "/api/docs/", "/api/schema/", "/admin/login/", "/static/admin/css/base.css"):
            response = httpx.get(base + path, timeout=10)
            assert response.status_code == 200, (path, response.status_code, response.text[:300])
        docs = httpx.get(f"{base}/api/docs/", timeout=10)
        static = re.search(r'src="(/static/drf_spectacular_sidecar/[^"]+\.js)"', docs.text)
        assert static, docs.text[:500]  # served by whitenoise after collectstatic, no CDN
        assert httpx.get(base + static.group(1), timeout=10).status_code == 200

        # The body ceiling holds behind a real WSGI server, also for chunked bodies.
        big = httpx.post(f"{base}/api/v1/", content=iter([b"x" * 65536] * 16), timeout=10)
        assert big.status_code == 413, big.text[:300]
        assert big.headers["content-type"] == "application/problem+json"
        small = httpx.post(
            f"{base}/api/v1/", content=iter([b'{"a": 1}']), headers={"Content-Type": "application/json"}, timeout=10
        )
        assert small.status_code == 405

        wait_for(lambda: "ready." in log.read_text(errors="replace"), 30, "the worker", log)
        wait_for(lambda: "beat: Starting" in log.read_text(errors="replace"), 30, "beat", log)
        pids = started_pids(log)
        assert set(pids) == {"web", "worker", "beat"}

        # Run past a few beat periods (5 s sweeps) so that quiet periodic work can be checked.
        time.sleep(6)
        stopping = time.monotonic()
        os.killpg(make.pid, sig)  # what a terminal does on Ctrl-C; a supervisor's stop for SIGTERM
        make.wait(timeout=60)
        stop_seconds = time.monotonic() - stopping

        for name, pid in pids.items():
            wait_for(lambda pid=pid: not group_alive(pid), 5, f"{name} (pid {pid}) to exit", log)
        text = log.read_text(errors="replace")
        assert "SIGKILL" not in text, text[-3000:]
        assert "Warm shutdown" in text
        # The worker's pool children are stopped by the worker, not signalled under it.
        assert "exited with 'signal 15" not in text, text[-3000:]
        assert stop_seconds < 10, (stop_seconds, text[-3000:])
        # Periodic tasks that changed nothing stay out of an INFO log.
        assert "Sending due task" not in text and "fleet.sweep_liveness[" not in text, text[-3000:]
        assert not answers(f"{base}/healthz")
        # The development secret was generated into the var dir, readable by its owner only.
        assert (tmp_path / "var" / "secret_key").stat().st_mode & 0o777 == 0o600
    finally:
        stop_group(make, signal.SIGTERM, timeout=5)
        for pid in started_pids(log).values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
