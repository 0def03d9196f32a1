"""Rolling upgrades through the API and the workflow's tick (tasks eager; a real worker runs them
in tests/operations/test_operations_e2e.py): canary, soak, roll within max_unavailable, admission verifying
the target, automatic rollback, pause on failures, operator actions with expected versions."""

from __future__ import annotations

import pytest

from fleet.choices import Lifecycle
from fleet.models import Node, NodeEvent
from operations import rollout
from operations.choices import UpgradeNodeState, UpgradeState
from operations.models import PoolOperations, Upgrade, UpgradeNode
from tests.operations_support import FakeAgent, ready_pool

# These tests are about the roll's order, and their agents restart back to back (a roll forward, then
# a rollback, within seconds): the flood guard would refuse the second restart's first report, which
# a real agent sends again after Retry-After (tests/fleet/test_renewals_flood.py tests the guard).
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_flood_guard")]

TARGET = {"version": "2.0.0", "artifact": {"ref": "https://artifacts.example/agent-2.0.0.whl", "sha256": "a" * 64}}


def create(api, pool, **fields):
    body = {
        "pool": pool.name,
        "target": TARGET,
        "max_unavailable_nodes": "1",
        "canary_nodes": 1,
        "soak_seconds": 0,
        **fields,
    }
    response = api.post("/api/v1/upgrades", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def act(api, upgrade_id, action, version, **body):
    return api.post(f"/api/v1/upgrades/{upgrade_id}/{action}", body, format="json", HTTP_IF_MATCH=f'"{version}"')


def run(agents, upgrade_id, ticks=30, capture=None):
    """Tick the workflow and let every agent heartbeat, until the upgrade stops moving."""
    for _ in range(ticks):
        with capture(execute=True):
            rollout.advance(upgrade_id=upgrade_id)
        for agent in agents:
            with capture(execute=True):
                agent.beat()
        state = Upgrade.objects.get(pk=upgrade_id).state
        if state not in rollout.TICKING_STATES:
            return state
    return Upgrade.objects.get(pk=upgrade_id).state


def unavailable(pool) -> int:
    return Node.objects.filter(pool=pool).exclude(lifecycle=Lifecycle.READY, cordoned=False).count()


def test_an_upgrade_rolls_every_node_to_the_target_through_admission(operator_api, django_capture_on_commit_callbacks):
    pool, nodes = ready_pool("general", 4)
    agents = [FakeAgent(node, secret) for node, secret in nodes]
    upgrade = create(operator_api, pool, max_unavailable_nodes="1")
    with django_capture_on_commit_callbacks(execute=True):
        started = act(operator_api, upgrade["id"], "start", upgrade["version"])
    assert started.status_code == 200, started.content
    assert started.json()["state"] == UpgradeState.CANARY

    peak = 0
    for _ in range(40):
        with django_capture_on_commit_callbacks(execute=True):
            rollout.advance(upgrade_id=upgrade["id"])
        peak = max(peak, unavailable(pool))
        for agent in agents:
            with django_capture_on_commit_callbacks(execute=True):
                agent.beat()
            peak = max(peak, unavailable(pool))
        if Upgrade.objects.get(pk=upgrade["id"]).state == UpgradeState.COMPLETED:
            break

    assert Upgrade.objects.get(pk=upgrade["id"]).state == UpgradeState.COMPLETED
    assert peak == 1, "never more than max_unavailable_nodes out of service"
    for node, _ in nodes:
        node.refresh_from_db()
        assert (node.lifecycle, node.agent_version, node.incarnation) == ("ready", "2.0.0", 2)
        assert not node.cordoned, "the system:upgrade hold is lifted once the node is back"
        assert node.holds.filter(owner="system:upgrade").exists()
        assert node.admission_checks.filter(name="upgrade_target", status="passed").exists()
    states = set(UpgradeNode.objects.filter(upgrade_id=upgrade["id"]).values_list("state", flat=True))
    assert states == {UpgradeNodeState.DONE}
    steps = NodeEvent.objects.filter(type="upgrade", subject_type="upgrade", subject_id=upgrade["id"])
    assert steps.filter(to_state="draining").count() == 4 and steps.filter(to_state="done").count() == 4
    assert steps.filter(to_state=UpgradeState.COMPLETED).exists()


def test_a_canary_that_fails_admission_rolls_the_upgrade_back(operator_api, django_capture_on_commit_callbacks):
    pool, nodes = ready_pool("general", 3)
    agents = [FakeAgent(node, secret) for node, secret in nodes]
    for agent in agents:
        agent.broken = True  # the upgrade "runs" but the new version never takes
    upgrade = create(operator_api, pool)
    with django_capture_on_commit_callbacks(execute=True):
        act(operator_api, upgrade["id"], "start", upgrade["version"])

    state = run(agents, upgrade["id"], capture=django_capture_on_commit_callbacks)

    assert state == UpgradeState.ROLLED_BACK
    canary = UpgradeNode.objects.get(upgrade_id=upgrade["id"], phase="canary")
    assert canary.state == UpgradeNodeState.FAILED and "admission refused" in canary.detail
    back = UpgradeNode.objects.get(upgrade_id=upgrade["id"], phase="rollback")
    assert back.state == UpgradeNodeState.DONE
    assert not UpgradeNode.objects.filter(upgrade_id=upgrade["id"], phase="roll").exclude(state="skipped").exists()
    for node, _ in nodes:
        node.refresh_from_db()
        assert (node.lifecycle, node.agent_version, node.cordoned) == ("ready", "1.0.0", False)


def test_failures_past_the_threshold_pause_the_roll_and_resume_continues(
    operator_api, django_capture_on_commit_callbacks
):
    pool, nodes = ready_pool("general", 3)
    agents = [FakeAgent(node, secret) for node, secret in nodes]
    # The failed node stays out: a Ready SLO of 0.5 lets the roll go on once resumed (the pool's
    # default 0.99 would pause it again, as it should).
    type(pool).objects.filter(pk=pool.pk).update(ready_ratio_objective=0.5)
    # The pool's budget allows two at once too (its default, 10 % of 3, allows one).
    PoolOperations.objects.create(pool=pool, disruption_budgets=[{"nodes": "2"}])
    # Room for two: the failed node stays out (rejected) and counts as unavailable.
    upgrade = create(operator_api, pool, canary_nodes=0, failure_threshold=1, max_unavailable_nodes="2")
    with django_capture_on_commit_callbacks(execute=True):
        act(operator_api, upgrade["id"], "start", upgrade["version"])
    rows = UpgradeNode.objects.filter(upgrade_id=upgrade["id"]).order_by("position")
    order = list(rows.values_list("node_id", flat=True))
    next(a for a in agents if a.node.pk == order[0]).broken = True

    state = run(agents, upgrade["id"], capture=django_capture_on_commit_callbacks)

    upgrade_row = Upgrade.objects.get(pk=upgrade["id"])
    assert state == UpgradeState.PAUSED and "threshold" in upgrade_row.status_reason
    resumed = act(operator_api, upgrade["id"], "resume", upgrade_row.version, reason="the failed node is known")
    assert resumed.status_code == 200 and resumed.json()["state"] == UpgradeState.ROLLING
    assert run(agents, upgrade["id"], capture=django_capture_on_commit_callbacks) == UpgradeState.COMPLETED
    assert UpgradeNode.objects.filter(upgrade_id=upgrade["id"], state="done").count() == 2


def test_operator_actions_need_the_current_version(operator_api):
    pool, _ = ready_pool("general", 2)
    upgrade = create(operator_api, pool)
    missing = operator_api.post(f"/api/v1/upgrades/{upgrade['id']}/start", {}, format="json")
    stale = act(operator_api, upgrade["id"], "start", upgrade["version"] + 5)
    not_allowed = act(operator_api, upgrade["id"], "resume", upgrade["version"])
    assert (missing.status_code, missing.json()["code"]) == (428, "version_required")
    assert (stale.status_code, stale.json()["code"]) == (412, "version_mismatch")
    assert (not_allowed.status_code, not_allowed.json()["code"]) == (409, "transition_not_allowed")
    assert Upgrade.objects.get(pk=upgrade["id"]).state == UpgradeState.PENDING


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"target": TARGET}, "validation_error"),
        ({"pool": "nope", "target": TARGET}, "unknown_pool"),
        ({"pool": "general", "target": {"version": "not a version"}}, "invalid_target"),
        ({"pool": "general", "target": {**TARGET, "artifact": {"ref": "x", "sha256": "123"}}}, "invalid_target"),
        ({"pool": "general", "target": {**TARGET, "agent_versions": "<2"}}, "invalid_target"),
        ({"pool": "general", "target": TARGET, "max_unavailable_nodes": "0"}, "invalid_max_unavailable"),
        ({"pool": "general", "target": TARGET, "max_unavailable_nodes": "150%"}, "invalid_max_unavailable"),
        ({"pool": "general", "target": TARGET, "soak_seconds": -1}, "validation_error"),
        ({"pool": "general", "target": TARGET, "surprise": 1}, "validation_error"),
        ([1, 2], "validation_error"),
    ],
)
def test_bad_upgrade_requests_are_refused_and_change_nothing(operator_api, body, code):
    ready_pool("general", 1)
    response = operator_api.post("/api/v1/upgrades", body, format="json")
    assert response.status_code == 400, response.content
    assert response["Content-Type"].startswith("application/problem+json")
    assert response.json()["code"] == code
    assert not Upgrade.objects.exists()


