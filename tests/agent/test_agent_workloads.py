"""Lease workloads: real subprocesses started, reported, checkpointed and stopped by the agent,
for leases granted, revoked and checkpointed by the real control plane.

These tests wait for real processes (bounded polling); they never assert on timing.
"""

import sys

import pytest

from leases.models import Lease
from tests.control_plane import ControlPlane, wait_until

# These tests drive the pre-renewal protocol (a full heartbeat every step, as old agents do) with
# steps back to back; renewals and the flood guard have their own tests (tests/agent/test_agent_renewals.py).
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_flood_guard")]

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
def cp():
    return ControlPlane()


@pytest.fixture
def agent(cp, tmp_path):
    a = cp.make_agent(tmp_path, renewals=False, stop_grace=0.5)
    a.start()
    a.step()
    assert cp.admit(a.state.node_id) == "ready"
    yield a
    a.shutdown()


def _states(cp, lease):
    return [e["state"] for e in cp.lease_events(lease)]


def _lease(lease):
    return Lease.objects.get(pk=lease.pk)


def test_an_assigned_lease_with_a_command_runs_and_is_reported_running_then_succeeded(cp, agent):
    lease = cp.grant_lease([PY, "-c", "print('hello from the lease')"])
    agent.step()

    assert wait_until(lambda: "succeeded" in _states(cp, lease), step=agent.tick)
    assert _states(cp, lease) == ["running", "succeeded"]
    first = cp.lease_events(lease)[0]
    assert first["fencing_token"] == lease.fencing_token
    assert first["node_incarnation"] == agent.state.incarnation
    assert [status for status, _ in cp.lease_event_answers(lease)] == [200, 200]
    assert (_lease(lease).state, _lease(lease).workload_state) == ("released", "succeeded")
    assert "hello from the lease" in (agent.supervisor.work_dir / f"{lease.pk}.log").read_text()


def test_a_failing_command_is_reported_failed_with_its_exit_code(cp, agent):
    lease = cp.grant_lease([PY, "-c", "raise SystemExit(3)"])
    agent.step()

    assert wait_until(lambda: "failed" in _states(cp, lease), step=agent.tick)
    assert cp.lease_events(lease)[-1]["message"] == "exit 3"
    assert _lease(lease).workload_state == "failed"


def test_a_command_that_cannot_start_is_reported_failed(cp, agent):
    lease = cp.grant_lease(["/nonexistent/binary"])
    agent.step()
    agent.tick()

    assert _states(cp, lease) == ["failed"]
    assert _lease(lease).workload_state == "failed"


def test_lease_events_wait_for_the_next_tick_when_the_next_heartbeat_is_due(cp, agent):
    import time

    lease = cp.grant_lease(["/nonexistent/binary"])
    agent.step()

    agent.tick(until=time.monotonic())  # the heartbeat is due: the backlog keeps
    assert _states(cp, lease) == [] and len(agent.outbox) == 1
    agent.tick(until=time.monotonic() + 60)
    assert _states(cp, lease) == ["failed"] and agent.outbox == []


def test_running_leases_are_reported_in_heartbeats_with_their_fencing_tokens(cp, agent):
    lease = cp.grant_lease([PY, "-c", POLITE])
    agent.step()
    agent.tick()  # sends the "running" event
    agent.step()

    assert cp.heartbeats(agent.state.node_id)[-1]["leases"] == [
        {"lease_id": str(lease.pk), "fencing_token": lease.fencing_token, "state": "running"}
    ]
    assert _lease(lease).state == "active"


def test_a_revoked_lease_is_stopped_with_sigterm_and_reported_failed(cp, agent):
    lease = cp.grant_lease([PY, "-c", POLITE])
    agent.step()
    work = agent.supervisor.work_dir
    assert wait_until(lambda: (work / "started.txt").exists(), step=agent.tick)
    assert cp.revoke_lease(_lease(lease))
    agent.step()

    assert str(lease.pk) in agent.last_response["instructions"]["stop_leases"] or not agent.supervisor.running()
    assert wait_until(lambda: "failed" in _states(cp, lease), step=agent.tick)
    assert (work / "signals.txt").read_text() == "term\n"
    assert "SIGTERM" in cp.lease_events(lease)[-1]["message"] or "not assigned" in cp.lease_events(lease)[-1]["message"]
    assert _lease(lease).state == "revoked"


