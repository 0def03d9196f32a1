"""The real agent carries out a repair reboot instruction against the real app: it runs only the
reboot command its operator configured (here a fake command that records what it was given),
never anything the server sends, at most once per repair, and restarts so the control plane sees
the reboot (a new incarnation) and verifies the node's health before it returns to service."""

from __future__ import annotations

import sys
import textwrap
from datetime import timedelta

import pytest
from django.test import TestCase
from django.utils import timezone

from agent import repair as agent_repair
from fleet.events import Actor
from operations import outofservice, repair
from operations.choices import RepairState
from operations.models import PoolOperations, Repair
from tests.control_plane import ControlPlane

pytestmark = pytest.mark.django_db

FAKE_REBOOT = textwrap.dedent(
    """
    import os, pathlib, sys
    pathlib.Path(sys.argv[1]).open("a").write(
        os.environ["NODEPOOL_REPAIR_ACTION"] + " " + os.environ["NODEPOOL_REPAIR_ID"] + "\\n")
    """
)


@pytest.fixture
def fake_command(tmp_path):
    script, marker = tmp_path / "fake_reboot.py", tmp_path / "rebooted"
    script.write_text(FAKE_REBOOT)
    return [sys.executable, str(script), str(marker)], marker


def test_only_the_configured_command_runs_once_per_repair(fake_command):
    argv, marker = fake_command
    repairs = agent_repair.Repairs(commands={"reboot": argv})
    # Whatever else the instruction carries, the agent runs its own command for the action.
    result = repairs.carry_out({"repair_id": "r-1", "action": "reboot", "command": "rm -rf /tmp/x"})
    assert (result.ran, result.ok) == (True, True)
    assert marker.read_text() == "reboot r-1\n"
    again = repairs.carry_out({"repair_id": "r-1", "action": "reboot"})
    assert again.ran is False and marker.read_text() == "reboot r-1\n"


def test_an_unconfigured_action_or_a_missing_command_runs_nothing(fake_command):
    argv, marker = fake_command
    assert agent_repair.Repairs(commands={}).carry_out({"repair_id": "r", "action": "reboot"}).ok is False
    other = agent_repair.Repairs(commands={"reboot": argv}).carry_out({"repair_id": "r", "action": "reimage"})
    assert (other.ran, other.ok) == (False, False)
    assert not marker.exists()


def test_a_failing_command_is_reported_and_does_not_restart(tmp_path):
    repairs = agent_repair.Repairs(commands={"reboot": [sys.executable, "-c", "import sys; sys.exit('no')"]})
    assert agent_repair.handle(repairs, {"repair_id": "r", "action": "reboot"}) is False


def test_the_reboot_command_comes_from_the_option_or_the_environment():
    assert agent_repair.reboot_command_from("systemctl reboot", {}) == ["systemctl", "reboot"]
    env = {agent_repair.ENV_REBOOT_COMMAND: "/sbin/shutdown -r now"}
    assert agent_repair.reboot_command_from(None, env) == ["/sbin/shutdown", "-r", "now"]
    assert agent_repair.reboot_command_from(None, {}) == []


def test_the_agent_reboots_for_a_repair_and_comes_back_healthy(tmp_path, fake_command):
    argv, marker = fake_command
    cp = ControlPlane(heartbeat_interval=1)
    healthy = {"ok": False}

    def conditions():
        status = "True" if healthy["ok"] else "False"
        return [{"type": "Ready", "status": status, "reason": "Probe", "message": ""}]

    config = {"repair_reboot_command": argv}
    agent = cp.make_agent(tmp_path, **config)
    agent.measure_conditions = conditions
    agent.start()
    agent.step()
    node_id = agent.state.node_id
    cp.admit(node_id)
    node = cp.node(node_id)
    PoolOperations.objects.update_or_create(
        pool_id=node.pool_id,
        defaults={"repair_rules": [{"condition": "Ready", "status": "False", "for": 10, "action": "reboot"}],
                  "repair_max_unhealthy": 1.0},
    )  # fmt: skip
    agent.step()
    actor = Actor.system(outofservice.REPAIR)
    with TestCase.captureOnCommitCallbacks(execute=True):
        repair.sweep(now=timezone.now() + timedelta(seconds=30), actor=actor)
    with TestCase.captureOnCommitCallbacks(execute=True):
        repair.sweep(now=timezone.now() + timedelta(seconds=40), actor=actor)
    assert Repair.objects.get().state == RepairState.REBOOTING
    for _ in range(3):
        agent.step()
        if agent.restart_requested:
            break
    assert agent.restart_requested
    assert marker.read_text() == f"reboot {Repair.objects.get().pk}\n"
    agent.shutdown()
    healthy["ok"] = True
    restarted = cp.make_agent(tmp_path, **config)
    restarted.measure_conditions = conditions
    restarted.start()
    restarted.step()
    for seconds in (50, 60):
        with TestCase.captureOnCommitCallbacks(execute=True):
            repair.sweep(now=timezone.now() + timedelta(seconds=seconds), actor=actor)
    restarted.shutdown()
    done = Repair.objects.get()
    assert done.state == RepairState.SUCCEEDED, done.detail
    node = cp.node(node_id)
    assert (node.lifecycle, node.incarnation, node.cordoned) == ("ready", 2, False)
