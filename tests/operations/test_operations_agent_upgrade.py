"""The real agent carries out an upgrade instruction against the real app: it runs the command its
operator configured for the action (here a small script that checks the artifact's SHA-256 and
swaps a version file), restarts, and comes back with a new incarnation reporting the new version,
which admission then verifies."""

from __future__ import annotations

import hashlib
import sys
import textwrap

import pytest
from django.test import TestCase

from agent import cli as agent_cli
from agent.runner import EXIT_RESTART
from fleet.events import Actor
from operations import rollout, upgrades
from operations.choices import UpgradeState
from operations.models import Upgrade
from tests.control_plane import ControlPlane

pytestmark = pytest.mark.django_db

SCRIPT = textwrap.dedent(
    """
    import hashlib, os, pathlib, sys
    artifact = pathlib.Path(os.environ["NODEPOOL_UPGRADE_ARTIFACT"])
    if hashlib.sha256(artifact.read_bytes()).hexdigest() != os.environ["NODEPOOL_UPGRADE_SHA256"]:
        sys.exit("artifact checksum mismatch")
    pathlib.Path(sys.argv[1]).write_text(os.environ["NODEPOOL_UPGRADE_VERSION"] + "\\n")
    """
)


@pytest.fixture
def setup(tmp_path):
    cp = ControlPlane(heartbeat_interval=1)
    artifact = tmp_path / "agent-2.0.0.tar"
    artifact.write_bytes(b"the new agent")
    version_file = tmp_path / "VERSION"
    version_file.write_text("1.0.0\n")
    script = tmp_path / "swap_version.py"
    script.write_text(SCRIPT)
    config = {
        "version_file": version_file,
        "upgrade_actions": {"agent": [sys.executable, str(script), str(version_file)]},
    }
    agent = cp.make_agent(tmp_path, **config)
    agent.start()
    agent.step()
    cp.admit(agent.state.node_id)
    yield cp, agent, config, artifact, version_file
    if not agent.restart_requested:  # a restarted agent was shut down by its test already
        agent.shutdown()


def instructed(cp, agent) -> bool:
    """Did a status report's answer carry the upgrade instruction to this agent?"""
    return any(
        "upgrade" in ((e.body or {}).get("instructions") or {}) for e in cp.sent(agent.state.node_id, "heartbeats")
    )


def start_upgrade(cp, artifact, sha256=None) -> Upgrade:
    target = {
        "version": "2.0.0",
        "action": "agent",
        "artifact": {"ref": str(artifact), "sha256": sha256 or hashlib.sha256(artifact.read_bytes()).hexdigest()},
    }
    actor = Actor.system("test:operator")
    upgrade = upgrades.upgrade_create(data={"pool": "general", "target": target, "canary_nodes": 0}, actor=actor)
    with TestCase.captureOnCommitCallbacks(execute=True):
        upgrades.upgrade_start(upgrade_id=upgrade.pk, expected_version=upgrade.version, actor=actor)
        rollout.advance(upgrade_id=upgrade.pk)
    return upgrade


def test_the_agent_runs_its_upgrade_command_restarts_and_is_admitted_at_the_new_version(setup, tmp_path):
    cp, agent, config, artifact, version_file = setup
    upgrade = start_upgrade(cp, artifact)
    assert cp.node(agent.state.node_id).lifecycle == "maintenance"

    for _ in range(3):  # a renewal flags "upgrade"; the status report's answer carries the instruction
        agent.step()
        if agent.restart_requested:
            break
    renewals = cp.sent(agent.state.node_id, "renewals")
    assert renewals and renewals[-1].body["flags"] & 256, "the renewal said an upgrade waits"
    instruction = cp.sent(agent.state.node_id, "heartbeats")[-1].body["instructions"]["upgrade"]
    assert instruction["version"] == "2.0.0" and instruction["action"] == "agent"
    assert agent.restart_requested
    assert version_file.read_text().strip() == "2.0.0"

    agent.shutdown()  # what run() does before the CLI re-executes the agent
    restarted = cp.make_agent(tmp_path, **config)
    restarted.start()
    restarted.step()
    sent = cp.heartbeats(agent.state.node_id)[-1]
    assert (sent["incarnation"], sent["agent_version"]) == (2, "2.0.0")
    for _ in range(3):
        with TestCase.captureOnCommitCallbacks(execute=True):
            rollout.advance(upgrade_id=upgrade.pk)
    restarted.shutdown()

    node = cp.node(agent.state.node_id)
    assert (node.lifecycle, node.agent_version, node.incarnation, node.cordoned) == ("ready", "2.0.0", 2, False)
    assert node.admission_checks.get(name="upgrade_target", attempt=node.admission_attempt).status == "passed"
    assert Upgrade.objects.get(pk=upgrade.pk).state == UpgradeState.COMPLETED


def test_an_artifact_whose_checksum_does_not_match_is_not_installed_and_the_agent_does_not_restart(setup):
    cp, agent, _, artifact, version_file = setup
    start_upgrade(cp, artifact, sha256="0" * 64)
    for _ in range(4):  # renewal, status report (the instruction), and again: not retried
        agent.step()
    assert instructed(cp, agent)
    assert not agent.restart_requested
    assert version_file.read_text().strip() == "1.0.0"
    assert cp.node(agent.state.node_id).incarnation == 1


def test_an_action_the_operator_did_not_configure_runs_nothing(setup, tmp_path):
    cp, agent, _, artifact, version_file = setup
    agent.config.upgrade_actions = {}
    start_upgrade(cp, artifact)
    for _ in range(3):
        agent.step()
    assert instructed(cp, agent)
    assert not agent.restart_requested and version_file.read_text().strip() == "1.0.0"


def test_the_cli_re_executes_the_agent_after_an_upgrade(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(agent_cli.Agent, "run", lambda self, stop, once=False: EXIT_RESTART)
    monkeypatch.setattr(agent_cli.os, "execv", lambda path, argv: calls.append(argv))
    monkeypatch.setattr(sys, "argv", ["nodepool-agent", "--url", "http://cp", "--state-file", str(tmp_path / "s")])
    agent_cli.main(["--url", "http://cp", "--state-file", str(tmp_path / "s"), "--upgrade-action", "agent=/bin/true"])
    assert calls and calls[0][1:3] == ["-m", "agent"]
    assert calls[0][3:] == ["--url", "http://cp", "--state-file", str(tmp_path / "s")]