def test_a_workload_that_ignores_sigterm_is_killed_after_the_grace(cp, agent):
    lease = cp.grant_lease([PY, "-c", STUBBORN])
    agent.step()
    assert wait_until(lambda: (agent.supervisor.work_dir / "started.txt").exists(), step=agent.tick)
    cp.revoke_lease(_lease(lease))
    agent.step()

    assert wait_until(lambda: "failed" in _states(cp, lease), step=agent.tick)
    assert "SIGKILL after grace" in cp.lease_events(lease)[-1]["message"]


def test_a_checkpoint_request_sends_sigusr1_and_reports_checkpointed(cp, agent):
    lease = cp.grant_lease([PY, "-c", POLITE])
    agent.step()
    work = agent.supervisor.work_dir
    assert wait_until(lambda: (work / "started.txt").exists(), step=agent.tick)
    assert cp.request_checkpoint(_lease(lease)) == 1
    agent.step()
    agent.tick()

    assert agent.last_response["instructions"]["checkpoint_leases"] == [str(lease.pk)]
    assert _states(cp, lease) == ["running", "checkpointed"]
    assert wait_until(lambda: (work / "signals.txt").exists() and "usr1" in (work / "signals.txt").read_text())
    assert agent.supervisor.workloads[str(lease.pk)].process.poll() is None, "a checkpoint does not stop the work"
    assert _lease(lease).workload_state == "checkpointed"


def test_work_whose_lease_was_lost_is_stopped(cp, agent):
    from fleet.events import Actor
    from leases.reconcile import lose_node_leases

    lease = cp.grant_lease([PY, "-c", POLITE])
    agent.step()
    assert wait_until(lambda: (agent.supervisor.work_dir / "started.txt").exists(), step=agent.tick)
    # The control plane gave up on it (e.g. during a partition).
    assert lose_node_leases([agent.state.node_id], actor=Actor.system("test"), reason="partition") == 1
    agent.step()

    assert wait_until(lambda: not agent.supervisor.workloads, step=agent.tick)
    assert (agent.supervisor.work_dir / "signals.txt").read_text() == "term\n"
    assert _lease(lease).state == "lost"


def test_work_whose_event_is_refused_with_a_stale_fencing_token_is_stopped(cp, agent, caplog):
    """Stopped, and said at info level: the lease moved on, nothing for an operator to look at."""
    import logging

    caplog.set_level(logging.INFO, logger="agent")
    first = cp.grant_lease([PY, "-c", POLITE], workload_id="job-x")
    cp.revoke_lease(_lease(first))
    replacement = cp.grant_lease([PY, "-c", POLITE], workload_id="job-x")
    assert replacement.fencing_token > first.fencing_token
    # The node still runs the replacement lease under the earlier token (a replacement exists elsewhere).
    agent.supervisor.start(str(replacement.pk), first.fencing_token, [PY, "-c", POLITE])
    agent.outbox.append(_running_event(str(replacement.pk), first.fencing_token))

    assert wait_until(lambda: not agent.supervisor.workloads, step=agent.tick)
    assert cp.lease_event_answers(replacement)[0] == (409, "stale_fencing_token")
    said = [r for r in caplog.records if "no longer this node's" in r.getMessage()]
    assert said and all(r.levelno == logging.INFO for r in said)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "refused" in r.getMessage()]


def _running_event(lease_id, token):
    from agent.workloads import LeaseEvent

    return LeaseEvent(lease_id, token, "running")


