"""The real agent learns of a spot reclaim from its cloud's instance metadata (or from the
``preempt`` command) and sends the preemption notice to the real app, which drains the node."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from agent import cli as agent_cli
from agent.preemption import GCE_NOTICE_SECONDS, metadata_probe, parse_notice
from agent.runner import rfc3339
from operations.models import Preemption
from operations.upgrade_plan import pool_operations
from tests.control_plane import ControlPlane

pytestmark = pytest.mark.django_db
NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (404, "Not Found", None),  # EC2 before a notice
        (200, json.dumps({"action": "terminate", "time": "2027-01-15T08:02:00Z"}), 1_800_000_120.0),
        (200, json.dumps({"action": "hibernate", "time": "2027-01-15T08:02:00+00:00"}), 1_800_000_120.0),
        (200, "FALSE", None),  # GCE before a notice
        (200, "TRUE", NOW + GCE_NOTICE_SECONDS),
        (200, json.dumps({"action": "reboot", "time": "2027-01-15T08:02:00Z"}), None),  # not a reclaim
        (200, json.dumps({"action": "terminate", "time": "soon"}), None),
        (200, "<html>captive portal</html>", None),
        (500, "TRUE", None),
    ],
)
def test_instance_metadata_answers_are_read_as_the_clouds_publish_them(status, body, expected):
    assert parse_notice(status, body, now=NOW) == expected


def test_the_metadata_probe_sends_its_headers_and_treats_an_unreachable_service_as_no_notice():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Metadata-Flavor"))
        return httpx.Response(200, text="TRUE")

    probe = metadata_probe("http://metadata/preempted", headers={"Metadata-Flavor": "Google"},
                           transport=httpx.MockTransport(handler))  # fmt: skip
    assert probe(NOW) == NOW + GCE_NOTICE_SECONDS and seen == ["Google"]

    def down(request):
        raise httpx.ConnectError("no route to host")

    assert metadata_probe("http://metadata/x", transport=httpx.MockTransport(down))(NOW) is None


def spot_plane(spot: bool = True) -> ControlPlane:
    cp = ControlPlane(heartbeat_interval=1)
    ops = pool_operations(cp.pools["general"])
    ops.spot = spot
    ops.save()
    return cp


def ready_agent(cp, tmp_path, **config):
    agent = cp.make_agent(tmp_path, **config)
    agent.start()
    agent.step()
    cp.admit(agent.state.node_id)
    return agent


def test_the_agent_sends_the_notice_once_when_the_metadata_announces_a_reclaim(tmp_path):
    cp = spot_plane()
    agent = ready_agent(cp, tmp_path, preemption_poll=0)
    announced = []
    agent.preemption_probe = lambda now: announced[0] if announced else None
    try:
        agent.tick()
        assert cp.sent(agent.state.node_id, "preemption-notice") == []
        announced.append(agent.server_now() + 120)
        agent.tick()
        agent.tick()  # sent once, not at every poll
        assert len(cp.sent(agent.state.node_id, "preemption-notice")) == 1
        preemption = Preemption.objects.get(node_id=agent.state.node_id)
        assert preemption.source == "agent"
        assert abs(preemption.deadline.timestamp() - announced[0]) < 1
        assert cp.node(agent.state.node_id).lifecycle in ("draining", "maintenance")  # drained (no leases here)
    finally:
        agent.shutdown()


def test_a_notice_the_server_cannot_take_is_sent_once_and_an_unreachable_server_is_retried(tmp_path):
    cp = spot_plane(spot=False)
    agent = ready_agent(cp, tmp_path, preemption_poll=0)
    agent.preemption_probe = lambda now: now + 120
    try:
        cp.wire.down = True
        agent.tick()
        assert not agent.preemption_sent  # kept for the next poll
        cp.wire.down = False
        agent.tick()
        agent.tick()
        answers = [e.status for e in cp.sent(agent.state.node_id, "preemption-notice")]
        assert answers == [409]  # pool_not_spot, and not sent again
        assert not Preemption.objects.exists()
    finally:
        agent.shutdown()


def test_the_preempt_command_sends_the_notice_with_the_agents_credential(tmp_path, capsys):
    cp = spot_plane()
    agent = ready_agent(cp, tmp_path)
    agent.shutdown()
    args = agent_cli.build_parser().parse_args(["preempt", "--state-file", str(tmp_path / "state.json"), "--in", "90"])
    assert agent_cli._preempt(args, transport=cp.transport) == 0
    preemption = Preemption.objects.get(node_id=agent.state.node_id)
    assert abs(preemption.deadline.timestamp() - (time.time() + 90)) < 5
    assert json.loads(capsys.readouterr().out)["id"] == preemption.pk

    deadline = rfc3339(time.time() + 60)
    args = agent_cli.build_parser().parse_args(["preempt", "--state-file", str(tmp_path / "state.json"),
                                                "--deadline", deadline])  # fmt: skip
    assert agent_cli._preempt(args, transport=cp.transport) == 0  # the same notice, its deadline moved earlier
    preemption.refresh_from_db()
    assert abs(preemption.deadline.timestamp() - (time.time() + 60)) < 5


@pytest.mark.parametrize("argv", [["--deadline", "2027-01-15T08:02:00"], ["--deadline", "tomorrow"]])
def test_the_preempt_command_refuses_a_deadline_without_an_offset(tmp_path, argv, capsys):
    cp = spot_plane()
    agent = ready_agent(cp, tmp_path)
    agent.shutdown()
    args = agent_cli.build_parser().parse_args(["preempt", "--state-file", str(tmp_path / "state.json"), *argv])
    assert agent_cli._preempt(args, transport=cp.transport) == 2
    assert "RFC 3339" in capsys.readouterr().err
    assert not Preemption.objects.exists()


def test_the_preempt_command_without_an_enrolled_state_is_a_configuration_error(tmp_path, capsys):
    args = agent_cli.build_parser().parse_args(["preempt", "--state-file", str(tmp_path / "none.json"), "--in", "30"])
    assert agent_cli._preempt(args) == 2
