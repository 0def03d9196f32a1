"""The real agent comes back as the same node: after a quarantine and a release (a credential
handed over with nodepoolctl and `set-credential`), after an expired credential (a bootstrap token
naming the node), and an imported Kubernetes node taken over (docs/agent.md, "Coming back")."""

from __future__ import annotations

import json
import logging
import stat
from datetime import timedelta

import pytest
from click.testing import CliRunner
from django.utils import timezone

from agent import cli as agent_cli
from agent import recovery
from agent.client import NodeClient
from agent.runner import Agent, AgentConfig, AgentExit
from agent.state import StateFile
from fleet.events import Actor
from fleet.k8s_import import import_nodes
from fleet.models import Node, NodeCredential, NodeEvent
from fleet.services import bootstrap_token_create
from maintenance.services import release_node
from nodepool.tokens import create_user_token
from nodepoolctl.cli import cli as nodepoolctl
from tests.control_plane import ControlPlane
from tests.fleet.test_k8s_import import FIXTURES
from tests.gpu_support import write_fake_nvidia_smi
from tests.races import race


class AgentLog(logging.Handler):
    """What the agent logged at ERROR and above. On the agent's own logger, not the root's: the
    server's logging setup (dictConfig) replaces the root's handlers, caplog's among them."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def agent_log():
    handler = AgentLog()
    logger = logging.getLogger("agent")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def node_token(node_id) -> str:
    _, secret = bootstrap_token_create(pool=None, node_id=node_id, expires_at=timezone.now() + timedelta(hours=1))
    return secret


@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
    fake = write_fake_nvidia_smi(tmp_path / "bin", 2)
    monkeypatch.setenv("PATH", fake.path())
    return fake


def live_agent(url: str, tmp_path, **config) -> Agent:
    cfg = AgentConfig(url=url, state_path=tmp_path / "state.json", work_dir=tmp_path / "work", stop_grace=2.0,
                      renewals=False, xid_source="none", **config)  # fmt: skip
    return Agent(cfg, client=NodeClient(url))


@pytest.mark.django_db(transaction=True)
def test_after_quarantine_and_release_the_agent_takes_the_handed_credential_and_resumes(
    live_server, operator, tmp_path, monkeypatch, agent_log
):
    """nodepoolctl quarantines and releases over HTTP; the running agent is refused, says what to
    do, takes the credential `set-credential` hands it, and resumes as the same node."""
    cp = ControlPlane()
    _, user_token = create_user_token(operator)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    env = {"NODEPOOL_URL": live_server.url, "NODEPOOL_TOKEN": user_token}

    def ctl(*args):
        result = CliRunner().invoke(nodepoolctl, list(args), env=env)
        assert result.exit_code == 0, (result.stdout, result.stderr)
        return result.stdout

    agent = live_agent(live_server.url, tmp_path, bootstrap_token=cp.token)
    agent.start()
    node_id = agent.state.node_id
    agent.step()
    assert agent.heartbeats_applied == 1

    ctl("quarantine", node_id, "--reason", "unexpected outbound traffic")
    delay = agent.step()
    assert agent.refused == "credential_revoked" and delay >= 0.5
    assert f"nodepoolctl release {node_id} --issue-credential" in agent_log.text
    agent.step()  # still refused: backs off further, says it once
    assert agent_log.text.count("retrying it will not help") == 1

    handed = tmp_path / "cred.json"
    out = ctl("release", node_id, "--reason", "reimaged", "--issue-credential", "--credential-file", str(handed))
    assert "set-credential --file" in out
    assert stat.S_IMODE(handed.stat().st_mode) == 0o600
    assert json.loads(handed.read_text())["node_id"] == node_id

    # The agent runs (it holds the state file's lock): the credential is handed beside it.
    assert agent_cli.main(["--state-file", str(tmp_path / "state.json"), "set-credential", "--file", str(handed)]) == 0
    assert recovery.pending_path(tmp_path / "state.json").exists()
    assert agent.take_handed_credential() and agent.refused is None
    agent.step()

    assert agent.heartbeats_applied == 2 and agent.state.node_id == node_id
    assert Node.objects.count() == 1
    node = Node.objects.get()
    assert (node.lifecycle, node.liveness) == ("pending", "alive")  # released: admitted afresh
    assert StateFile(tmp_path / "state.json").load().credential == json.loads(handed.read_text())["credential"]
    agent.shutdown()


@pytest.mark.django_db
@pytest.mark.usefixtures("no_flood_guard")
def test_an_expired_credential_is_replaced_with_a_token_naming_the_node_keeping_identity_and_devices(
    tmp_path, two_gpus, agent_log
):
    cp = ControlPlane()
    token_file = tmp_path / "bootstrap-token"
    token_file.write_text(cp.token)
    agent = cp.make_agent(tmp_path, renewals=False, xid_source="none", bootstrap_token_file=token_file)
    agent.start()
    node_id = agent.state.node_id
    agent.step()
    node = cp.node(node_id)
    assert sorted(d.device_id for d in node.devices.all()) == sorted(two_gpus.uuids)
    incarnation = node.incarnation

    # Partitioned longer than the credential's lifetime.
    NodeCredential.objects.filter(node_id=node_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    agent.step()
    assert agent.refused == "credential_expired"
    assert "bootstrap token naming the node" in agent_log.text
    # The ordinary token in the file is refused for good (it names no node) and not sent again.
    assert [e.body.get("code") for e in cp.exchanges if e.path.endswith("node-enrollments")][-1] == (
        "bootstrap_token_wrong_node"
    )
    agent.step()
    assert len([e for e in cp.exchanges if e.path.endswith("node-enrollments")]) == 2  # enrollment + one refusal

    token_file.write_text(node_token(node_id))  # the operator's token naming the node
    assert agent.step() == 0.0  # re-enrolled at once
    agent.step()

    node = cp.node(node_id)
    assert Node.objects.count() == 1 and agent.state.node_id == node_id
    assert agent.state.incarnation == node.incarnation == incarnation + 1
    assert cp.verdicts(node_id)[-1] == "applied"
    assert node.lifecycle == "pending" and node.liveness == "alive"
    live = node.devices.filter(retired_at__isnull=True)
    assert sorted(d.device_id for d in live) == sorted(two_gpus.uuids)  # its own devices, no conflict
    assert not NodeEvent.objects.filter(node=node, type="device", to_state="conflict").exists()
    assert NodeEvent.objects.filter(node=node, type="taken_over").count() == 1
    agent.shutdown()


@pytest.mark.django_db
@pytest.mark.usefixtures("no_flood_guard")
def test_an_agent_takes_an_imported_kubernetes_node_over_and_it_is_admitted(tmp_path):
    cp = ControlPlane()
    pool = cp.pools["general"]
    import_nodes(text=(FIXTURES / "nodelist-3-workers-aks.json").read_text(), pool=pool, actor=Actor.system("t"))
    imported = Node.objects.order_by("display_name").first()
    assert cp.admit(imported.pk) == "rejected"  # no agent: says so
    check = imported.admission_checks.get(name="agent_version", attempt=1)
    assert check.data["code"] == "agent_missing" and "no agent runs on this node" in check.detail
    release_node(node_id=imported.pk, expected_version=cp.node(imported.pk).version, reason="agent coming",
                 actor=Actor.system("test:operator"))  # fmt: skip

    agent = cp.make_agent(tmp_path, token=node_token(imported.pk), renewals=False, xid_source="none")
    agent.start()
    agent.step()

    assert agent.state.node_id == str(imported.pk) and Node.objects.count() == 3
    assert cp.admit(imported.pk) in ("ready", "admitting")
    node = cp.node(imported.pk)
    assert node.admission_checks.get(name="agent_version", attempt=2).status == "passed"
    assert node.external_id == imported.external_id and node.agent_version == agent.version
    agent.shutdown()


# -- set-credential on its own (no server) ---------------------------------------------------------


def _state(tmp_path, node_id="11111111-1111-4111-8111-111111111111"):
    from agent.state import AgentState

    path = tmp_path / "state.json"
    StateFile(path).save(AgentState(node_id=node_id, credential="npn_old.secret", incarnation=3, sequence=9))
    return path


def test_set_credential_with_the_agent_stopped_writes_the_state_file(tmp_path, capsys):
    path = _state(tmp_path)
    assert agent_cli.main(["--state-file", str(path), "set-credential", "--credential", "npn_new.secret"]) == 0
    state = StateFile(path).load()
    assert (state.credential, state.incarnation, state.sequence) == ("npn_new.secret", 3, 9)
    assert not recovery.pending_path(path).exists() and "saved in" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"node_id": "22222222-2222-4222-8222-222222222222", "credential": "npn_x.y"}', "not this agent's node"),
        ("not a credential", "expected npn_"),
        ("{broken json", "not a credential file"),
    ],
)
def test_set_credential_refuses_another_nodes_or_a_malformed_credential(tmp_path, capsys, text, why):
    path = _state(tmp_path)
    handed = tmp_path / "cred"
    handed.write_text(text)
    assert agent_cli.main(["--state-file", str(path), "set-credential", "--file", str(handed)]) == 2
    assert why in capsys.readouterr().err
    assert StateFile(path).load().credential == "npn_old.secret"


def test_set_credential_without_an_identity_says_enroll_first(tmp_path, capsys):
    code = agent_cli.main(["--state-file", str(tmp_path / "none.json"), "set-credential", "--credential", "npn_a.b"])
    assert code == 2 and "enroll first" in capsys.readouterr().err


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("no_flood_guard")
def test_two_agents_claiming_one_node_with_one_token_have_exactly_one_winner(tmp_path):
    """Two real agents (separate machines, no state file) start at once with the same token naming
    an imported node: one becomes that node, the other is refused and creates nothing."""
    cp = ControlPlane()
    import_nodes(text=(FIXTURES / "nodelist-3-workers-aks.json").read_text(), pool=cp.pools["general"],
                 actor=Actor.system("t"))  # fmt: skip
    imported = Node.objects.order_by("display_name").first()
    token = node_token(imported.pk)
    agents = [cp.make_agent(tmp_path / f"machine-{i}", token=token, renewals=False, xid_source="none") for i in (0, 1)]

    def claim(index: int) -> str:
        try:
            agents[index].start()
            return agents[index].state.node_id
        except AgentExit as exc:
            return str(exc)
        finally:
            agents[index].state_file.unlock()
            agents[index].client.close()

    outcome = race(claim, 2)

    assert not outcome.errors, outcome.errors
    assert outcome.count(str(imported.pk)) == 1, outcome.results
    (loser,) = [r for r in outcome.results if r != str(imported.pk)]
    assert "bootstrap_token_exhausted" in loser
    assert Node.objects.count() == 3
    assert NodeCredential.objects.filter(node=imported, revoked_at__isnull=True).count() == 1
    assert NodeEvent.objects.filter(node=imported, type="taken_over").count() == 1
