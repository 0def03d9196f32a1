"""Lease workloads: real subprocesses started, reported, checkpointed and stopped by the agent.

These tests wait for real processes (bounded polling); they never assert on timing.
"""

import sys

import pytest

from tests.fake_control_plane import FakeControlPlane, make_agent, wait_until

PY = sys.executable
# Writes "term" to a file on SIGTERM and exits 0; "usr1" on SIGUSR1 and keeps running.
POLITE = (
    "import signal,sys,time\n"
    "def term(*a):\n    open('signals.txt','a').write('term\\n'); sys.exit(0)\n"
    "def usr1(*a):\n    open('signals.txt','a').write('usr1\\n')\n"
    "signal.signal(signal.SIGTERM, term); signal.signal(signal.SIGUSR1, usr1)\n"
    "open('started.txt','w').write('ok')\n"
    "while True: time.sleep(0.05)\n"
)
STUBBORN = (
    "import signal,time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "open('started.txt','w').write('ok')\nwhile True: time.sleep(0.05)\n"
)


@pytest.fixture
def fake():
    return FakeControlPlane()


@pytest.fixture
def agent(fake, tmp_path):
    a = make_agent(fake, tmp_path, stop_grace=0.5)
    a.start()
    yield a
    a.shutdown()


def _node(fake):
    return next(iter(fake.nodes.values()))


def _states(lease):
    return [e["state"] for e in lease.events]


def test_an_assigned_lease_with_a_command_runs_and_is_reported_running_then_succeeded(fake, agent):
    lease = fake.grant_lease(_node(fake).id, [PY, "-c", "print('hello from the lease')"])
    agent.step()

    assert wait_until(lambda: "succeeded" in _states(lease), step=agent.tick)
    assert _states(lease) == ["running", "succeeded"]
    assert lease.events[0]["fencing_token"] == lease.fencing_token
    assert lease.events[0]["node_incarnation"] == agent.state.incarnation
    assert "hello from the lease" in (agent.supervisor.work_dir / f"{lease.id}.log").read_text()


def test_a_failing_command_is_reported_failed_with_its_exit_code(fake, agent):
    lease = fake.grant_lease(_node(fake).id, [PY, "-c", "raise SystemExit(3)"])
    agent.step()

    assert wait_until(lambda: "failed" in _states(lease), step=agent.tick)
    assert lease.events[-1]["message"] == "exit 3"


def test_a_command_that_cannot_start_is_reported_failed(fake, agent):
    lease = fake.grant_lease(_node(fake).id, ["/nonexistent/binary"])
    agent.step()
    agent.tick()

    assert _states(lease) == ["failed"]


def test_running_leases_are_reported_in_heartbeats_with_their_fencing_tokens(fake, agent, tmp_path):
    lease = fake.grant_lease(_node(fake).id, [PY, "-c", POLITE])
    agent.step()
    agent.step()

    assert _node(fake).heartbeats[-1]["leases"] == [
        {"lease_id": lease.id, "fencing_token": lease.fencing_token, "state": "running"}
    ]


def test_a_stop_instruction_sends_sigterm_and_reports_the_lease_failed(fake, agent):
    lease = fake.grant_lease(_node(fake).id, [PY, "-c", POLITE])
    agent.step()
    work = agent.supervisor.work_dir
    assert wait_until(lambda: (work / "started.txt").exists(), step=agent.tick)

    _node(fake).stop_leases = [lease.id]
    agent.step()

    assert wait_until(lambda: "failed" in _states(lease), step=agent.tick)
    assert (work / "signals.txt").read_text() == "term\n"
    assert "by SIGTERM" in lease.events[-1]["message"]


