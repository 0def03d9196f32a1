"""The demo cannot lose data or leave processes behind (issue 33 item 1): a second demo (or make run)
on the same var dir or port is refused naming the running one and deletes nothing; an interrupt in
any phase stops every child in every process group; the exit status is non-zero unless the story
completed."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodepool import instances
from nodepool.demo.client import poll
from tests.processes import ROOT, free_port


def demo_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "DATABASE_", "PYTEST_", "DJANGO_"))}
    env.pop("SECRET_KEY", None)
    env.pop("NODEPOOL_VAR_DIR", None)
    return env


def start_demo(var_dir: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "manage.py", "demo", "--once", "--nodes", "20", "--no-agent", "--no-progress"]
    args += ["--var-dir", str(var_dir), "--port", str(port), "--timeout", "60", "--web-workers", "1", *extra]
    with open(log, "wb") as out:
        return subprocess.Popen(args, cwd=ROOT, env=demo_env(), stdout=out, stderr=subprocess.STDOUT)


def wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    def seen():
        output = log.read_text(errors="replace") if log.exists() else ""
        if text in output:
            return True
        assert proc.poll() is None, f"the demo exited ({proc.returncode}) before {text!r}:\n{output[-3000:]}"
        return False

    poll(seen, bool, timeout=timeout, what=repr(text), interval=0.2)


def stop_and_check(proc: subprocess.Popen, var_dir: Path, port: int, number=signal.SIGINT) -> str:
    """Interrupt the demo, then: exit status 130, no traceback, nothing carrying its marker, port free."""
    instance_id = instances.read_info(var_dir).get("id")
    proc.send_signal(number)
    try:
        returncode = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = (var_dir.parent / f"{var_dir.name}.log").read_text(errors="replace")
    assert returncode == 130, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert instance_id and instances.marked(instance_id) == [], "processes of the demo are still running"
    assert not instances.port_in_use(port)
    return output


# --- the lock and the sweep, in-process -----------------------------------------------------------


def test_a_second_instance_on_the_same_var_dir_is_refused_naming_the_first(tmp_path):
    first = instances.acquire(tmp_path, kind="make demo", port=None)
    try:
        with pytest.raises(instances.AlreadyRunning) as refused:
            instances.acquire(tmp_path, kind="make run")
        assert f"make demo (pid {os.getpid()})" in refused.value.message
        assert str(tmp_path) in refused.value.message
    finally:
        first.release()
    instances.acquire(tmp_path, kind="make run").release()  # the kernel dropped the lock


def test_a_port_in_use_is_refused_naming_the_instance_that_serves_it(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        first = instances.acquire(tmp_path / "demo", kind="make demo")
        first.update(port=port, url=f"http://127.0.0.1:{port}")
        try:
            with pytest.raises(instances.AlreadyRunning) as refused:
                instances.acquire(tmp_path / "demo-2", kind="make demo", port=port)
            assert f"port {port} is in use by make demo (pid {os.getpid()})" in refused.value.message
        finally:
            first.release()


def test_the_sweep_stops_marked_processes_in_every_process_group():
    marker = f"test-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, **{instances.MARKER: marker})
    # A child in a session of its own that starts a grandchild in yet another session.
    script = "import subprocess, sys, time; subprocess.Popen(['sleep', '60'], start_new_session=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True)
    poll(lambda: len(instances.marked(marker)) >= 2, bool, timeout=20, what="both processes", interval=0.1)
    found = instances.stop_marked(marker, grace=5)
    assert len(found) == 2
    proc.wait(5)
    poll(lambda: instances.marked(marker) == [], bool, timeout=10, what="nothing left", interval=0.1)


@pytest.mark.django_db
def test_serving_after_a_completed_story_exits_zero_and_before_it_non_zero(tmp_path, monkeypatch):
    from nodepool.demo.runner import Demo

    for story_done, expected in ((True, True), (False, False)):
        demo = Demo(var_dir=tmp_path, nodes=20, port=free_port(), once=False, seed=1, timeout=5, web_workers=1,
                    agent=False, progress=False, out=io.StringIO())  # fmt: skip

        def interrupted(api, done=story_done):
            if not done:
                raise KeyboardInterrupt  # Ctrl-C while the processes start

        monkeypatch.setattr(demo, "start_processes", interrupted)
        monkeypatch.setattr("nodepool.demo.runner.setup.create_pools", lambda api: ["general"])
        monkeypatch.setattr("nodepool.demo.runner.setup.create_tokens", lambda api, max_uses: {"general": "npb_x"})
        monkeypatch.setattr("nodepool.demo.runner.setup.create_prices", lambda api: None)
        monkeypatch.setattr(demo, "start_fleet", lambda tokens: (None, {}))
        monkeypatch.setattr(demo, "wait_for_admission", lambda api: True)
        monkeypatch.setattr("nodepool.demo.runner.Story.run", lambda self, steps: [])
        monkeypatch.setattr("nodepool.demo.runner.report.summary", lambda *a, **k: "summary")
        monkeypatch.setattr(
            "nodepool.demo.runner.time.sleep", lambda s: (_ for _ in ()).throw(KeyboardInterrupt())
        )  # Ctrl-C while serving
        assert demo.run() is expected
        assert demo.interrupted is (not story_done)


# --- real demos (each phase interrupted) -----------------------------------------------------------


def refused(args: list[str]) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", "demo", "--once", "--no-progress", *args],
        cwd=ROOT,
        env=demo_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout + result.stderr


@pytest.mark.slow
def test_a_second_demo_is_refused_and_an_interrupt_while_enrolling_stops_everything(tmp_path):
    var_dir, port = tmp_path / "demo", free_port()
    proc = start_demo(var_dir, port, tmp_path / "demo.log")
    try:
        wait_for(tmp_path / "demo.log", "worker and beat started", proc)
        info = instances.read_info(var_dir)
        assert info["pid"] == proc.pid and info["port"] == port
        # Same var dir: refused, naming the first, and nothing of the first one's deleted.
        message = refused(["--var-dir", str(var_dir), "--port", str(free_port())])
        assert f"make demo (pid {proc.pid}) at http://127.0.0.1:{port}" in message
        assert (var_dir / "logs" / "web.log").exists() and (var_dir / "nodepool.sqlite3").exists()
        # Another var dir, the same port: refused, naming the first.
        message = refused(["--var-dir", str(tmp_path / "other"), "--port", str(port)])
        assert f"port {port} is in use by make demo (pid {proc.pid})" in message
        assert not (tmp_path / "other" / "nodepool.sqlite3").exists()
    finally:
        output = stop_and_check(proc, var_dir, port)
    assert "interrupted before the story completed" in output


@pytest.mark.slow
def test_an_interrupt_during_the_migrations_exits_non_zero_without_a_traceback(tmp_path):
    var_dir, port = tmp_path / "demo", free_port()
    proc = start_demo(var_dir, port, tmp_path / "demo.log")
    wait_for(tmp_path / "demo.log", "migrating its database", proc, timeout=120)
    output = stop_and_check(proc, var_dir, port)
    assert "interrupted before the demo started; nothing is left running" in output


@pytest.mark.slow
def test_sigterm_during_the_story_stops_every_process_and_exits_non_zero(tmp_path):
    var_dir, port = tmp_path / "demo", free_port()
    proc = start_demo(var_dir, port, tmp_path / "demo.log")
    wait_for(tmp_path / "demo.log", "admission done", proc, timeout=300)
    info = json.loads((var_dir / instances.LOCK_NAME).read_text())
    assert instances.marked(info["id"])  # web, worker, beat running under the demo's marker
    output = stop_and_check(proc, var_dir, port, signal.SIGTERM)
    assert "stopped: " in output
