"""The agent against the real control plane: it renews often and sends its status report on
change, when a flag asks (a granted lease, a drain), and at least every status-report interval."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.test import TestCase

from agent.reporting import FLAG_ROTATE_CREDENTIAL
from fleet.models import Node, NodeCredential
from tests.control_plane import ControlPlane

pytestmark = pytest.mark.django_db


@pytest.fixture
def cp():
    return ControlPlane(heartbeat_interval=10)


@pytest.fixture
def clock(monkeypatch, time_machine):
    """Moves the server's clock (time-machine) and the agent's monotonic clock together."""
    import agent.runner as runner

    state = {"t": 1000.0}
    time_machine.move_to(datetime.now(UTC), tick=False)
    monkeypatch.setattr(runner.time, "monotonic", lambda: state["t"])

    def advance(seconds: float) -> None:
        state["t"] += seconds
        time_machine.shift(seconds)

    return advance


@pytest.fixture
def agent(cp, tmp_path):
    a = cp.make_agent(tmp_path)
    a.start()
    yield a
    a.shutdown()


def renewals(cp, node_id) -> list[tuple[int, str]]:
    return [(e.request["sequence"], e.body.get("code", e.status)) for e in cp.sent(node_id, "renewals")]


def test_the_first_message_is_a_status_report_then_renewals_while_nothing_changes(cp, agent, clock):
    for _ in range(4):
        agent.step()
        clock(10)
    node_id = agent.state.node_id
    assert [b["sequence"] for b in cp.heartbeats(node_id)] == [1]
    assert renewals(cp, node_id) == [(2, "applied"), (3, "applied"), (4, "applied")]
    node = Node.objects.get(pk=node_id)
    assert node.sequence == 4 and node.liveness == "alive"


def test_a_granted_lease_reaches_the_agent_at_its_next_renewal(cp, agent, clock):
    agent.step()
    cp.admit(agent.state.node_id)
    clock(10)
    agent.step()  # the lifecycle changed (admitted): the renewal's flag asks for a report
    assert agent.step() is not None
    clock(10)
    with TestCase.captureOnCommitCallbacks(execute=True):  # the flag is raised when the grant commits
        lease = cp.grant_lease(["sleep", "30"])
    assert agent.step() == 0.0, "the renewal's flag asks for a status report at once"
    agent.step()  # the status report: its answer assigns the lease, which the agent starts
    assert str(lease.pk) in agent.supervisor.workloads
    assert Node.objects.get(pk=agent.state.node_id).instructions == 0


def test_a_started_drain_reaches_the_agent_at_its_next_renewal(cp, agent, clock, operator_api):
    agent.step()
    cp.admit(agent.state.node_id)
    clock(10)
    agent.step()
    agent.step()
    node = Node.objects.get(pk=agent.state.node_id)
    with TestCase.captureOnCommitCallbacks(execute=True):
        drained = operator_api.post(
            f"/api/v1/nodes/{node.pk}/drain", {"reason": "kernel update", "deadline_in": 600}, format="json",
            HTTP_IF_MATCH=f'"{node.version}"',
        )  # fmt: skip
    assert drained.status_code == 201, drained.content
    clock(10)
    assert agent.step() == 0.0
    agent.step()
    assert agent.last_response["lifecycle"] == "maintenance"


def test_the_status_report_goes_at_least_every_status_report_interval(cp, agent, clock):
    for _ in range(8):
        agent.step()
        clock(10)
    # The server says 60 s; the seventh message is 60 s after the first.
    assert agent.status_report_interval == 60
    assert [b["sequence"] for b in cp.heartbeats(agent.state.node_id)] == [1, 7]


def test_the_rotation_flag_rotates_the_credential_without_a_status_report(cp, agent, clock):
    agent.step()
    clock(10)
    credential = NodeCredential.objects.filter(node_id=agent.state.node_id).latest("issued_at")
    # Under a quarter of its lifetime left: the next renewal raises the rotation flag.
    now = datetime.now(UTC)
    NodeCredential.objects.filter(pk=credential.pk).update(
        issued_at=now - timedelta(hours=23), expires_at=now + timedelta(hours=1)
    )
    agent.step()
    assert agent.rotate_requested is True
    clock(10)
    agent.step()
    rotations = [r for r in cp.requests if r[1].endswith("/credentials/rotate")]
    assert len(rotations) == 1 and [b["sequence"] for b in cp.heartbeats(agent.state.node_id)] == [1]
    assert FLAG_ROTATE_CREDENTIAL == 16


def test_an_agent_without_renewals_keeps_working_with_full_heartbeats(cp, tmp_path, clock):
    old = cp.make_agent(tmp_path, renewals=False)
    old.start()
    try:
        for _ in range(3):
            old.step()
            clock(10)
    finally:
        old.shutdown()
    assert cp.verdicts(old.state.node_id)[:3] == ["applied"] * 3
    assert cp.sent(old.state.node_id, "renewals") == []