def test_a_second_active_upgrade_of_a_pool_is_refused(operator_api):
    pool, _ = ready_pool("general", 1)
    create(operator_api, pool)
    again = operator_api.post("/api/v1/upgrades", {"pool": pool.name, "target": TARGET}, format="json")
    assert (again.status_code, again.json()["code"]) == (409, "upgrade_in_progress")


def test_clients_cannot_create_or_act_on_upgrades(client_api, operator_api):
    pool, _ = ready_pool("general", 1)
    upgrade = create(operator_api, pool)
    assert client_api.post("/api/v1/upgrades", {"pool": pool.name, "target": TARGET}, format="json").status_code == 403
    assert act(client_api, upgrade["id"], "start", upgrade["version"]).status_code == 403
    assert client_api.get("/api/v1/upgrades").status_code == 403


def test_the_dry_run_lists_the_order_and_predicts_the_minimum_capacity(operator_api):
    pool, nodes = ready_pool("general", 5)
    body = {"pool": pool.name, "target": TARGET, "max_unavailable_nodes": "2", "canary_nodes": 1}
    # The pool's default budget (10 %, rounded up: 1 of 5) is the tighter limit.
    assert operator_api.post("/api/v1/upgrades/dry-run", body, format="json").json()["max_unavailable"] == 1
    # 50 % of 5 rounds up to 3: then the upgrade's own 2 is the tighter one.
    PoolOperations.objects.filter(pool=pool).update(disruption_budgets=[{"nodes": "50%"}])
    response = operator_api.post("/api/v1/upgrades/dry-run", body, format="json")
    assert response.status_code == 200, response.content
    plan = response.json()
    assert [item["phase"] for item in plan["order"]] == ["canary", "roll", "roll", "roll", "roll"]
    assert {item["node_id"] for item in plan["order"]} == {str(node.pk) for node, _ in nodes}
    assert plan["max_unavailable"] == 2 and plan["waves"] == 3
    assert plan["current_capacity"]["cpu"] == 5 * 8000
    assert plan["predicted_minimum_capacity"]["cpu"] == 3 * 8000
    assert not Upgrade.objects.exists()


