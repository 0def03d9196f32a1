"""``manage.py demo --once``: the story passes against real processes, and everything is stopped."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest

from nodepool.demo.client import TimedOut, poll
from nodepool.demo.processes import Supervisor, port_in_use
from tests.processes import ROOT, free_port


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def assert_api_docs_bundle_served(base: str) -> None:
    """/api/docs/ names its Swagger UI bundle under /static/ (no CDN), and that bundle is served."""
    docs = httpx.get(f"{base}/api/docs/", timeout=10)
    assert docs.status_code == 200, docs.status_code
    bundle = re.search(r'src="(/static/drf_spectacular_sidecar/[^"]+\.js)"', docs.text)
    assert bundle, docs.text[:500]
    js = httpx.get(base + bundle.group(1), timeout=10)
    assert js.status_code == 200 and len(js.content) > 10_000, (js.status_code, len(js.content))


def test_make_demo_leaves_the_default_database_alone():
    # The demo migrates its own var dir's database; `make demo` must not migrate the default one.
    plan = subprocess.run(
        ["make", "--no-print-directory", "-n", "-o", "venv", "demo"], cwd=ROOT, capture_output=True, text=True
    )
    assert plan.returncode == 0, plan.stderr
    commands = [line for line in plan.stdout.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands and all("manage.py demo" in line for line in commands), commands


def test_poll_returns_the_first_value_that_passes_the_check():
    values = iter([1, 2, 3])
    assert poll(lambda: next(values), lambda v: v >= 2, timeout=5, what="two", interval=0) == 2


def test_poll_names_what_it_waited_for_and_the_last_value_seen():
    with pytest.raises(TimedOut, match=r"waiting for the node to be lost; last seen: \{'liveness': 'alive'\}"):
        poll(lambda: {"liveness": "alive"}, lambda n: False, timeout=0, what="the node to be lost", interval=0)


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan may wait for a reaper that a container does not have)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_supervisor_stops_a_process_and_its_children(tmp_path):
    supervisor = Supervisor(tmp_path, dict(os.environ))
    child = tmp_path / "child.pid"
    proc = supervisor.start("sleeper", ["sh", "-c", f"sleep 60 & echo $! > {child}; wait"])
    poll(lambda: child.exists() and child.read_text().strip(), bool, timeout=10, what="the child", interval=0.05)
    assert supervisor.dead() == {}
    status = supervisor.stop("sleeper", grace=5)
    assert status is not None and proc.poll() is not None
    pid = int(child.read_text())
    poll(lambda: not running(pid), bool, timeout=5, what="the child to be killed with its group", interval=0.05)


@pytest.mark.slow
@pytest.mark.skipif(
    bool(os.environ.get("DATABASE_URL")), reason="the demo runs on the embedded default; once per suite run is enough"
)
def test_the_one_shot_demo_passes_every_step_and_stops_every_process(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "DATABASE_", "PYTEST_", "DJANGO_"))}
    env.pop("SECRET_KEY", None)
    env.pop("NODEPOOL_VAR_DIR", None)
    args = [sys.executable, "manage.py", "demo", "--once", "--nodes", "30", "--port", str(port)]
    args += ["--var-dir", str(tmp_path / "demo"), "--no-progress"]
    log = tmp_path / "demo.log"
    with open(log, "wb") as out:
        demo = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        # While the story runs, the demo's web server serves the admin's and the API docs' files.
        base = f"http://127.0.0.1:{port}"
        poll(lambda: _answers(f"{base}/healthz"), bool, timeout=300, what="the demo's web server", interval=0.5)
        css = httpx.get(f"{base}/static/admin/css/base.css", timeout=10)
        assert css.status_code == 200 and "text/css" in css.headers["content-type"], css.status_code
        assert_api_docs_bundle_served(base)
        returncode = demo.wait(timeout=600)
    finally:
        if demo.poll() is None:
            demo.kill()
    output = log.read_text(errors="replace")
    assert returncode == 0, output[-4000:]
    assert re.search(r"(\d+)/\1 steps passed", output), output[-2000:]
    assert "[FAIL]" not in output
    stopped = re.search(r"stopped: (.*)", output).group(1)
    assert set(re.findall(r"(\w+) \(", stopped)) == {"web", "worker", "beat", "agent"}
    assert "None" not in stopped  # every process ended (killed at worst), none left behind
    assert not port_in_use(port)


@pytest.mark.django_db
def test_a_second_stop_signal_while_stopping_does_not_leave_the_children_running(tmp_path, monkeypatch):
    """Ctrl-C, then SIGTERM to the demo's process group while it stops its children: the second
    signal used to interrupt the cleanup with a traceback and leave web, worker, beat and agent up."""
    import io
    import signal

    from nodepool.demo.runner import Demo

    demo = Demo(var_dir=tmp_path, nodes=20, port=free_port(), once=True, seed=1, timeout=5, web_workers=1,
                agent=False, progress=False, out=io.StringIO())  # fmt: skip
    stopped = []

    def interrupted(api):
        raise KeyboardInterrupt  # the first Ctrl-C, while the processes start

    def stop_all_with_a_second_signal():
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, in the middle of stopping
        stopped.append("web")
        return {"web": 0}

    monkeypatch.setattr(demo, "start_processes", interrupted)
    monkeypatch.setattr(demo.supervisor, "stop_all", stop_all_with_a_second_signal)
    # As manage.py demo does: SIGTERM stops the demo as Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        assert demo.run() is False
    except KeyboardInterrupt:
        pytest.fail("the second signal cut the demo's cleanup short")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped == ["web"]
    assert "stopped: web (0)" in demo.out.getvalue()
