"""Heartbeats against the real control plane: sequence numbers, the server's delay (no agent jitter),
backoff, rotation (and the old credential refused after the overlap), quarantine, retirement."""

import threading
import time
from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from agent.backoff import Backoff
from agent.runner import EXIT_RETIRED, AgentExit
from agent.state import StateFile
from fleet import renewals
from fleet.models import Node, NodeCredential, Pool
from tests.control_plane import ControlPlane, problem
from tests.support import node_api

# These tests drive the pre-renewal protocol (a full heartbeat every step, as old agents do) with
# steps back to back; renewals and the flood guard have their own tests (tests/agent/test_agent_renewals.py).
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_flood_guard")]


@pytest.fixture
def cp():
    return ControlPlane(heartbeat_interval=10)


@pytest.fixture
def agent(cp, tmp_path):
    a = cp.make_agent(tmp_path, renewals=False, max_backoff=60.0)
    a.start()
    yield a
    a.shutdown()


def test_heartbeats_carry_increasing_sequences_and_measured_conditions(cp, agent):
    for _ in range(3):
        agent.step()

    beats = cp.heartbeats(agent.state.node_id)
    assert [b["sequence"] for b in beats] == [1, 2, 3]
    assert cp.verdicts(agent.state.node_id) == ["applied"] * 3
    types = {c["type"]: c["status"] for c in beats[0]["conditions"]}
    assert set(types) == {"Ready", "MemoryPressure", "DiskPressure", "PIDPressure"}
    assert types["Ready"] == "True"
    assert beats[0]["usage"]["memory"] > 0
    assert beats[0]["observed_at"].endswith("Z")
    node = Node.objects.get(pk=agent.state.node_id)
    assert (node.incarnation, node.sequence, node.ready) == (1, 3, True)


def test_next_heartbeat_follows_the_servers_delay_without_jitter_of_its_own(cp, agent):
    Pool.objects.filter(name="general").update(heartbeat_interval=25, heartbeat_grace=75)
    renewals.forget_cached_timings()  # a pool edit reaches the answers within 30 s; here at once
    delays, asked = [], []
    for _ in range(20):
        delays.append(agent.step())
        asked.append(agent.last_response["next_heartbeat_in"])

    assert agent.last_response["renewal_interval"] == 25 and agent.interval == 25
    assert all(0.6 * 25 <= n <= 1.4 * 25 for n in asked), "the node's slot, within [0.6, 1.4] x the interval"
    assert delays == asked, "the server spreads the fleet: the agent adds no jitter of its own"


def test_backoff_grows_exponentially_and_stops_at_the_cap_while_the_server_is_away(cp, agent):
    cp.wire.down = True  # a transport fault: the real app cannot make itself unreachable
    delays = [agent.step() for _ in range(10)]

    ceilings = [min(60.0, 2.0**n) for n in range(10)]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert delays[-1] <= 60.0 and delays[-1] >= 30.0

    cp.wire.down = False
    assert 6.0 <= agent.step() <= 14.0, "one answer resets the backoff: the node's slot in the 10 s interval again"
    assert agent.backoff.failures == 0


def test_failed_attempts_never_reuse_a_sequence_number(cp, agent):
    agent.step()
    cp.wire.unavailable = 2  # a proxy's 503s
    agent.step()
    agent.step()
    agent.step()

    assert [b["sequence"] for b in cp.heartbeats(agent.state.node_id)] == [1, 4]
    assert cp.verdicts(agent.state.node_id) == ["applied", "applied"]
    assert Node.objects.get(pk=agent.state.node_id).sequence == 4


def test_retry_after_from_the_server_is_respected(cp, agent):
    cp.wire.intercept = lambda request: (
        problem(429, "throttled", headers={"Retry-After": "42"}) if request.url.path.endswith("/heartbeats") else None
    )
    assert agent.step() >= 42
    cp.wire.intercept = None


def test_backoff_delays_are_capped_and_jittered():
    backoff = Backoff(base=1, cap=8)
    delays = [backoff.next_delay() for _ in range(8)]
    assert max(delays) <= 8
    assert delays[-1] >= 4
    backoff.reset()
    assert backoff.next_delay() <= 1


def test_credential_is_rotated_before_it_expires_and_the_old_one_is_refused_after_the_overlap(cp, tmp_path, settings):
    settings.NODEPOOL = {**settings.NODEPOOL, "CREDENTIAL_TTL": 3 * 3600, "CREDENTIAL_ROTATION_OVERLAP": 300}
    with time_machine.travel(timezone.now(), tick=False) as traveller:
        a = cp.make_agent(tmp_path, renewals=False)
        a.start()
        first = a.state.credential
        a.step()
        assert a.state.credential == first

        traveller.shift(timedelta(hours=2.1))  # past two thirds of its three hours
        a.step()

        assert a.state.credential != first
        assert StateFile(tmp_path / "state.json").load().credential == a.state.credential
        assert cp.requests.count(("POST", f"/api/v1/nodes/{a.state.node_id}/credentials/rotate")) == 1
        assert cp.verdicts(a.state.node_id) == ["applied", "applied"]

        old = node_api(first)
        url = f"/api/v1/nodes/{a.state.node_id}/heartbeats"
        assert NodeCredential.objects.filter(node_id=a.state.node_id).count() == 2
        traveller.shift(timedelta(seconds=299))
        a.step()
        late = {"incarnation": 1, "sequence": 1, "observed_at": timezone.now().isoformat()}  # a late duplicate
        still = old.post(url, late, format="json")
        assert (still.status_code, still.json()["code"]) == (200, "stale_sequence"), "accepted within the overlap"

        traveller.shift(timedelta(seconds=2))
        a.step()
        assert cp.verdicts(a.state.node_id)[-1] == "applied", "the agent already uses the new credential"
        refused = old.post(url, late, format="json")
        assert refused.status_code == 401
        # Reuse of a superseded credential after its overlap is treated as theft: its whole
        # lineage is revoked (docs/fleet.md), so the agent is refused too and must re-enroll.
        assert not NodeCredential.objects.filter(node_id=a.state.node_id, revoked_at__isnull=True).exists()
        a.step()
        assert cp.verdicts(a.state.node_id)[-1] == "http_401"
        a.shutdown()


