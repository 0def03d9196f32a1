"""Upgrade fixes found in testing (issue #34 item 8), through the real API and the workflow's tick:
a canary-paused upgrade resumes only with an explicit override that says what it does; an aborted
upgrade leaves no hold behind; a waiting upgrade names its blocker (the budget and the lease)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from fleet.models import Node, NodeHold
from maintenance.models import DisruptionBudget
from operations import rollout
from operations.choices import UpgradeNodeState, UpgradeState
from operations.models import PoolOperations, Upgrade, UpgradeNode
from tests.maintenance_support import make_lease
from tests.operations_support import FakeAgent, ready_pool

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_flood_guard")]
TARGET = {"version": "2.0.0", "artifact": {"ref": "https://artifacts.example/agent-2.0.0.whl", "sha256": "a" * 64}}


def act(api, upgrade_id, action, version, **body):
    return api.post(f"/api/v1/upgrades/{upgrade_id}/{action}", body, format="json", HTTP_IF_MATCH=f'"{version}"')


def run(agents, upgrade_id, capture, ticks=30):
    for _ in range(ticks):
        with capture(execute=True):
            rollout.advance(upgrade_id=upgrade_id)
        for agent in agents:
            with capture(execute=True):
                agent.beat()
        state = Upgrade.objects.get(pk=upgrade_id).state
        if state not in rollout.TICKING_STATES or state == UpgradeState.PAUSED:
            return state
    return Upgrade.objects.get(pk=upgrade_id).state


def paused_by_its_canary(api, capture):
    """A 3-node pool whose upgrade (auto_rollback off) paused because its canary failed."""
    pool, nodes = ready_pool("general", 3)
    # The failed canary stays out (rejected): the pool's budget and Ready objective leave room.
    type(pool).objects.filter(pk=pool.pk).update(ready_ratio_objective=0.5)
    PoolOperations.objects.create(pool=pool, disruption_budgets=[{"nodes": "2"}])
    agents = [FakeAgent(node, secret) for node, secret in nodes]
    body = {"pool": pool.name, "target": TARGET, "canary_nodes": 1, "soak_seconds": 0, "auto_rollback": False,
            "max_unavailable_nodes": "2"}  # fmt: skip
    upgrade = api.post("/api/v1/upgrades", body, format="json").json()
    with capture(execute=True):
        act(api, upgrade["id"], "start", upgrade["version"])
    canary = UpgradeNode.objects.get(upgrade_id=upgrade["id"], phase="canary")
    next(a for a in agents if a.node.pk == canary.node_id).broken = True
    assert run(agents, upgrade["id"], capture) == UpgradeState.PAUSED
    row = Upgrade.objects.get(pk=upgrade["id"])
    assert row.pause_cause == "canary_failed" and "canary failed" in row.status_reason
    return row, agents, canary.node_id


def test_a_canary_paused_upgrade_refuses_a_plain_resume(operator_api, django_capture_on_commit_callbacks):
    upgrade, _, _ = paused_by_its_canary(operator_api, django_capture_on_commit_callbacks)

    plain = act(operator_api, upgrade.pk, "resume", upgrade.version, reason="looks fine")
    assert plain.status_code == 409 and plain.json()["code"] == "canary_override_required"
    assert set(plain.json()["overrides"]) == {"retry_canary", "retry_canary_on_other_nodes", "skip_canary"}
    no_reason = act(operator_api, upgrade.pk, "resume", upgrade.version, override="skip_canary")
    assert no_reason.status_code == 400 and no_reason.json()["code"] == "invalid_override"
    unknown = act(operator_api, upgrade.pk, "resume", upgrade.version, override="yolo", reason="r")
    assert unknown.status_code == 400
    assert Upgrade.objects.get(pk=upgrade.pk).state == UpgradeState.PAUSED


def test_retrying_the_canary_on_other_nodes_moves_on_and_does_not_pause_again(
    operator_api, django_capture_on_commit_callbacks
):
    upgrade, agents, failed = paused_by_its_canary(operator_api, django_capture_on_commit_callbacks)

    resumed = act(
        operator_api,
        upgrade.pk,
        "resume",
        upgrade.version,
        override="retry_canary_on_other_nodes",
        reason="node-1 has a known bad disk",
    )

    assert resumed.status_code == 200, resumed.content
    assert resumed.json()["state"] == UpgradeState.CANARY
    assert "retry the canary on the next nodes of the roll" in resumed.json()["status_reason"]
    canary = UpgradeNode.objects.get(upgrade_id=upgrade.pk, phase="canary")
    assert canary.node_id != failed and canary.state == UpgradeNodeState.WAITING
    assert run(agents, upgrade.pk, django_capture_on_commit_callbacks) == UpgradeState.COMPLETED


def test_skipping_the_canary_rolls_on(operator_api, django_capture_on_commit_callbacks):
    upgrade, agents, failed = paused_by_its_canary(operator_api, django_capture_on_commit_callbacks)

    resumed = act(operator_api, upgrade.pk, "resume", upgrade.version, override="skip_canary", reason="hotfix")

    assert resumed.status_code == 200, resumed.content
    assert resumed.json()["state"] == UpgradeState.ROLLING
    assert run(agents, upgrade.pk, django_capture_on_commit_callbacks) == UpgradeState.COMPLETED
    assert UpgradeNode.objects.get(upgrade_id=upgrade.pk, node_id=failed).state == UpgradeNodeState.FAILED


def test_an_override_on_an_upgrade_its_canary_did_not_pause_is_refused(
    operator_api, django_capture_on_commit_callbacks
):
    pool, _ = ready_pool("general", 2)
    body = {"pool": pool.name, "target": TARGET, "canary_nodes": 0, "soak_seconds": 0}
    upgrade = operator_api.post("/api/v1/upgrades", body, format="json").json()
    with django_capture_on_commit_callbacks(execute=True):
        started = act(operator_api, upgrade["id"], "start", upgrade["version"]).json()
    paused = act(operator_api, upgrade["id"], "pause", started["version"], reason="lunch").json()
    assert paused["pause_cause"] == "operator"
    refused = act(operator_api, upgrade["id"], "resume", paused["version"], override="skip_canary", reason="r")
    assert refused.status_code == 400 and refused.json()["code"] == "invalid_override"
    with django_capture_on_commit_callbacks(execute=True):
        plain = act(operator_api, upgrade["id"], "resume", paused["version"], reason="back")
    assert plain.status_code == 200 and plain.json()["state"] == UpgradeState.ROLLING


def test_an_aborted_upgrade_leaves_no_hold_behind(operator_api, django_capture_on_commit_callbacks):
    pool, nodes = ready_pool("general", 3)
    PoolOperations.objects.create(pool=pool, disruption_budgets=[{"nodes": "100%"}])
    busy = nodes[0][0]
    make_lease(busy, "job-1")  # its drain (checkpoint) waits: the node stays draining
    body = {"pool": pool.name, "target": TARGET, "canary_nodes": 0, "max_unavailable_nodes": "3"}
    upgrade = operator_api.post("/api/v1/upgrades", body, format="json").json()
    with django_capture_on_commit_callbacks(execute=True):
        started = act(operator_api, upgrade["id"], "start", upgrade["version"]).json()
    with django_capture_on_commit_callbacks(execute=True):
        rollout.advance(upgrade_id=upgrade["id"])
    lifecycles = set(Node.objects.filter(pool=pool).values_list("lifecycle", flat=True))
    assert {"draining", "maintenance"} <= lifecycles
    assert NodeHold.objects.filter(owner="system:upgrade", removed_at__isnull=True).count() == 3

    aborted = act(operator_api, upgrade["id"], "abort", Upgrade.objects.get(pk=upgrade["id"]).version, reason="stop")

    assert aborted.status_code == 200, aborted.content
    assert started["state"] == UpgradeState.ROLLING
    left = NodeHold.objects.filter(node__pool=pool, removed_at__isnull=True)
    assert not left.filter(owner="system:upgrade").exists()
    assert not left.filter(owner__startswith="drain:").exists()
    busy.refresh_from_db()
    assert (busy.lifecycle, busy.cordoned) == ("ready", False)
    assert not UpgradeNode.objects.filter(upgrade_id=upgrade["id"], state__in=["draining", "upgrading"]).exists()


def test_a_waiting_upgrade_names_the_workload_budget_and_the_lease(operator_api, django_capture_on_commit_callbacks):
    pool, nodes = ready_pool("general", 2)
    lease = make_lease(nodes[0][0], "db-1", group="db")
    DisruptionBudget.objects.create(group="db", max_unavailable=0)
    agents = [FakeAgent(node, secret) for node, secret in nodes]
    body = {"pool": pool.name, "target": TARGET, "canary_nodes": 0, "soak_seconds": 0}
    upgrade = operator_api.post("/api/v1/upgrades", body, format="json").json()
    with django_capture_on_commit_callbacks(execute=True):
        act(operator_api, upgrade["id"], "start", upgrade["version"])
    run(agents, upgrade["id"], django_capture_on_commit_callbacks, ticks=8)

    row = Upgrade.objects.get(pk=upgrade["id"])
    assert row.state == UpgradeState.ROLLING
    assert "workload disruption budget of group 'db'" in row.status_reason and str(lease.pk) in row.status_reason
    shown = operator_api.get(f"/api/v1/nodes/{nodes[0][0].pk}/disruption").json()["blocked"]
    assert shown["kind"] == "workload_budget" and shown["blocker"]["lease_id"] == str(lease.pk)


def test_a_machine_failed_by_its_boot_timeout_counts_as_a_failed_scale_attempt(monkeypatch):
    from django.utils import timezone

    from fleet.events import Actor
    from operations import machines, metrics, providers
    from operations.models import ProviderMachine, ScaleDecision

    pool, _ = ready_pool("general", 1)
    PoolOperations.objects.create(pool=pool, provider="webhook", boot_timeout=60)
    decision = ScaleDecision.objects.create(pool=pool, direction="up", outcome="succeeded", count=1, reason="demand")
    long_ago = timezone.now() - timedelta(seconds=600)
    ProviderMachine.objects.create(pool=pool, provider="webhook", name="m-1", decision=decision, requested_at=long_ago)

    class Provider:
        def delete(self, name, data):
            pass

    monkeypatch.setattr(providers, "provider_for", lambda ops: Provider())
    machines.follow_machines(pool_id=pool.pk, actor=Actor.system("system:autoscaler"), now=timezone.now())
    assert ProviderMachine.objects.get(name="m-1").state == "failed"
    assert metrics.samples()["nodepool_scale_attempts_failed_total"] == {("general",): 1}


def test_a_drain_forced_at_its_deadline_names_the_budget_it_overrode():
    from django.utils import timezone

    from fleet.events import Actor
    from fleet.models import NodeEvent
    from maintenance import drains

    _, nodes = ready_pool("general", 1)
    node = nodes[0][0]
    make_lease(node, "db-1", group="db")
    DisruptionBudget.objects.create(group="db", max_unavailable=0)
    now = timezone.now()
    deadline = now + timedelta(seconds=30)
    drain = drains.start_drain(node_id=node.pk, expected_version=node.version, policy="checkpoint",
                               deadline=deadline, reason="bios", actor=Actor.system("t"), now=now)  # fmt: skip

    drains.sweep_drains(actor=Actor.system("t"), now=now + timedelta(seconds=31))

    forced = NodeEvent.objects.get(type="drain", to_state="forced", data__drain_id=str(drain.pk))
    assert forced.data["overrode_budgets"] == [{"group": "db", "allowed": 0, "evicted": 1}]
    assert "overrode the disruption budget of group 'db'" in forced.reason
