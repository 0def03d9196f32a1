"""Pool disruption budgets and the one gate (issue #34 items 1 and 2) through the real API and the
upgrade workflow's tick: validation when written, the 10 % default, the most restrictive limit
winning, a blackout window holding automation and releasing it when it ends, the refusal said on
the node, the pool and /metrics, an operator's cordon spending nothing, and the gate's lock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import time_machine

from fleet.choices import Lifecycle
from fleet.models import Node, NodeEvent, NodeHold
from operations import disruption, outofservice, rollout
from operations import event_types as operations_events
from operations.choices import DisruptionReason, UpgradeNodeState, UpgradeState
from operations.models import DisruptionBlock, PoolOperations, Upgrade, UpgradeNode
from tests.metrics_support import scrape, value
from tests.operations_support import ready_pool
from tests.races import Hold, race

pytestmark = [pytest.mark.usefixtures("no_flood_guard")]
TARGET = {"version": "2.0.0", "artifact": {"ref": "https://artifacts.example/agent-2.0.0.whl", "sha256": "a" * 64}}


def set_budgets(api, pool, budgets):
    version = api.get(f"/api/v1/pools/{pool.name}/operations").json()["version"]
    return api.patch(
        f"/api/v1/pools/{pool.name}/operations",
        {"disruption_budgets": budgets},
        format="json",
        HTTP_IF_MATCH=f'"{version}"',
    )


def start_upgrade(api, pool, capture, **fields):
    body = {"pool": pool.name, "target": TARGET, "canary_nodes": 0, "soak_seconds": 0, **fields}
    created = api.post("/api/v1/upgrades", body, format="json")
    assert created.status_code == 201, created.content
    with capture(execute=True):
        started = api.post(f"/api/v1/upgrades/{created.json()['id']}/start", {}, format="json", HTTP_IF_MATCH='"1"')
    assert started.status_code == 200, started.content
    return created.json()["id"]


def in_flight(upgrade_id) -> int:
    """Nodes the upgrade took out (a node without leases drains at once and waits upgrading)."""
    return UpgradeNode.objects.filter(upgrade_id=upgrade_id).exclude(state=UpgradeNodeState.WAITING).count()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("budgets", "field"),
    [
        ([{"nodes": "150%"}], "disruption_budgets[0].nodes"),
        ([{"nodes": "-1"}], "disruption_budgets[0].nodes"),
        ([{"nodes": "1", "reasons": ["upgrade", "reboot"]}], "disruption_budgets[0].reasons"),
        ([{"nodes": "1", "reasons": ["preemption"]}], "disruption_budgets[0].reasons"),
        ([{"nodes": "0", "schedule": "0 25 * * *", "duration": "1h"}], "disruption_budgets[0].schedule"),
        ([{"nodes": "0", "schedule": "0 9 * * *", "duration": "25h"}], "disruption_budgets[0].duration"),
        ([{"nodes": "0", "schedule": "*/10 * * * *", "duration": "11m"}], "disruption_budgets[0].duration"),
        ([{"nodes": "0", "schedule": "0 9 * * *"}], "disruption_budgets[0].duration"),
        ([{"nodes": "0", "duration": "1h"}], "disruption_budgets[0].schedule"),
        (
            [{"nodes": "0", "schedule": "0 9 * * *", "duration": "1h", "timezone": "Mars/Olympus"}],
            "disruption_budgets[0].timezone",
        ),
        ([{"nodes": "1"}, {"nodes": "1", "colour": "red"}], "disruption_budgets[1].colour"),
        ({"nodes": "1"}, "disruption_budgets"),
    ],
)
def test_bad_budgets_are_refused_naming_the_field_and_nothing_is_stored(operator_api, budgets, field):
    pool, _ = ready_pool("general", 1)
    response = set_budgets(operator_api, pool, budgets)
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["code"] == "invalid_disruption_budget"
    assert body["field"] == field
    assert response["Content-Type"].startswith("application/problem+json")
    assert PoolOperations.objects.get(pool=pool).disruption_budgets == [{"nodes": "10%"}]


@pytest.mark.django_db
def test_a_pool_has_the_ten_percent_default_rounded_up_with_a_minimum_of_one(operator_api):
    pool, _ = ready_pool("general", 1)
    assert operator_api.get(f"/api/v1/pools/{pool.name}/operations").json()["disruption_budgets"] == [{"nodes": "10%"}]
    assert [disruption.budget_limit("10%", n) for n in (0, 1, 6, 10, 11, 25)] == [1, 1, 1, 1, 2, 3]
    assert disruption.budget_limit("0%", 50) == 0
    assert disruption.budget_limit("3", 50) == 3


@pytest.mark.django_db
def test_a_written_budget_is_stored_in_its_normal_form(operator_api):
    pool, _ = ready_pool("general", 1)
    response = set_budgets(
        operator_api,
        pool,
        [
            {"nodes": 2},
            {"nodes": "0", "reasons": ["drift", "upgrade"], "schedule": "0 9 * * 1-5", "duration": 28800,
             "timezone": "Europe/Berlin"},
        ],
    )  # fmt: skip
    assert response.status_code == 200, response.content
    assert response.json()["disruption_budgets"] == [
        {"nodes": "2"},
        {
            "nodes": "0",
            "reasons": ["upgrade", "drift"],
            "schedule": "0 9 * * 1-5",
            "duration": "8h",
            "timezone": "Europe/Berlin",
        },
    ]


@pytest.mark.django_db
def test_the_most_restrictive_of_pool_budget_and_max_unavailable_wins(operator_api, django_capture_on_commit_callbacks):
    pool, _ = ready_pool("general", 10)
    assert set_budgets(operator_api, pool, [{"nodes": "20%"}, {"nodes": "5", "reasons": ["drift"]}]).status_code == 200
    upgrade_id = start_upgrade(operator_api, pool, django_capture_on_commit_callbacks, max_unavailable_nodes="5")
    with django_capture_on_commit_callbacks(execute=True):
        rollout.advance(upgrade_id=upgrade_id)
    assert in_flight(upgrade_id) == 2  # 20 % of 10, not 5
    upgrade = Upgrade.objects.get(pk=upgrade_id)
    assert upgrade.state == UpgradeState.ROLLING
    assert "pool budget #0" in upgrade.status_reason

    # With a looser pool budget, the upgrade's own limit is the tighter one.
    PoolOperations.objects.filter(pool=pool).update(disruption_budgets=[{"nodes": "100%"}])
    with django_capture_on_commit_callbacks(execute=True):
        rollout.advance(upgrade_id=upgrade_id)
    assert in_flight(upgrade_id) == 5
    assert "max_unavailable_nodes" in Upgrade.objects.get(pk=upgrade_id).status_reason


@pytest.mark.django_db
def test_a_blackout_window_holds_the_upgrade_says_why_and_releases_it_when_the_window_ends(
    operator_api, client, django_capture_on_commit_callbacks
):
    with time_machine.travel(datetime(2027, 1, 4, 10, 5, tzinfo=UTC), tick=False) as clock:
        pool, nodes = ready_pool("general", 4)
        window = {"nodes": "0", "reasons": ["upgrade"], "schedule": "0 10 * * *", "duration": "30m"}
        assert set_budgets(operator_api, pool, [{"nodes": "100%"}, window]).status_code == 200
        upgrade_id = start_upgrade(operator_api, pool, django_capture_on_commit_callbacks, max_unavailable_nodes="1")

        for _ in range(3):
            with django_capture_on_commit_callbacks(execute=True):
                rollout.advance(upgrade_id=upgrade_id)
        assert in_flight(upgrade_id) == 0
        assert not NodeHold.objects.filter(owner=outofservice.UPGRADE).exists()
        upgrade = Upgrade.objects.get(pk=upgrade_id)
        assert upgrade.state == UpgradeState.ROLLING
        assert "blackout window" in upgrade.status_reason and "10:30" in upgrade.status_reason

        # Said on the node (one event however many ticks), on the pool, and in /metrics.
        first = UpgradeNode.objects.filter(upgrade_id=upgrade_id).order_by("position").first().node_id
        events = NodeEvent.objects.filter(type=operations_events.DISRUPTION_BLOCKED)
        assert events.count() == 1 and events.get().node_id == first
        assert events.get().data["blocker"]["kind"] == "window"
        node_view = operator_api.get(f"/api/v1/nodes/{first}/disruption").json()
        assert node_view["blocked"]["reason"] == "upgrade" and node_view["blocked"]["kind"] == "window"
        pool_view = operator_api.get(f"/api/v1/pools/{pool.name}/disruptions").json()
        assert pool_view["allowed_disruptions"]["upgrade"] == 0
        assert pool_view["allowed_disruptions"]["drift"] == 4
        assert pool_view["budgets"][1]["active"] is True
        assert pool_view["budgets"][1]["window_end"].startswith("2027-01-04T10:30")
        assert [b["node_id"] for b in pool_view["blocked"]] == [str(first)]
        metrics = scrape(client)
        assert value(metrics, "nodepool_pool_allowed_disruptions", pool="general", reason="upgrade") == 0
        assert value(metrics, "nodepool_pool_disruptions_blocked", pool="general", reason="upgrade") == 1

        clock.move_to(datetime(2027, 1, 4, 10, 31, tzinfo=UTC))
        with django_capture_on_commit_callbacks(execute=True):
            rollout.advance(upgrade_id=upgrade_id)
        assert in_flight(upgrade_id) == 1
        assert not DisruptionBlock.objects.filter(node_id=first).exists()
        assert operator_api.get(f"/api/v1/pools/{pool.name}/disruptions").json()["budgets"][1]["active"] is False


@pytest.mark.django_db
def test_an_operator_cordon_neither_pauses_the_upgrade_nor_spends_the_budget(
    operator_api, django_capture_on_commit_callbacks
):
    pool, nodes = ready_pool("general", 6)
    type(pool).objects.filter(pk=pool.pk).update(ready_ratio_objective=0.99)
    cordoned = nodes[5][0]
    response = operator_api.post(
        f"/api/v1/nodes/{cordoned.pk}/cordon", {"reason": "looking at it"}, format="json", HTTP_IF_MATCH='"1"'
    )
    assert response.status_code == 200, response.content
    upgrade_id = start_upgrade(operator_api, pool, django_capture_on_commit_callbacks, max_unavailable_nodes="1")
    with django_capture_on_commit_callbacks(execute=True):
        rollout.advance(upgrade_id=upgrade_id)
    upgrade = Upgrade.objects.get(pk=upgrade_id)
    assert upgrade.state == UpgradeState.ROLLING, upgrade.status_reason
    started = UpgradeNode.objects.filter(upgrade_id=upgrade_id).exclude(state=UpgradeNodeState.WAITING)
    assert started.count() == 1


@pytest.mark.django_db
def test_preemption_is_exempt_from_pool_budgets_but_counts_as_disrupting():
    pool, nodes = ready_pool("general", 4)
    PoolOperations.objects.create(pool=pool, disruption_budgets=[{"nodes": "1"}])
    verdict = disruption.pool_allowance(pool, [{"nodes": "0"}], DisruptionReason.PREEMPTION, now=datetime.now(UTC))
    assert verdict.allowed
    outofservice.take_out_of_service(
        node=nodes[0][0], owner=outofservice.PREEMPTION, reason="notice", policy="checkpoint"
    )
    assert disruption.disrupting(pool) == 1
    verdict = disruption.pool_allowance(pool, [{"nodes": "1"}], DisruptionReason.SCALE_DOWN, now=datetime.now(UTC))
    assert not verdict.allowed and verdict.blocker["kind"] == "pool_budget"


def _disrupt(node_id):
    node = Node.objects.get(pk=node_id)
    try:
        disruption.disrupt(
            node=node,
            reason=DisruptionReason.UPGRADE,
            owner=outofservice.UPGRADE,
            why="race",
            policy="checkpoint",
            now=datetime.now(UTC) + timedelta(seconds=0),
        )
    except disruption.DisruptionBlocked:
        return "blocked"
    return "disrupted"


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_automations_never_both_spend_the_last_allowed_disruption():
    pool, nodes = ready_pool("general", 4)
    PoolOperations.objects.create(pool=pool, disruption_budgets=[{"nodes": "1"}])
    ids = [nodes[0][0].pk, nodes[1][0].pk]
    with Hold("operations.disruption.lock_pool_operations", parties=2) as hold:
        outcome = race(lambda i: _disrupt(ids[i]), 2)
    assert not outcome.errors, outcome.errors
    assert sorted(outcome.results) == ["blocked", "disrupted"]
    assert hold.max_inside == 1
    assert Node.objects.filter(pool=pool, lifecycle=Lifecycle.READY, cordoned=False).count() == 3