def test_the_servers_rotation_hint_rotates_the_credential_at_the_next_heartbeat(cp, tmp_path, settings):
    settings.NODEPOOL = {**settings.NODEPOOL, "CREDENTIAL_TTL": 3600}
    with time_machine.travel(timezone.now(), tick=False) as traveller:
        a = cp.make_agent(tmp_path, renewals=False, rotate_at_fraction=0.99)  # so only the server's hint can rotate it
        a.start()
        first = a.state.credential
        traveller.shift(timedelta(minutes=50))  # less than a quarter of its hour left
        a.step()
        assert a.last_response["instructions"]["rotate_credential"] is True
        assert a.state.credential == first
        a.step()
        assert a.state.credential != first
        assert a.last_response["instructions"]["rotate_credential"] is False
        a.shutdown()


def test_a_stale_incarnation_answer_makes_the_agent_move_to_a_newer_incarnation(cp, agent):
    agent.step()
    # The server saw a later session of this identity (a restored state file).
    Node.objects.filter(pk=agent.state.node_id).update(incarnation=4, sequence=50)
    for _ in range(6):
        agent.step()
        if cp.verdicts(agent.state.node_id)[-1] == "applied":
            break

    verdicts = cp.verdicts(agent.state.node_id)
    assert "stale_incarnation" in verdicts
    assert verdicts[-1] == "applied"
    assert agent.state.incarnation > 4
    assert StateFile(agent.config.state_path).load().incarnation == agent.state.incarnation
    assert Node.objects.get(pk=agent.state.node_id).incarnation == agent.state.incarnation


def test_a_quarantined_node_is_refused_with_401_and_the_agent_backs_off(cp, agent):
    agent.step()
    cp.quarantine(agent.state.node_id)

    delays = [agent.step() for _ in range(5)]

    assert cp.verdicts(agent.state.node_id) == ["applied"] + ["http_401"] * 5
    ceilings = [min(60.0, 2.0**n) for n in range(5)]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True)), delays
    assert Node.objects.get(pk=agent.state.node_id).lifecycle == "quarantined"
    assert Node.objects.get(pk=agent.state.node_id).sequence == 1, "a refused heartbeat changes nothing"


def test_a_retired_node_stops_the_agent(cp, agent):
    agent.step()
    cp.retire(agent.state.node_id)
    with pytest.raises(AgentExit) as exc:
        agent.step()
    assert exc.value.code == EXIT_RETIRED


@pytest.mark.django_db(transaction=True)
def test_stop_event_ends_the_run_with_a_not_ready_farewell(cp, tmp_path):
    a = cp.make_agent(tmp_path, renewals=False, tick=0.01)
    stop = threading.Event()
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", a.run(stop)))
    thread.start()
    deadline = time.monotonic() + 10
    while not (a.state.node_id and cp.heartbeats(a.state.node_id)) and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()  # what the SIGTERM handler does
    thread.join(10)

    assert result["code"] == 0
    last = cp.heartbeats(a.state.node_id)[-1]
    assert last["ready"] is False
    assert last["ready_reason"] == "AgentShuttingDown"
    ready = next(c for c in last["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "AgentShuttingDown")
    node = Node.objects.get(pk=a.state.node_id)
    assert (node.ready, node.ready_reason) == (False, "AgentShuttingDown")


def test_sigterm_stops_the_agent_process_cleanly(tmp_path):
    # No server at all (a closed loopback port): the process must still stop promptly on SIGTERM.
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


def test_a_rotation_that_fails_keeps_the_old_credential_and_is_retried(cp, agent):
    first = agent.state.credential
    agent.rotate_requested = True  # as after the server's hint
    cp.wire.unavailable = 1  # the rotation request meets a proxy's 503
    delay = agent.step()

    assert agent.state.credential == first
    assert delay <= 1.0, "a failed rotation backs off like any failure"
    agent.step()
    assert agent.state.credential != first
    assert cp.verdicts(agent.state.node_id)[-1] == "applied"


def test_the_wire_records_real_answers(cp, agent):
    agent.step()
    (enrollment,) = [e for e in cp.exchanges if e.path == "/api/v1/node-enrollments"]
    assert enrollment.status == 201
    assert enrollment.body["node_id"] == agent.state.node_id
