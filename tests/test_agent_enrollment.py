"""The agent enrolls with a bootstrap token, declares the real host, and keeps its state 0600."""

import os
import stat

import pytest

from agent import inventory
from agent.runner import EXIT_CONFIG, AgentExit
from agent.state import AgentState, StateError, StateFile
from tests.fake_control_plane import FakeControlPlane, make_agent


@pytest.fixture
def fake():
    return FakeControlPlane()


def test_first_start_enrolls_with_the_bootstrap_token_and_declares_the_real_host(fake, tmp_path):
    agent = make_agent(fake, tmp_path)
    agent.start()

    (node,) = fake.nodes.values()
    sent = node.enrollment
    assert sent["bootstrap_token"] == "npb_good.secret"
    resources = sent["capability"]["resources"]
    cpus = len(os.sched_getaffinity(0))
    quota = inventory.cgroup_cpu_limit()
    assert resources["cpu"] == f"{int(min(cpus, quota or cpus) * 1000)}m"
    assert int(resources["memory"]) == inventory.memory_bytes()
    assert int(resources["ephemeral-storage"]) == os.statvfs("/").f_blocks * os.statvfs("/").f_frsize
    assert sent["capability"]["features"]["kernel"] == os.uname().release
    assert sent["capability"]["features"]["arch"] == inventory.architecture()
    assert agent.state.node_id == node.id
    assert agent.state.incarnation == 1
    agent.shutdown()


def test_state_file_is_written_with_mode_0600(fake, tmp_path):
    agent = make_agent(fake, tmp_path)
    agent.start()
    agent.shutdown()

    mode = stat.S_IMODE((tmp_path / "state.json").stat().st_mode)
    assert mode == 0o600
    saved = StateFile(tmp_path / "state.json").load()
    assert saved.credential.startswith("npn_")


def test_every_start_bumps_the_incarnation_and_restarts_the_sequence(fake, tmp_path):
    first = make_agent(fake, tmp_path)
    first.start()
    first.step()
    first.step()
    first.shutdown()
    assert StateFile(tmp_path / "state.json").load().sequence == 3  # two heartbeats + the farewell

    second = make_agent(fake, tmp_path)
    second.start()
    second.step()
    second.shutdown()

    assert len(fake.nodes) == 1, "a restart must not enroll a second node"
    node = next(iter(fake.nodes.values()))
    assert [(h["incarnation"], h["sequence"]) for h in node.heartbeats] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2)]
    assert node.verdicts == ["applied"] * 5


def test_state_file_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "state.json"
    StateFile(path).save(AgentState(node_id="n", credential="npn_x.y"))
    os.chmod(path, 0o644)

    with pytest.raises(StateError, match="0600"):
        StateFile(path).load()


def test_a_second_agent_on_the_same_state_file_refuses_to_start(fake, tmp_path):
    first = make_agent(fake, tmp_path)
    first.start()
    second = make_agent(fake, tmp_path)

    with pytest.raises(StateError, match="another agent"):
        second.start()
    first.shutdown()


def test_refused_bootstrap_token_stops_the_agent_with_a_configuration_error(fake, tmp_path):
    agent = make_agent(fake, tmp_path, token="npb_wrong.secret")

    with pytest.raises(AgentExit) as exc:
        agent.start()
    assert exc.value.code == EXIT_CONFIG
    assert "invalid_bootstrap_token" in str(exc.value)
    assert not (tmp_path / "state.json").exists()


def test_without_identity_or_bootstrap_token_the_agent_exits(fake, tmp_path):
    agent = make_agent(fake, tmp_path, token="")

    with pytest.raises(AgentExit, match="no --bootstrap-token"):
        agent.start()


def test_status_command_prints_state_without_the_secret(fake, tmp_path, capsys):
    from agent.cli import main

    agent = make_agent(fake, tmp_path)
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
