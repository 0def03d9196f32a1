"""Automated repair (issue #34 item 5) through the real heartbeat API and the repair sweep: a node
stuck Ready=False is rebooted by its agent, then replaced through the provider when the reboot did
not help; the safety breaker; the outage guard; one repair at a time; holds; bad rules."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.choices import Lifecycle
from fleet.models import Node, NodeEvent, NodeHold
from operations import event_types as operations_events
from operations import outofservice, repair
from operations.choices import RepairAction, RepairState
from operations.models import PoolOperations, Repair, ScaleDecision
from tests.heartbeat_support import T0, beat, node_api
from tests.operations_support import ready_pool

pytestmark = [pytest.mark.usefixtures("no_flood_guard")]
STEP = 10  # seconds between sweeps (the beat runs every 15 s; under the clock-gap threshold of 60 s)
READY_FALSE = {"condition": "Ready", "status": "False", "for": 30, "action": "reboot"}


class Agent:
    """One node's agent over the real API: reports Ready, and carries out a repair reboot the way
    agent/repair.py does (a new boot id and a new incarnation); ``fixed_by_reboot`` says whether the
    reboot cures it."""

    def __init__(self, node: Node, secret: str):
        self.node, self.api = node, node_api(secret)
        self.incarnation, self.sequence = 1, 0
        self.boot_id = str(uuid.uuid4())
        self.ready = True
        self.fixed_by_reboot = True
        self.reboots = 0
        self.handled: set = set()

    def beat(self) -> dict:
        self.sequence += 1
        status = "True" if self.ready else "False"
        body = beat(
            sequence=self.sequence,
            incarnation=self.incarnation,
            ready=self.ready,
            boot_id=self.boot_id,
            conditions=[{"type": "Ready", "status": status, "reason": "KubeletNotReady", "message": ""}],
        )
        response = self.api.post(f"/api/v1/nodes/{self.node.pk}/heartbeats", body, format="json")
        if response.status_code in (429, 410):
            return {}
        assert response.status_code == 200, response.content
        answer = response.json()
        order = answer["instructions"].get("repair")
        if order and order["repair_id"] not in self.handled:
            self.handled.add(order["repair_id"])
            assert order["action"] == "reboot"
            self.reboots += 1
            self.boot_id, self.incarnation, self.sequence = str(uuid.uuid4()), self.incarnation + 1, 0
            if self.fixed_by_reboot:
                self.ready = True
            self.beat()
        return answer


class FakeProvider:
    kind = "webhook"

    def __init__(self):
        self.created, self.deleted = [], []

    def create(self, machines):
        self.created.extend(m.name for m in machines)
        return {m.name: {} for m in machines}

    def delete(self, name, provider_data):
        self.deleted.append(name)


@pytest.fixture
def provider(monkeypatch):
    fake = FakeProvider()
    monkeypatch.setattr("operations.providers.provider_for", lambda ops: fake)
    return fake


def fleet(count: int, *, rules, name="general", **ops_fields):
    pool, nodes = ready_pool(name, count)
    PoolOperations.objects.create(pool=pool, repair_rules=rules, disruption_budgets=[{"nodes": "50%"}], **ops_fields)
    return pool, [Agent(node, secret) for node, secret in nodes]


def tick(time_machine, agents, capture, seconds: int = STEP):
    """``seconds`` pass; ``agents`` report (the healthy rest of the pool keeps what it reported:
    the liveness sweep does not run here); one repair sweep (its on-commit work run)."""
    time_machine.shift(timedelta(seconds=seconds))
    for agent in agents:
        agent.beat()
    with capture(execute=True):
        return repair.sweep()


def run(time_machine, agents, capture, seconds: int):
    for _ in range(seconds // STEP):
        tick(time_machine, agents, capture)


def holds_of(node) -> list[str]:
    return sorted(NodeHold.objects.filter(node=node, removed_at__isnull=True).values_list("owner", flat=True))


@pytest.fixture
def t0(time_machine):
    time_machine.move_to(T0, tick=False)
    return time_machine


@pytest.mark.django_db
def test_a_node_stuck_not_ready_is_rebooted_then_replaced_when_the_reboot_did_not_help(
    t0, provider, django_capture_on_commit_callbacks
):
    pool, agents = fleet(10, rules=[READY_FALSE], provider="webhook", max_nodes=20)
    sick = agents[0]
    sick.ready, sick.fixed_by_reboot = False, False
    first_boot = sick.boot_id
    agents = [sick, agents[1]]  # one healthy neighbour reports too
    run(t0, agents, django_capture_on_commit_callbacks, 20)
    assert not Repair.objects.exists()  # 20 s < for (30 s): nothing yet
    run(t0, agents, django_capture_on_commit_callbacks, 20)
    reboot = Repair.objects.get()
    assert reboot.action == RepairAction.REBOOT and reboot.condition == "Ready=False"
    run(t0, agents, django_capture_on_commit_callbacks, 20)
    assert sick.reboots == 1 and sick.boot_id != first_boot
    reboot.refresh_from_db()
    assert reboot.state == RepairState.VERIFYING
    planned = NodeEvent.objects.filter(type=operations_events.REPAIR, node=sick.node, data__planned_reboot=True)
    assert planned.count() == 1
    # Still failing one rule duration (30 s) after the reboot: escalated to a replacement.
    run(t0, agents, django_capture_on_commit_callbacks, 40)
    reboot.refresh_from_db()
    assert reboot.state == RepairState.ESCALATED
    replace = Repair.objects.get(escalated_from=reboot)
    assert replace.action == RepairAction.REPLACE
    assert replace.state == RepairState.SUCCEEDED
    assert len(provider.created) == 1
    assert ScaleDecision.objects.filter(data__repair_id=str(replace.pk)).count() == 1
    assert Node.objects.get(pk=sick.node.pk).lifecycle == Lifecycle.RETIRED
    # The other nine were never touched.
    assert Node.objects.filter(pool=pool, lifecycle=Lifecycle.READY, cordoned=False).count() == 9


@pytest.mark.django_db
def test_a_reboot_that_cures_returns_the_node_through_admission_and_lifts_only_its_own_hold(
    t0, operator_api, django_capture_on_commit_callbacks
):
    pool, agents = fleet(10, rules=[READY_FALSE])
    sick = agents[0]
    sick.ready = False
    agents = [sick]
    run(t0, agents, django_capture_on_commit_callbacks, 40)
    assert holds_of(sick.node)[-1] == outofservice.REPAIR
    # An operator cordons the node meanwhile: the repair never lifts that hold.
    node = Node.objects.get(pk=sick.node.pk)
    from fleet.events import Actor
    from maintenance import holds

    holds.place_hold(node, "user:ops", "investigating", actor=Actor.system("user:ops"))
    run(t0, agents, django_capture_on_commit_callbacks, 30)
    done = Repair.objects.get()
    assert done.state == RepairState.SUCCEEDED, done.detail
    node = Node.objects.get(pk=sick.node.pk)
    assert node.lifecycle == Lifecycle.READY  # admitted again
    assert holds_of(node) == ["user:ops"]


@pytest.mark.django_db
def test_a_node_that_does_not_heal_stays_out_until_its_health_checks_pass(t0, django_capture_on_commit_callbacks):
    pool, agents = fleet(10, rules=[{**READY_FALSE, "for": 60}])
    sick = agents[0]
    sick.ready, sick.fixed_by_reboot = False, False
    agents = [sick]
    run(t0, agents, django_capture_on_commit_callbacks, 100)
    reboot = Repair.objects.get()
    assert reboot.state == RepairState.VERIFYING
    assert Node.objects.get(pk=sick.node.pk).lifecycle == Lifecycle.MAINTENANCE  # not back while failing
    sick.ready = True
    run(t0, agents, django_capture_on_commit_callbacks, 20)
    reboot.refresh_from_db()
    assert reboot.state == RepairState.SUCCEEDED
    assert Node.objects.get(pk=sick.node.pk).lifecycle == Lifecycle.READY


@pytest.mark.django_db
def test_the_breaker_stops_repairs_when_30_percent_of_the_pool_is_unhealthy(
    t0, operator_api, django_capture_on_commit_callbacks
):
    pool, agents = fleet(10, rules=[READY_FALSE])
    agents = agents[:3]
    for agent in agents:
        agent.ready = False
    run(t0, agents, django_capture_on_commit_callbacks, 60)
    assert not Repair.objects.exists()
    ops = PoolOperations.objects.get(pool=pool)
    assert ops.repair_breaker_open
    assert "3 of 10 nodes unhealthy (30%)" in ops.repair_breaker_detail
    opened = NodeEvent.objects.filter(type=operations_events.REPAIR_BREAKER, to_state="open")
    assert opened.count() == 1  # once, not per sweep
    shown = operator_api.get(f"/api/v1/pools/{pool.name}/repairs").json()
    assert shown["breaker"]["open"] is True and shown["unhealthy"] == 3
    assert operator_api.get(f"/api/v1/pools/{pool.name}/operations").json()["repair_breaker_open"] is True
    # One recovers on its own: 2 of 10 (20 %) is not more than the limit; the breaker closes.
    agents[2].ready = True
    tick(t0, agents, django_capture_on_commit_callbacks)
    ops.refresh_from_db()
    assert not ops.repair_breaker_open
    assert NodeEvent.objects.filter(type=operations_events.REPAIR_BREAKER, to_state="closed").count() == 1
    assert Repair.objects.count() == 1  # and repairs start again, one at a time


@pytest.mark.django_db
def test_only_one_repair_at_a_time_per_pool_unless_set_otherwise(t0, django_capture_on_commit_callbacks):
    pool, agents = fleet(10, rules=[{**READY_FALSE, "for": 60}])
    agents = agents[:2]
    agents[0].ready = agents[1].ready = False
    agents[0].fixed_by_reboot = agents[1].fixed_by_reboot = False
    run(t0, agents, django_capture_on_commit_callbacks, 100)
    assert Repair.objects.filter(state__in=repair.ACTIVE_REPAIR_STATES).count() == 1
    PoolOperations.objects.filter(pool=pool).update(repair_max_concurrent=2)
    tick(t0, agents, django_capture_on_commit_callbacks)
    assert Repair.objects.filter(state__in=repair.ACTIVE_REPAIR_STATES).count() == 2


@pytest.mark.django_db
def test_no_repair_fires_while_the_outage_guard_is_engaged(t0, settings, django_capture_on_commit_callbacks):
    settings.NODEPOOL = {**settings.NODEPOOL, "REPAIR_SETTLE": 120}
    pool, agents = fleet(10, rules=[READY_FALSE])
    agents = agents[:1]
    agents[0].ready = False
    tick(t0, agents, django_capture_on_commit_callbacks)  # the clock observed
    # The control plane is down for ten minutes: the node's condition held all along, but nobody
    # could have acted; at recovery the guard holds every repair and the timers restart.
    t0.shift(timedelta(minutes=10))
    with django_capture_on_commit_callbacks(execute=True):
        result = repair.sweep()
    assert result["general"]["guard"].startswith("outage guard")
    assert not Repair.objects.exists()
    run(t0, agents, django_capture_on_commit_callbacks, 110)
    assert not Repair.objects.exists()
    run(t0, agents, django_capture_on_commit_callbacks, 20)  # settled, and held 30 s since the recovery
    assert Repair.objects.count() == 1


@pytest.mark.django_db
def test_a_quarantine_rule_quarantines_through_the_gate_and_the_node_needs_a_person(
    t0, django_capture_on_commit_callbacks
):
    pool, agents = fleet(10, rules=[{**READY_FALSE, "action": "quarantine"}])
    agents = agents[:1]
    agents[0].ready = False
    run(t0, agents, django_capture_on_commit_callbacks, 40)
    done = Repair.objects.get()
    assert done.action == RepairAction.QUARANTINE and done.state == RepairState.SUCCEEDED
    node = Node.objects.get(pk=agents[0].node.pk)
    assert node.lifecycle == Lifecycle.QUARANTINED
    assert holds_of(node) == []  # the repair's own hold went with it; quarantine is its own state
    assert not node.credentials.filter(revoked_at__isnull=True).exists()


@pytest.mark.django_db
def test_a_repair_waits_for_the_pool_disruption_budget(t0, django_capture_on_commit_callbacks):
    pool, agents = fleet(10, rules=[READY_FALSE])
    PoolOperations.objects.filter(pool=pool).update(
        disruption_budgets=[{"nodes": "0", "reasons": ["repair"], "schedule": "@daily", "duration": "12h"}]
    )
    agents = agents[:1]
    agents[0].ready = False
    run(t0, agents, django_capture_on_commit_callbacks, 60)
    assert not Repair.objects.exists()  # the gate said no: nothing kept
    blocked = NodeEvent.objects.filter(node=agents[0].node, type="disruption_blocked")
    assert blocked.count() == 1 and blocked.get().data["reason"] == "repair"


# --- bad input ------------------------------------------------------------------------------------
def patch(api, pool, body):
    version = api.get(f"/api/v1/pools/{pool.name}/operations").json()["version"]
    return api.patch(f"/api/v1/pools/{pool.name}/operations", body, format="json", HTTP_IF_MATCH=f'"{version}"')


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("rules", "field"),
    [
        ([{**READY_FALSE, "condition": "FluxCapacitorOk"}], "repair_rules[0].condition"),
        ([{**READY_FALSE, "condition": "ready; rm -rf /"}], "repair_rules[0].condition"),
        ([{**READY_FALSE, "status": "Maybe"}], "repair_rules[0].status"),
        ([{**READY_FALSE, "for": 0}], "repair_rules[0].for"),
        ([{**READY_FALSE, "for": "ten minutes"}], "repair_rules[0].for"),
        ([{**READY_FALSE, "for": "90d"}], "repair_rules[0].for"),
        ([READY_FALSE, {**READY_FALSE, "action": "replace"}], "repair_rules[1].action"),
        ([{**READY_FALSE, "action": "reimage"}], "repair_rules[0].action"),
        ([{**READY_FALSE, "command": "reboot"}], "repair_rules[0].command"),
        ([{"condition": "Ready", "status": "False", "action": "reboot"}], "repair_rules[0].for"),
        ({"condition": "Ready"}, "repair_rules"),
    ],
)
def test_bad_repair_rules_are_refused_naming_the_field_and_nothing_is_stored(operator_api, rules, field):
    pool, _ = ready_pool("general", 1)
    response = patch(operator_api, pool, {"repair_rules": rules})
    assert response.status_code == 400, response.content
    assert response["Content-Type"].startswith("application/problem+json")
    assert response.json()["code"] == "invalid_repair_rule"
    assert response.json()["field"] == field
    assert PoolOperations.objects.get(pool=pool).repair_rules == []


@pytest.mark.django_db
def test_removing_the_provider_of_a_pool_with_a_replace_rule_is_refused(operator_api, monkeypatch):
    pool, _ = ready_pool("general", 1)
    PoolOperations.objects.create(pool=pool, provider="simulated", repair_rules=[{**READY_FALSE, "action": "replace"}])
    response = patch(operator_api, pool, {"provider": ""})
    assert response.status_code == 400
    assert response.json()["field"] == "repair_rules[0].action"
    assert PoolOperations.objects.get(pool=pool).provider == "simulated"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "field"),
    [({"repair_max_unhealthy": 1.5}, "repair_max_unhealthy"), ({"repair_max_concurrent": 0}, "repair_max_concurrent")],
)
def test_bad_breaker_settings_are_refused(operator_api, body, field):
    pool, _ = ready_pool("general", 1)
    response = patch(operator_api, pool, body)
    assert response.status_code == 400
    assert response.json()["code"] == "invalid_pool_operations"


@pytest.mark.django_db
def test_rules_are_stored_in_seconds_and_may_name_device_health_and_reported_conditions(operator_api):
    pool, nodes = ready_pool("general", 1)
    Node.objects.filter(pk=nodes[0][0].pk).update(conditions=[{"type": "GPUReady", "status": "True"}])
    rules = [
        {"condition": "Ready", "status": "False", "for": "10m", "action": "reboot"},
        {"condition": "DevicesHealthy", "status": "False", "for": "1h30m", "action": "quarantine"},
        {"condition": "GPUReady", "status": "False", "for": 120, "action": "reboot"},
    ]
    response = patch(operator_api, pool, {"repair_rules": rules, "repair_max_unhealthy": 0.3})
    assert response.status_code == 200, response.content
    assert [r["for"] for r in response.json()["repair_rules"]] == [600, 5400, 120]
    assert response.json()["repair_max_unhealthy"] == 0.3


# --- the race -------------------------------------------------------------------------------------
@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_sweeps_starting_a_repair_of_the_same_node_one_wins():
    from tests.races import Hold, race

    pool, nodes = ready_pool("general", 10)
    PoolOperations.objects.create(
        pool=pool, repair_rules=[READY_FALSE], repair_max_concurrent=5, disruption_budgets=[{"nodes": "50%"}]
    )
    node = nodes[0][0]
    now = timezone.now()
    with Hold("operations.disruption.lock_pool_operations", parties=2) as hold:
        outcome = race(
            lambda i: repair.start(
                pool_id=pool.pk,
                node_id=node.pk,
                rule=READY_FALSE,
                rule_index=0,
                now=now,
                actor=repair.Actor.system(outofservice.REPAIR),
            ),  # fmt: skip
            2,
        )
    assert not outcome.errors, outcome.errors
    assert sorted(outcome.results) == ["started", "taken"]
    assert hold.max_inside == 1
    assert Repair.objects.filter(node=node).count() == 1
    assert holds_of(node).count(outofservice.REPAIR) == 1