def test_a_percentage_max_unavailable_rounds_down_but_allows_one():
    upgrade = Upgrade(max_unavailable_nodes="10%")
    from operations.upgrade_plan import unavailable_limit

    assert (unavailable_limit(upgrade, 20), unavailable_limit(upgrade, 5), unavailable_limit(upgrade, 35)) == (2, 1, 3)


def started_roll(api, count: int, capture):
    """A pool of ``count`` nodes with their agents and a started upgrade without canaries."""
    pool, nodes = ready_pool("general", count)
    agents = [FakeAgent(node, secret) for node, secret in nodes]
    upgrade = create(api, pool, canary_nodes=0)
    with capture(execute=True):
        act(api, upgrade["id"], "start", upgrade["version"])
    return nodes, agents, upgrade


def test_an_operator_rolls_back_mid_roll_and_every_touched_node_returns_to_the_old_version(
    operator_api, django_capture_on_commit_callbacks
):
    nodes, agents, upgrade = started_roll(operator_api, 4, django_capture_on_commit_callbacks)
    for _ in range(40):  # until one node is done, the roll still under way
        run(agents, upgrade["id"], ticks=1, capture=django_capture_on_commit_callbacks)
        if UpgradeNode.objects.filter(upgrade_id=upgrade["id"], state="done").exists():
            break
    row = Upgrade.objects.get(pk=upgrade["id"])
    assert row.state == UpgradeState.ROLLING

    back = act(operator_api, upgrade["id"], "rollback", row.version, reason="latency regression")
    assert back.status_code == 200 and back.json()["state"] == UpgradeState.ROLLING_BACK
    assert run(agents, upgrade["id"], capture=django_capture_on_commit_callbacks) == UpgradeState.ROLLED_BACK
    for node, _ in nodes:
        node.refresh_from_db()
        assert (node.lifecycle, node.agent_version, node.cordoned) == ("ready", "1.0.0", False)
    assert NodeEvent.objects.filter(subject_id=upgrade["id"], reason__contains="latency regression").exists()


