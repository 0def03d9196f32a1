"""Heartbeats: sequence numbers, the server's interval with jitter, backoff, rotation, retirement."""

import threading
import time
from datetime import timedelta

import httpx
import pytest

from agent.backoff import Backoff
from agent.runner import EXIT_RETIRED, AgentExit
from agent.state import StateFile
from tests.fake_control_plane import FakeControlPlane, make_agent


@pytest.fixture
def fake():
    return FakeControlPlane(heartbeat_interval=10.0)


@pytest.fixture
def agent(fake, tmp_path):
    a = make_agent(fake, tmp_path, max_backoff=60.0)
    a.start()
    yield a
    a.shutdown()


def _node(fake):
    return next(iter(fake.nodes.values()))


def test_heartbeats_carry_increasing_sequences_and_measured_conditions(fake, agent):
    for _ in range(3):
        agent.step()

    beats = _node(fake).heartbeats
    assert [b["sequence"] for b in beats] == [1, 2, 3]
    types = {c["type"]: c["status"] for c in beats[0]["conditions"]}
    assert set(types) == {"Ready", "MemoryPressure", "DiskPressure", "PIDPressure"}
    assert types["Ready"] == "True"
    assert beats[0]["usage"]["memory"] > 0
    assert beats[0]["observed_at"].endswith("Z")


def test_next_heartbeat_follows_the_servers_interval_with_jitter(fake, agent):
    fake.heartbeat_interval = 25.0
    delays = [agent.step() for _ in range(20)]

    assert all(22.5 <= d <= 27.5 for d in delays)
    assert len({round(d, 3) for d in delays}) > 1, "a fleet must not heartbeat in lockstep"


def test_backoff_grows_exponentially_and_stops_at_the_cap_while_the_server_is_away(fake, agent):
    fake.down = True
    delays = [agent.step() for _ in range(10)]

    ceilings = [min(60.0, 2.0**n) for n in range(10)]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert delays[-1] <= 60.0 and delays[-1] >= 30.0

    fake.down = False
    assert 9.0 <= agent.step() <= 11.0, "one answer resets the backoff"
    assert agent.backoff.failures == 0


def test_failed_attempts_never_reuse_a_sequence_number(fake, agent):
    agent.step()
    fake.unavailable = 2
    agent.step()
    agent.step()
    agent.step()

    assert [b["sequence"] for b in _node(fake).heartbeats] == [1, 4]
    assert _node(fake).verdicts == ["applied", "applied"]


def test_retry_after_from_the_server_is_respected(tmp_path):
    def busy(request):
        if request.url.path.endswith("/heartbeats"):
            return httpx.Response(429, headers={"Retry-After": "42"}, json={"code": "throttled"})
        return fake.handle(request)

    fake = FakeControlPlane()
    a = make_agent(fake, tmp_path)
    a.client.http._transport = httpx.MockTransport(busy)
    a.start()
    assert a.step() >= 42
    a.client.http._transport = httpx.MockTransport(fake.handle)
    a.shutdown()


def test_backoff_delays_are_capped_and_jittered():
    backoff = Backoff(base=1, cap=8)
    delays = [backoff.next_delay() for _ in range(8)]
    assert max(delays) <= 8
    assert delays[-1] >= 4
    backoff.reset()
    assert backoff.next_delay() <= 1


def test_credential_is_rotated_before_it_expires(fake, tmp_path):
    fake.credential_ttl = timedelta(hours=3)
    now = [time.time()]
    a = make_agent(fake, tmp_path, clock=lambda: now[0])
    a.start()
    first = a.state.credential
    a.step()
    assert a.state.credential == first

    now[0] += 2.1 * 3600  # past two thirds of its three hours
    a.step()

    assert a.state.credential != first
    assert StateFile(tmp_path / "state.json").load().credential == a.state.credential
    assert fake.requests.count(("POST", f"/api/v1/nodes/{a.state.node_id}/credentials/rotate")) == 1
    assert _node(fake).verdicts == ["applied", "applied"]
    a.shutdown()


def test_the_servers_rotation_hint_rotates_the_credential_at_the_next_heartbeat(fake, agent):
    first = agent.state.credential
    _node(fake).rotate_hint = True
    agent.step()
    assert agent.state.credential == first
    agent.step()
    assert agent.state.credential != first


def test_a_stale_incarnation_answer_makes_the_agent_move_to_a_newer_incarnation(fake, agent):
    agent.step()
    node = _node(fake)
    node.incarnation, node.sequence = 4, 50  # the server saw a later session (a restored state file)
    for _ in range(6):
        agent.step()
        if _node(fake).verdicts[-1] == "applied":
            break

    assert "stale_incarnation" in _node(fake).verdicts
    assert _node(fake).verdicts[-1] == "applied"
    assert agent.state.incarnation > 4
    assert StateFile(agent.config.state_path).load().incarnation == agent.state.incarnation


def test_a_retired_node_stops_the_agent(fake, agent):
    _node(fake).lifecycle = "retired"
    with pytest.raises(AgentExit) as exc:
        agent.step()
    assert exc.value.code == EXIT_RETIRED


def test_stop_event_ends_the_run_with_a_not_ready_farewell(fake, tmp_path):
    a = make_agent(fake, tmp_path, tick=0.01)
    stop = threading.Event()
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", a.run(stop)))
    thread.start()
    deadline = time.monotonic() + 5
    while not (fake.nodes and _node(fake).heartbeats) and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()  # what the SIGTERM handler does
    thread.join(5)

    assert result["code"] == 0
    last = _node(fake).heartbeats[-1]
    assert last["ready"] is False
    assert last["ready_reason"] == "AgentShuttingDown"
    ready = next(c for c in last["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "AgentShuttingDown")


def test_sigterm_stops_the_agent_process_cleanly(fake, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent",
            "--state-file",
            str(tmp_path / "s.json"),
            "run",
            "--url",
            "http://127.0.0.1:9",
            "--bootstrap-token",
            "npb_x.y",
            "--max-backoff",
            "2",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 10
    while not (tmp_path / "s.json.lock").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert "server unavailable" in proc.stderr.read()


def test_a_rotation_that_fails_keeps_the_old_credential_and_is_retried(fake, agent):
    first = agent.state.credential
    _node(fake).rotate_hint = True
    agent.step()
    fake.unavailable = 1  # the rotation request meets a 503
    delay = agent.step()

    assert agent.state.credential == first
    assert delay <= 1.0, "a failed rotation backs off like any failure"
    agent.step()
    assert agent.state.credential != first
    assert _node(fake).verdicts[-1] == "applied"