def test_a_workload_that_ignores_sigterm_is_killed_after_the_grace(fake, agent):
    lease = fake.grant_lease(_node(fake).id, [PY, "-c", STUBBORN])
    agent.step()
    assert wait_until(lambda: (agent.supervisor.work_dir / "started.txt").exists(), step=agent.tick)

    _node(fake).stop_leases = [lease.id]
    agent.step()

    assert wait_until(lambda: "failed" in _states(lease), step=agent.tick)
    assert "SIGKILL after grace" in lease.events[-1]["message"]


def test_a_checkpoint_instruction_sends_sigusr1_and_reports_checkpointed(fake, agent):
    lease = fake.grant_lease(_node(fake).id, [PY, "-c", POLITE])
    agent.step()
    work = agent.supervisor.work_dir
    assert wait_until(lambda: (work / "started.txt").exists(), step=agent.tick)

    _node(fake).checkpoint_leases = [lease.id]
    agent.step()
    agent.tick()

    assert _states(lease) == ["running", "checkpointed"]
    assert wait_until(lambda: (work / "signals.txt").exists() and "usr1" in (work / "signals.txt").read_text())
    assert agent.supervisor.workloads[lease.id].process.poll() is None, "a checkpoint does not stop the work"


def test_work_no_longer_assigned_to_the_node_is_stopped(fake, agent):
    lease = fake.grant_lease(_node(fake).id, [PY, "-c", POLITE])
    agent.step()
    assert wait_until(lambda: (agent.supervisor.work_dir / "started.txt").exists(), step=agent.tick)

    lease.state = "lost"  # the control plane gave up on it (e.g. during a partition)
    agent.step()

    assert wait_until(lambda: not agent.supervisor.workloads, step=agent.tick)
    assert (agent.supervisor.work_dir / "signals.txt").read_text() == "term\n"


def test_work_whose_event_is_refused_with_a_stale_fencing_token_is_stopped(fake, agent):
    lease = fake.grant_lease(_node(fake).id, [PY, "-c", POLITE])
    lease.fencing_token, announced = 9, lease.fencing_token  # a replacement exists elsewhere
    agent.supervisor.start(lease.id, announced, [PY, "-c", POLITE])
    agent.outbox.append(agent.supervisor.checkpoint(lease.id) or _running_event(lease.id, announced))

    assert wait_until(lambda: not agent.supervisor.workloads, step=agent.tick)


def _running_event(lease_id, token):
    from agent.workloads import LeaseEvent

    return LeaseEvent(lease_id, token, "running")


def test_a_finished_lease_is_not_started_again(fake, agent):
    lease = fake.grant_lease(_node(fake).id, [PY, "-c", "pass"])
    agent.step()
    assert wait_until(lambda: "succeeded" in _states(lease), step=agent.tick)
    lease.state = "active"  # the server still lists it for a moment

    agent.step()
    agent.tick()

    assert _states(lease) == ["running", "succeeded"]


def test_shutdown_stops_workloads_and_reports_them(fake, tmp_path):
    a = make_agent(fake, tmp_path, stop_grace=0.5)
    a.start()
    lease = fake.grant_lease(_node(fake).id, [PY, "-c", POLITE])
    a.step()
    assert wait_until(lambda: (a.supervisor.work_dir / "started.txt").exists(), step=a.tick)

    a.shutdown()

    assert _states(lease) == ["running", "failed"]
    assert "agent shutting down" in lease.events[-1]["message"]


def test_another_conflict_on_an_event_does_not_stop_the_work(fake, agent, monkeypatch):
    from agent.client import ApiError

    lease = fake.grant_lease(_node(fake).id, [PY, "-c", POLITE])
    agent.step()
    assert wait_until(lambda: (agent.supervisor.work_dir / "started.txt").exists(), step=agent.tick)

    def refuse(lease_id, body):
        raise ApiError(409, "transition_not_allowed", "already checkpointing")

    monkeypatch.setattr(agent.client, "lease_event", refuse)
    _node(fake).checkpoint_leases = [lease.id]
    agent.step()
    agent.tick()

    assert agent.supervisor.workloads[lease.id].state == "running"
