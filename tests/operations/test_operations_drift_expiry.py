"""Drift and expiry (issue #34 items 3 and 4) through the real API, the sweep and admission: a
drifted pool converges to its shape with at most the budget out; twenty nodes created together
expire over several budget periods, never more than the budget at once; a blackout window holds
both and releases them; an upgrade suspends drift; termination_grace forces an expired node out
naming the budget; the outage guard stops the timers; two sweeps start one replacement."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import time_machine

from fleet.choices import Lifecycle
from fleet.models import LivenessSweepState, Node, NodeEvent, NodeHold, Pool
from operations import drift, expiry, outofservice, replacement, replacement_sweep
from operations import event_types as operations_events
from operations.choices import ReplacementState
from operations.models import DisruptionBlock, NodeReplacement, NodeShape, PoolOperations, ProviderMachine
from tests.factories import make_schedulable_node
from tests.metrics_support import scrape, value
from tests.operations_support import FakeAgent, ready_pool
from tests.races import race

pytestmark = [pytest.mark.usefixtures("no_flood_guard")]
T0 = datetime(2027, 1, 4, 10, 0, tzinfo=UTC)  # a Monday, 10:00 UTC
TARGET = {"version": "2.0.0", "artifact": {"ref": "https://artifacts.example/agent-2.0.0.whl", "sha256": "a" * 64}}


def patch_ops(api, pool, **body):
    version = api.get(f"/api/v1/pools/{pool.name}/operations").json()["version"]
    return api.patch(f"/api/v1/pools/{pool.name}/operations", body, format="json", HTTP_IF_MATCH=f'"{version}"')


def held(pool, owner) -> set:
    return set(
        NodeHold.objects.filter(node__pool=pool, owner=owner, removed_at__isnull=True).values_list("node_id", flat=True)
    )


def sweep(capture, pool, now) -> dict:
    with time_machine.travel(now, tick=False), capture(execute=True):
        return replacement_sweep.sweep_pool(pool=Pool.objects.get(pk=pool.pk), now=now)


def out_of_service(pool) -> int:
    """Members not serving: cordoned by automation, draining, in maintenance, re-admitting."""
    return (
        Node.objects.filter(pool=pool)
        .exclude(lifecycle=Lifecycle.RETIRED)
        .exclude(lifecycle=Lifecycle.READY, cordoned=False)
        .count()
    )


# --- the hash ------------------------------------------------------------------------------------
@pytest.mark.django_db
def test_the_shape_hash_is_canonical_and_leaves_out_what_does_not_change_a_node():
    pool, _ = ready_pool("general", 1)
    a = {"key": "a", "value": "1", "effect": "NoSchedule"}
    b = {"key": "b", "value": "", "effect": "NoExecute"}
    Pool.objects.filter(pk=pool.pk).update(taints=[a, b], labels={"zone": "z1"})
    pool.refresh_from_db()
    first = drift.shape_hash(pool, {**TARGET, "agent_versions": "==2.0.0"})
    Pool.objects.filter(pk=pool.pk).update(taints=[b, a])
    pool.refresh_from_db()
    # Taint order, the artifact and the action do not change a node; budgets and autoscaling are not in it at all.
    assert drift.shape_hash(pool, {**TARGET, "agent_versions": "==2.0.0", "action": "image"}) == first
    assert drift.shape_hash(pool, {**TARGET, "artifact": {}, "agent_versions": "==2.0.0"}) == first
    PoolOperations.objects.create(pool=pool, target=TARGET, disruption_budgets=[{"nodes": "0"}], max_nodes=9)
    assert drift.current_hash(pool) == drift.shape_hash(pool, TARGET)
    # What shapes a node does.
    assert drift.shape_hash(pool, {**TARGET, "driver": "550.54"}) != drift.shape_hash(pool, TARGET)
    Pool.objects.filter(pk=pool.pk).update(reservations={"system": {"cpu": 500}})
    pool.refresh_from_db()
    assert drift.shape_hash(pool, TARGET) != drift.shape_hash(Pool.objects.get(pk=pool.pk), {})
    assert drift.canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'.encode()


@pytest.mark.django_db
def test_admission_records_the_hash_and_existing_nodes_get_the_pool_hash_at_the_first_sweep(
    django_capture_on_commit_callbacks,
):
    pool, nodes = ready_pool("general", 2)
    assert not NodeShape.objects.exists()
    result = sweep(django_capture_on_commit_callbacks, pool, T0)
    assert result["drifted"] == 0 and result["started"] == 0
    digest = drift.current_hash(pool)
    assert set(NodeShape.objects.values_list("pool_hash", flat=True)) == {digest}
    # Re-admission (here: drain and return) records the hash its admission check saw.
    node = nodes[0][0]
    with django_capture_on_commit_callbacks(execute=True):
        drain = outofservice.take_out_of_service(node=node, owner=outofservice.DRIFT, reason="t", policy="checkpoint")
        assert drain.state == "completed"
        outofservice.return_to_service(node=Node.objects.get(pk=node.pk), owner=outofservice.DRIFT, reason="t")
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.READY
    check = node.admission_checks.get(name=drift.CHECK_NAME, attempt=node.admission_attempt)
    assert check.data["pool_hash"] == digest
    sweep(django_capture_on_commit_callbacks, pool, T0 + timedelta(seconds=30))
    assert NodeShape.objects.get(node=node).admission_attempt == node.admission_attempt


# --- drift -----------------------------------------------------------------------------------------
@pytest.mark.django_db
def test_a_drifted_pool_converges_to_its_shape_with_at_most_the_budget_unavailable(
    django_capture_on_commit_callbacks,
):
    pool, _ = ready_pool("general", 10)
    PoolOperations.objects.create(pool=pool)  # the default budget: 10 % of 10 = 1 node
    sweep(django_capture_on_commit_callbacks, pool, T0)
    Pool.objects.filter(pk=pool.pk).update(labels={"rack": "r7"})  # the pool's shape changes
    digest = drift.current_hash(Pool.objects.get(pk=pool.pk))
    worst, now = 0, T0
    for _ in range(60):
        now += timedelta(seconds=30)
        sweep(django_capture_on_commit_callbacks, pool, now)
        worst = max(worst, out_of_service(pool))
        if (
            not NodeShape.objects.filter(pool=pool, drifted=True).exists()
            and not NodeReplacement.objects.filter(
                state__in=[ReplacementState.PENDING, ReplacementState.LAUNCHING, ReplacementState.DRAINING]
            ).exists()
        ):
            break
    assert worst == 1
    assert set(NodeShape.objects.filter(pool=pool).values_list("pool_hash", flat=True)) == {digest}
    assert NodeReplacement.objects.filter(pool=pool, reason="drift", state=ReplacementState.REPLACED).count() == 10
    assert Node.objects.filter(pool=pool, lifecycle=Lifecycle.READY, cordoned=False).count() == 10
    assert not held(pool, outofservice.DRIFT)
    events = NodeEvent.objects.filter(type=operations_events.DRIFT)
    assert events.filter(to_state="True").count() == 10 and events.filter(to_state="False").count() == 10
    assert "pool shape changed" in events.filter(to_state="True").first().reason


class FakeProvider:
    """A provider that accepts every machine and records what it was asked."""

    def __init__(self):
        self.created, self.deleted = [], []

    def create(self, machines):
        self.created += [m.name for m in machines]
        return {m.name: {"instance": m.name} for m in machines}

    def delete(self, name, provider_data):
        self.deleted.append(name)


@pytest.mark.django_db
def test_where_the_pool_autoscales_the_replacement_is_ready_before_the_old_node_drains(
    monkeypatch, django_capture_on_commit_callbacks
):
    provider = FakeProvider()
    monkeypatch.setattr("operations.providers.provider_for", lambda ops: provider)
    with time_machine.travel(T0, tick=False):
        pool, nodes = ready_pool("general", 2)
    PoolOperations.objects.create(pool=pool, provider="simulated", max_nodes=3, node_template={"resources": {}})
    old = nodes[0][0]
    for i, (node, _) in enumerate(nodes):
        ProviderMachine.objects.create(pool=pool, provider="simulated", name=f"general-old-{i}", state="ready",
                                       node=node, requested_at=T0, ready_at=T0)  # fmt: skip
    sweep(django_capture_on_commit_callbacks, pool, T0)
    Pool.objects.filter(pk=pool.pk).update(labels={"rack": "r7"})

    sweep(django_capture_on_commit_callbacks, pool, T0 + timedelta(seconds=30))
    first = NodeReplacement.objects.get(state=ReplacementState.LAUNCHING)
    assert len(provider.created) == 1  # one machine asked for at once; the old node is cordoned, not draining
    old = Node.objects.get(pk=first.node_id)
    assert old.lifecycle == Lifecycle.READY and old.cordoned and held(pool, outofservice.DRIFT) == {old.pk}
    sweep(django_capture_on_commit_callbacks, pool, T0 + timedelta(seconds=60))
    assert Node.objects.get(pk=old.pk).lifecycle == Lifecycle.READY  # still waiting for the new machine

    # The new machine enrolls and becomes ready (what the autoscaler's follow step records).
    with time_machine.travel(T0 + timedelta(seconds=70), tick=False):
        new, _ = make_schedulable_node(pool)
    ProviderMachine.objects.filter(name=provider.created[0]).update(state="ready", node=new, ready_at=T0)
    sweep(django_capture_on_commit_callbacks, pool, T0 + timedelta(seconds=90))
    assert Node.objects.get(pk=old.pk).lifecycle == Lifecycle.MAINTENANCE  # drained only now
    sweep(django_capture_on_commit_callbacks, pool, T0 + timedelta(seconds=120))
    assert provider.deleted == [ProviderMachine.objects.get(node=old).name]
    assert Node.objects.get(pk=old.pk).lifecycle == Lifecycle.RETIRED
    sweep(django_capture_on_commit_callbacks, pool, T0 + timedelta(seconds=150))
    first.refresh_from_db()
    assert first.state == ReplacementState.REPLACED
    steps = list(
        NodeEvent.objects.filter(type=operations_events.REPLACEMENT, data__replacement_id=str(first.pk))
        .order_by("created_at", "id")
        .values_list("to_state", flat=True)
    )
    assert steps == ["pending", "launching", "draining", "replaced"]


@pytest.mark.django_db
def test_reported_versions_off_the_target_are_drift(django_capture_on_commit_callbacks):
    pool, nodes = ready_pool("general", 3)
    PoolOperations.objects.create(pool=pool, target={**TARGET, "agent_versions": ">=1.0"})
    sweep(django_capture_on_commit_callbacks, pool, T0)
    assert not NodeShape.objects.filter(drifted=True).exists()
    Node.objects.filter(pk=nodes[0][0].pk).update(agent_version="0.9.0")
    result = sweep(django_capture_on_commit_callbacks, pool, T0 + timedelta(seconds=30))
    assert result["drifted"] == 1
    shape = NodeShape.objects.get(node=nodes[0][0])
    assert shape.drifted and "outside the target" in shape.drift_reasons[0]
    assert drift.condition(shape.drift_reasons)["reason"] == "VersionMismatch"
    # The node carries it among its conditions, and its own next report keeps it (server-owned).
    (condition,) = [c for c in Node.objects.get(pk=nodes[0][0].pk).conditions if c["type"] == "Drifted"]
    assert (condition["status"], condition["reason"]) == ("True", "VersionMismatch")
    agent = FakeAgent(Node.objects.get(pk=nodes[0][0].pk), nodes[0][1])
    agent.version = "0.9.0"
    agent.beat()
    kept = [c for c in Node.objects.get(pk=nodes[0][0].pk).conditions if c["type"] == "Drifted"]
    assert kept and kept[0]["status"] == "True"
    assert not any(c["type"] == "Drifted" for c in Node.objects.get(pk=nodes[1][0].pk).conditions)
    assert NodeReplacement.objects.get(node=nodes[0][0]).reason == "drift"


@pytest.mark.django_db
def test_drift_is_suspended_while_an_upgrade_of_the_pool_is_active(operator_api, django_capture_on_commit_callbacks):
    pool, _ = ready_pool("general", 4)
    sweep(django_capture_on_commit_callbacks, pool, T0)
    created = operator_api.post(
        "/api/v1/upgrades", {"pool": pool.name, "target": TARGET, "canary_nodes": 0, "soak_seconds": 0}, format="json"
    )
    with django_capture_on_commit_callbacks(execute=False):  # started, not ticked
        started = operator_api.post(
            f"/api/v1/upgrades/{created.json()['id']}/start", {}, format="json", HTTP_IF_MATCH='"1"'
        )
    assert started.status_code == 200, started.content
    result = sweep(django_capture_on_commit_callbacks, pool, T0 + timedelta(seconds=30))
    assert result["drifted"] == 4 and result["started"] == 0
    assert result["suspended"].startswith("upgrade ")
    assert not NodeReplacement.objects.exists() and not held(pool, outofservice.DRIFT)


# --- expiry ----------------------------------------------------------------------------------------
@pytest.mark.django_db
def test_twenty_nodes_created_together_expire_over_several_budget_periods_never_more_than_the_budget(
    operator_api, django_capture_on_commit_callbacks
):
    pool, _ = ready_pool("general", 20)
    assert patch_ops(operator_api, pool, expire_after=3600).status_code == 200  # default budget: 2 of 20
    sweep(django_capture_on_commit_callbacks, pool, T0)
    shapes = list(NodeShape.objects.filter(pool=pool))
    due = sorted(expiry.expires_at(node_id=s.node_id, admitted_at=s.admitted_at, expire_after=3600) for s in shapes)
    # Spread: created together, they fall due over up to 10 % of expire_after, not at one instant.
    assert len(set(due)) == 20 and (due[-1] - due[0]).total_seconds() > 60
    assert sweep(django_capture_on_commit_callbacks, pool, due[0] - timedelta(seconds=1))["expired"] == 0
    now, worst, periods = due[-1], 0, 0
    for _ in range(80):
        now += timedelta(seconds=30)
        result = sweep(django_capture_on_commit_callbacks, pool, now)
        out = out_of_service(pool)
        worst = max(worst, out)
        assert out <= 2, result
        periods += 1
        if NodeReplacement.objects.filter(reason="expiry", state=ReplacementState.REPLACED).count() == 20:
            break
    assert NodeReplacement.objects.filter(reason="expiry", state=ReplacementState.REPLACED).count() == 20
    assert worst == 2 and periods >= 10  # ten rounds of two at least: paced by the budget
    # Re-admitted nodes start over: none is expired now.
    assert sweep(django_capture_on_commit_callbacks, pool, now + timedelta(seconds=30))["expired"] == 0
    blocked = NodeEvent.objects.filter(type=operations_events.DISRUPTION_BLOCKED, data__reason="expiry")
    assert blocked.exists() and "pool budget #0" in blocked.first().reason


@pytest.mark.django_db
def test_a_blackout_window_holds_drift_and_expiry_and_releases_them_when_it_ends(
    operator_api, django_capture_on_commit_callbacks
):
    with time_machine.travel(T0 - timedelta(hours=2), tick=False):
        pool, _ = ready_pool("general", 4)
    window = {"nodes": "0", "reasons": ["drift", "expiry"], "schedule": "0 9 * * *", "duration": "8h"}
    response = patch_ops(operator_api, pool, expire_after=3600, disruption_budgets=[{"nodes": "1"}, window])
    assert response.status_code == 200, response.content
    with time_machine.travel(T0 - timedelta(hours=2), tick=False):
        sweep(django_capture_on_commit_callbacks, pool, T0 - timedelta(hours=2))  # admitted at 08:00
    Pool.objects.filter(pk=pool.pk).update(labels={"rack": "r7"})
    for now in (T0, T0 + timedelta(hours=3), T0 + timedelta(hours=6, minutes=59)):  # 10:00 .. 16:59
        result = sweep(django_capture_on_commit_callbacks, pool, now)
        assert result["drifted"] == 4 and result["expired"] == 4
        assert out_of_service(pool) == 0
    block = DisruptionBlock.objects.filter(node__pool=pool).first()
    assert block.kind == "window" and "until 2027-01-04T17:00:00+00:00" in block.detail
    sweep(django_capture_on_commit_callbacks, pool, T0 + timedelta(hours=7, seconds=1))  # 17:00:01
    assert out_of_service(pool) == 1


@pytest.mark.django_db
def test_termination_grace_forces_an_expired_node_out_and_names_the_budget_it_overrode(
    operator_api, django_capture_on_commit_callbacks
):
    with time_machine.travel(T0, tick=False):
        pool, nodes = ready_pool("general", 2)
    response = patch_ops(
        operator_api, pool, expire_after=3600, termination_grace=600, disruption_budgets=[{"nodes": "0"}]
    )
    assert response.status_code == 200, response.content
    sweep(django_capture_on_commit_callbacks, pool, T0)
    due = {
        s.node_id: expiry.expires_at(node_id=s.node_id, admitted_at=s.admitted_at, expire_after=3600)
        for s in NodeShape.objects.filter(pool=pool)
    }
    first = min(due, key=due.get)
    sweep(django_capture_on_commit_callbacks, pool, max(due.values()) + timedelta(seconds=1))
    assert NodeReplacement.objects.filter(state=ReplacementState.PENDING).count() == 2  # both expired, both wait
    assert out_of_service(pool) == 0
    sweep(django_capture_on_commit_callbacks, pool, due[first] + timedelta(seconds=599))
    assert out_of_service(pool) == 0
    sweep(django_capture_on_commit_callbacks, pool, due[first] + timedelta(seconds=601))
    forced = NodeReplacement.objects.get(node_id=first)
    assert forced.forced and forced.state == ReplacementState.DRAINING
    assert forced.overrode["kind"] == "pool_budget" and forced.overrode["budget"] == {"index": 0, "nodes": "0"}
    moved = NodeEvent.objects.get(
        type=operations_events.REPLACEMENT, data__replacement_id=str(forced.pk), to_state="draining"
    )
    assert "overriding pool budget #0" in moved.reason
    assert len(nodes) == 2 and NodeReplacement.objects.filter(forced=True).count() == 1


@pytest.mark.django_db
def test_expiry_stands_still_while_the_outage_guard_is_engaged(operator_api, django_capture_on_commit_callbacks):
    with time_machine.travel(T0, tick=False):
        pool, _ = ready_pool("general", 2)
    assert patch_ops(operator_api, pool, expire_after=3600).status_code == 200
    sweep(django_capture_on_commit_callbacks, pool, T0)
    late = T0 + timedelta(hours=3)
    LivenessSweepState.objects.update_or_create(pk=1, defaults={"guarded_groups": {"general": {"since": "x"}}})
    result = sweep(django_capture_on_commit_callbacks, pool, late)
    assert result["expired"] == 0 and "mass-silence guard" in result["guard"]
    LivenessSweepState.objects.filter(pk=1).update(guarded_groups={}, recovered_at=late)
    assert sweep(django_capture_on_commit_callbacks, pool, late + timedelta(seconds=60))["expired"] == 0
    assert sweep(django_capture_on_commit_callbacks, pool, late + timedelta(seconds=301))["expired"] == 2


# --- visible ---------------------------------------------------------------------------------------
@pytest.mark.django_db
def test_metrics_show_drifted_and_expired_nodes_and_replacements(
    operator_api, client, django_capture_on_commit_callbacks
):
    with time_machine.travel(T0, tick=False):
        pool, nodes = ready_pool("general", 3)
    window = {"nodes": "0", "schedule": "0 0 * * *", "duration": "23h"}  # nothing moves until 23:00
    assert patch_ops(operator_api, pool, expire_after=3600, disruption_budgets=[window]).status_code == 200
    sweep(django_capture_on_commit_callbacks, pool, T0)
    Node.objects.filter(pk=nodes[0][0].pk).update(agent_version="0.9.0")
    PoolOperations.objects.filter(pool=pool).update(target={**TARGET, "agent_versions": ">=1.0"})
    late = T0 + timedelta(hours=2)
    sweep(django_capture_on_commit_callbacks, pool, late)
    with time_machine.travel(late, tick=False):
        text = scrape(client)
    assert value(text, "nodepool_pool_drifted_nodes", pool="general") == 3  # the target is new to all three
    assert value(text, "nodepool_pool_expired_nodes", pool="general") == 3
    assert 3600 - 400 < value(text, "nodepool_pool_oldest_expired_seconds", pool="general") <= 3600
    assert value(text, "nodepool_node_replacements", pool="general", reason="expiry", state="pending") == 3
    assert value(text, "nodepool_pool_disruptions_blocked", pool="general", reason="expiry") == 3


# --- bad input -------------------------------------------------------------------------------------
@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"expire_after": "1h"}, "expire_after"),
        ({"expire_after": -5}, "expire_after"),
        ({"expire_after": True}, "expire_after"),
        ({"expire_after": 30}, "expire_after"),
        ({"termination_grace": 3.5}, "termination_grace"),
        ({"expire_after": 3600, "termination_grace": "soon"}, "termination_grace"),
    ],
)
def test_bad_expiry_settings_are_refused_naming_the_field_and_nothing_is_stored(operator_api, body, field):
    pool, _ = ready_pool("general", 1)
    response = patch_ops(operator_api, pool, **body)
    assert response.status_code == 400, response.content
    assert response["Content-Type"].startswith("application/problem+json")
    assert response.json()["code"] == "invalid_pool_operations"
    assert response.json()["errors"][0]["field"] == field
    ops = PoolOperations.objects.get(pool=pool)
    assert (ops.expire_after, ops.termination_grace, ops.version) == (None, None, 1)


@pytest.mark.django_db
def test_expiry_settings_are_written_and_cleared(operator_api):
    pool, _ = ready_pool("general", 1)
    assert patch_ops(operator_api, pool, expire_after=86400, termination_grace=3600).json()["expire_after"] == 86400
    cleared = patch_ops(operator_api, pool, expire_after=None, termination_grace=None).json()
    assert (cleared["expire_after"], cleared["termination_grace"]) == (None, None)


# --- races -----------------------------------------------------------------------------------------
@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_sweeps_that_find_the_same_drifted_node_start_one_replacement():
    pool, nodes = ready_pool("general", 4)
    PoolOperations.objects.create(pool=pool, disruption_budgets=[{"nodes": "4"}])
    replacement_sweep.sweep_pool(pool=pool)
    Node.objects.filter(pk=nodes[0][0].pk).update(labels={"stale": "yes"})
    NodeShape.objects.filter(node=nodes[0][0]).update(pool_hash="0" * 64)  # admitted with another shape
    outcome = race(lambda i: replacement_sweep.sweep_pool(pool=Pool.objects.get(pk=pool.pk)), 2)
    assert not outcome.errors, outcome.errors
    assert sorted(r["started"] for r in outcome.results) == [0, 1]
    assert NodeReplacement.objects.filter(node=nodes[0][0]).count() == 1
    assert NodeHold.objects.filter(node=nodes[0][0], owner=outofservice.DRIFT).count() == 1


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_callers_replacing_the_same_node_start_it_once():
    pool, nodes = ready_pool("general", 4)
    PoolOperations.objects.create(pool=pool, disruption_budgets=[{"nodes": "4"}])
    node_id = nodes[1][0].pk
    outcome = race(
        lambda i: replacement.replace_node(node=Node.objects.get(pk=node_id), reason="expiry", detail="race")[1], 2
    )
    assert not outcome.errors, outcome.errors
    assert sorted(outcome.results) == [False, True]
    assert NodeReplacement.objects.filter(node_id=node_id).count() == 1
    assert NodeHold.objects.filter(node_id=node_id, owner=outofservice.EXPIRY).count() == 1
