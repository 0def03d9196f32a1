"""The agent enrolls with a bootstrap token, declares the real host, and keeps its state 0600."""

import os
import stat

import pytest

from agent import inventory
from agent.runner import EXIT_CONFIG, AgentExit
from agent.state import AgentState, StateError, StateFile
from fleet.models import Node
from tests.control_plane import ControlPlane

# These tests drive the pre-renewal protocol (a full heartbeat every step, as old agents do) with
# steps back to back; renewals and the flood guard have their own tests (tests/agent/test_agent_renewals.py).
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_flood_guard")]


@pytest.fixture
def cp():
    return ControlPlane()


def make_agent(cp, tmp_path, **config):
    return cp.make_agent(tmp_path, renewals=False, **config)


def _enrollments(cp):
    return [e for e in cp.exchanges if e.path == "/api/v1/node-enrollments"]


def test_first_start_enrolls_with_the_bootstrap_token_and_declares_the_real_host(cp, tmp_path):
    agent = make_agent(cp, tmp_path)
    agent.start()

    (node,) = Node.objects.all()
    (exchange,) = _enrollments(cp)
    sent = exchange.request
    assert exchange.status == 201
    assert sent["bootstrap_token"] == cp.token
    resources = sent["capability"]["resources"]
    cpus = len(os.sched_getaffinity(0))
    quota = inventory.cgroup_cpu_limit()
    assert resources["cpu"] == f"{int(min(cpus, quota or cpus) * 1000)}m"
    assert int(resources["memory"]) == inventory.memory_bytes()
    assert int(resources["ephemeral-storage"]) == os.statvfs("/").f_blocks * os.statvfs("/").f_frsize
    assert sent["capability"]["features"]["kernel"] == os.uname().release
    assert sent["capability"]["features"]["arch"] == inventory.architecture()
    assert agent.state.node_id == str(node.pk)
    assert agent.state.incarnation == 1
    assert (node.pool.name, node.lifecycle, node.hostname) == ("general", "pending", sent["hostname"])
    assert node.declared["resources"]["memory"] == inventory.memory_bytes()
    agent.shutdown()


def test_state_file_is_written_with_mode_0600(cp, tmp_path):
    agent = make_agent(cp, tmp_path)
    agent.start()
    agent.shutdown()

    mode = stat.S_IMODE((tmp_path / "state.json").stat().st_mode)
    assert mode == 0o600
    saved = StateFile(tmp_path / "state.json").load()
    assert saved.credential.startswith("npn_")


def test_every_start_bumps_the_incarnation_and_restarts_the_sequence(cp, tmp_path):
    first = make_agent(cp, tmp_path)
    first.start()
    first.step()
    first.step()
    first.shutdown()
    assert StateFile(tmp_path / "state.json").load().sequence == 3  # two heartbeats + the farewell

    second = make_agent(cp, tmp_path)
    second.start()
    second.step()
    second.shutdown()

    (node,) = Node.objects.all()  # a restart must not enroll a second node
    beats = cp.heartbeats(node.pk)
    assert [(h["incarnation"], h["sequence"]) for h in beats] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2)]
    assert cp.verdicts(node.pk) == ["applied"] * 5
    assert (node.incarnation, node.sequence, node.restart_count) == (2, 2, 1)


def test_state_file_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "state.json"
    StateFile(path).save(AgentState(node_id="n", credential="npn_x.y"))
    os.chmod(path, 0o644)

    with pytest.raises(StateError, match="0600"):
        StateFile(path).load()


def test_a_second_agent_on_the_same_state_file_refuses_to_start(cp, tmp_path):
    first = make_agent(cp, tmp_path)
    first.start()
    second = make_agent(cp, tmp_path)

    with pytest.raises(StateError, match="another agent"):
        second.start()
    first.shutdown()


def test_refused_bootstrap_token_stops_the_agent_with_a_configuration_error(cp, tmp_path):
    agent = make_agent(cp, tmp_path, token="npb_wrong.secret")

    with pytest.raises(AgentExit) as exc:
        agent.start()
    assert exc.value.code == EXIT_CONFIG
    assert "403 bootstrap_token_invalid" in str(exc.value)
    assert not (tmp_path / "state.json").exists()
    assert not Node.objects.exists()


def test_without_identity_or_bootstrap_token_the_agent_exits(cp, tmp_path):
    agent = make_agent(cp, tmp_path, token="")

    with pytest.raises(AgentExit, match="no --bootstrap-token"):
        agent.start()


def test_status_command_prints_state_without_the_secret(cp, tmp_path, capsys):
    from agent.cli import main

    agent = make_agent(cp, tmp_path)
    agent.start()
    agent.shutdown()

    assert main(["--state-file", str(tmp_path / "state.json"), "status"]) == 0
    out = capsys.readouterr().out
    assert agent.state.node_id in out
    assert agent.state.credential not in out


def test_a_bare_invocation_means_run_and_without_a_token_exits_with_a_configuration_error(tmp_path):
    from agent.cli import main

    assert main(["--url", "http://127.0.0.1:9", "--state-file", str(tmp_path / "s.json"), "--once"]) == EXIT_CONFIG
    assert not (tmp_path / "s.json").exists()


def test_the_command_line_puts_the_processs_signal_handlers_back(tmp_path):
    """The agent's SIGTERM/SIGINT handlers live as long as its loop: run in process (as here), it
    must not leave the host process unable to be stopped."""
    import signal

    from agent.cli import main

    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    assert main(["--url", "http://127.0.0.1:9", "--state-file", str(tmp_path / "s.json"), "--once"]) == EXIT_CONFIG
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