def test_a_finished_lease_is_not_started_again(cp, agent):
    lease = cp.grant_lease([PY, "-c", "pass"])
    agent.step()
    assert wait_until(lambda: "succeeded" in _states(cp, lease), step=agent.tick)
    announced = {"lease_id": str(lease.pk), "fencing_token": lease.fencing_token, "command": [PY, "-c", "pass"]}
    agent.reconcile_leases([announced])  # an answer written before the release, arriving late
    agent.step()
    agent.tick()

    assert _states(cp, lease) == ["running", "succeeded"]


def test_shutdown_stops_workloads_and_reports_them(cp, tmp_path):
    a = cp.make_agent(tmp_path, renewals=False, stop_grace=0.5)
    a.start()
    a.step()
    cp.admit(a.state.node_id)
    lease = cp.grant_lease([PY, "-c", POLITE])
    a.step()
    assert wait_until(lambda: (a.supervisor.work_dir / "started.txt").exists(), step=a.tick)
    a.shutdown()

    assert _states(cp, lease) == ["running", "failed"]
    assert "agent shutting down" in cp.lease_events(lease)[-1]["message"]
    assert (_lease(lease).state, _lease(lease).workload_state) == ("released", "failed")


def test_another_conflict_on_an_event_does_not_stop_the_work(cp, agent, monkeypatch):
    from agent.client import ApiError

    lease = cp.grant_lease([PY, "-c", POLITE])
    agent.step()
    assert wait_until(lambda: (agent.supervisor.work_dir / "started.txt").exists(), step=agent.tick)

    def refuse(lease_id, body):
        raise ApiError(409, "transition_not_allowed", "already checkpointing")

    monkeypatch.setattr(agent.client, "lease_event", refuse)
    cp.request_checkpoint(_lease(lease))
    agent.step()
    agent.tick()

    assert agent.supervisor.workloads[str(lease.pk)].state == "running"


# Copies its secret from the environment and the file, then waits to be told to go on.
SECRET_READER = (
    "import os,time\n"
    "open('env-secret.txt','w').write(os.environ.get('NODEPOOL_LEASE_SECRET',''))\n"
    "open('file-path.txt','w').write(os.environ.get('NODEPOOL_LEASE_SECRET_FILE',''))\n"
    "while not os.path.exists('go'): time.sleep(0.05)\n"
    "open('file-secret.txt','w').write(open(os.environ['NODEPOOL_LEASE_SECRET_FILE']).read())\n"
)


def test_the_lease_secret_reaches_the_workload_follows_a_renewal_is_never_logged_and_is_removed_at_the_end(
    cp, agent, caplog
):
    from fleet.events import Actor
    from leases import secrets
    from leases.fencing import lease_renew

    caplog.set_level("DEBUG")
    lease = cp.grant_lease([PY, "-c", SECRET_READER], ttl_seconds=600)
    agent.step()
    work = agent.supervisor.work_dir
    assert wait_until(lambda: (work / "file-path.txt").exists() and (work / "env-secret.txt").exists(), step=agent.tick)
    first = (work / "env-secret.txt").read_text()
    assert first == secrets.secret_for(_lease(lease)) and secrets.verify_lease_secret(first).valid
    secret_file = work / f"{lease.pk}.secret"
    assert secret_file.samefile((work / "file-path.txt").read_text())
    assert oct(secret_file.stat().st_mode & 0o777) == "0o600"
    # A renewal re-derives the secret (its expiry moved): the file the workload reads follows it.
    import time_machine
    from django.utils import timezone

    with time_machine.travel(timezone.now() + timezone.timedelta(seconds=5)):
        renewed = lease_renew(
            lease_id=lease.pk,
            data={
                "fencing_token": lease.fencing_token,
                "node_incarnation": agent.state.incarnation,
                "ttl_seconds": 900,
            },
            user=cp.client_user(),
            actor=Actor.system("test"),
        )
    second = secrets.secret_for(renewed)
    assert second != first
    agent.step()
    (work / "go").write_text("")
    assert wait_until(lambda: "succeeded" in _states(cp, lease), step=agent.tick)
    assert (work / "file-secret.txt").read_text() == second
    assert not secret_file.exists()
    assert first not in caplog.text and second not in caplog.text