def test_an_abort_skips_the_waiting_nodes_and_leaves_the_others_where_they_are(
    operator_api, django_capture_on_commit_callbacks
):
    _, agents, upgrade = started_roll(operator_api, 3, django_capture_on_commit_callbacks)
    run(agents, upgrade["id"], ticks=1, capture=django_capture_on_commit_callbacks)
    row = Upgrade.objects.get(pk=upgrade["id"])

    aborted = act(operator_api, upgrade["id"], "abort", row.version, reason="change freeze")
    assert aborted.status_code == 200 and aborted.json()["state"] == UpgradeState.ABORTED
    assert UpgradeNode.objects.filter(upgrade_id=upgrade["id"], state="waiting").count() == 0
    assert UpgradeNode.objects.filter(upgrade_id=upgrade["id"], state="skipped").exists()
    with django_capture_on_commit_callbacks(execute=True):
        rollout.advance(upgrade_id=upgrade["id"])  # a late tick changes nothing
    assert Upgrade.objects.get(pk=upgrade["id"]).state == UpgradeState.ABORTED
    again = act(operator_api, upgrade["id"], "resume", aborted.json()["version"])
    assert again.status_code == 409


def test_a_ready_ratio_below_the_pools_objective_pauses_the_roll(operator_api, django_capture_on_commit_callbacks):
    pool, nodes = ready_pool("general", 4)
    upgrade = create(operator_api, pool, canary_nodes=0)
    # Two nodes not reporting ready (outside the upgrade): 2/4 ready < the default 0.99 objective.
    Node.objects.filter(pk__in=[nodes[0][0].pk, nodes[1][0].pk]).update(ready=False)
    with django_capture_on_commit_callbacks(execute=True):
        act(operator_api, upgrade["id"], "start", upgrade["version"])
    with django_capture_on_commit_callbacks(execute=True):
        rollout.advance(upgrade_id=upgrade["id"])
    row = Upgrade.objects.get(pk=upgrade["id"])
    assert row.state == UpgradeState.PAUSED and "below the pool's objective" in row.status_reason
    assert not UpgradeNode.objects.filter(upgrade_id=upgrade["id"]).exclude(state="waiting").exists()


def test_a_named_canary_pool_is_upgraded_first(operator_api, django_capture_on_commit_callbacks):
    _, canary_nodes = ready_pool("canary", 1)
    pool, nodes = ready_pool("general", 2)
    agents = [FakeAgent(node, secret) for node, secret in canary_nodes + nodes]
    upgrade = create(operator_api, pool, canary_nodes=0, canary_pool="canary")
    with django_capture_on_commit_callbacks(execute=True):
        started = act(operator_api, upgrade["id"], "start", upgrade["version"])
    assert started.json()["state"] == UpgradeState.CANARY
    canary_rows = UpgradeNode.objects.filter(upgrade_id=upgrade["id"], phase="canary")
    assert set(canary_rows.values_list("node_id", flat=True)) == {canary_nodes[0][0].pk}

    assert run(agents, upgrade["id"], capture=django_capture_on_commit_callbacks) == UpgradeState.COMPLETED
    for node, _ in canary_nodes + nodes:
        node.refresh_from_db()
        assert node.agent_version == "2.0.0"
    first = UpgradeNode.objects.filter(upgrade_id=upgrade["id"]).order_by("started_at").first()
    assert first.node_id == canary_nodes[0][0].pk


def test_a_database_error_on_one_node_is_retried_next_tick_and_the_others_go_on(
    operator_api, django_capture_on_commit_callbacks, monkeypatch, caplog
):
    from django.db import OperationalError

    pool, nodes = ready_pool("general", 3)
    PoolOperations.objects.create(pool=pool, disruption_budgets=[{"nodes": "2"}])  # both canaries at once
    upgrade = create(operator_api, pool, canary_nodes=2, max_unavailable_nodes="2")
    start, victim = rollout._start, []

    def a_deadlock_victim_first(row, *args):
        if not victim:
            victim.append(row.node_id)
            Node.objects.filter(pk=row.node_id).update(cordoned=True)  # written, then undone
            raise OperationalError("deadlock detected")
        return start(row, *args)

    monkeypatch.setattr(rollout, "_start", a_deadlock_victim_first)
    with django_capture_on_commit_callbacks(execute=True):
        act(operator_api, upgrade["id"], "start", upgrade["version"])
    assert victim, "the start's own tick tried the canaries"
    rows = dict(UpgradeNode.objects.filter(upgrade_id=upgrade["id"]).values_list("node_id", "state"))
    assert rows[victim[0]] == UpgradeNodeState.WAITING and not Node.objects.get(pk=victim[0]).cordoned
    assert sum(state != UpgradeNodeState.WAITING for state in rows.values()) == 1, "the other canary started"
    assert f"node {victim[0]} not moved this tick" in caplog.text
    with django_capture_on_commit_callbacks(execute=True):
        rollout.advance(upgrade_id=upgrade["id"])
    assert UpgradeNode.objects.get(upgrade_id=upgrade["id"], node_id=victim[0]).state != UpgradeNodeState.WAITING
