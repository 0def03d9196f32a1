"""nodepoolctl release --issue-credential against a live test server (the credential for the agent)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fleet.events import Actor
from maintenance.services import quarantine_node
from nodepool.tokens import create_user_token
from nodepoolctl.cli import cli
from tests.factories import PoolFactory, make_schedulable_node


def test_a_credential_file_without_issue_credential_is_a_usage_error_and_sends_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    env = {"NODEPOOL_URL": "http://127.0.0.1:9", "NODEPOOL_TOKEN": "unused"}  # nothing listens: nothing is sent
    result = CliRunner().invoke(
        cli, ["release", "n1", "--reason", "r", "--credential-file", str(tmp_path / "c")], env=env
    )
    assert result.exit_code == 2 and "--credential-file needs --issue-credential" in result.stderr
    assert not (tmp_path / "c").exists()


@pytest.mark.django_db(transaction=True)
def test_release_with_issue_credential_prints_the_credential_once_and_how_to_use_it(
    live_server, operator, monkeypatch, tmp_path
):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    node, _ = make_schedulable_node(PoolFactory(name="general"), hostname="gpu-1")
    quarantine_node(node_id=node.pk, reason="incident", evidence={}, actor=Actor.system("test"))
    _, token = create_user_token(operator)

    result = CliRunner().invoke(cli, ["release", "gpu-1", "--reason", "reimaged", "--issue-credential"],
                                env={"NODEPOOL_URL": live_server.url, "NODEPOOL_TOKEN": token})  # fmt: skip

    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "node/gpu-1 released"
    secret = lines[1].removeprefix("credential (shown once): ")
    assert secret.startswith("npn_") and lines[2] == f"on the node: nodepool-agent set-credential --credential {secret}"
    assert node.credentials.filter(revoked_at__isnull=True).count() == 1
