"""Consolidation (issue 34 item 7): an empty machine is removed after ``consolidate_after``; an
under-used, dearer one is replaced by a template node only when its leases fit on it and the
saving reaches ``consolidation_min_saving``, and only when the gate would let it go; never by a
node of the same type and price, so a steady fleet is never churned; two passes at once take out
one node."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from fleet.models import NodeEvent, NodeHold
from leases.models import Lease
from operations import autoscaler, consolidation, machines
from operations.models import DisruptionBlock, PoolOperations, ProviderMachine, ScaleDecision
from tests.egress_support import allow_loopback
from tests.factories import PoolFactory, make_schedulable_node
from tests.maintenance_support import make_lease
from tests.operations.test_operations_autoscaling import ACTOR, Receiver, configure
from tests.races import Hold, race

pytestmark = pytest.mark.django_db
SMALL = {"resources": {"cpu": 4000, "memory": 2**34}, "price": "0.20"}  # the pool's template, stored
BIG = {"resources": {"cpu": 16000, "memory": 2**36}, "price": "1.00"}  # an older, larger machine type


@pytest.fixture(autouse=True)
def _fresh(settings):
    cache.clear()
    allow_loopback(settings)


@pytest.fixture
def receiver():
    r = Receiver("hook-secret")
    yield r
    r.close()


def consolidating(api, receiver, **fields):
    pool = PoolFactory(name="general")
    settings = {"provider": "webhook", "provider_url": receiver.url, "provider_secret": "hook-secret",
                "node_template": {"resources": {"cpu": "4", "memory": "16Gi"}, "price": "0.20"}, "min_nodes": 0,
                "max_nodes": 10, "drain_policy": "terminate", "consolidate_after": 300}  # fmt: skip
    configure(api, pool, **{**settings, **fields})
    return pool


def machine(pool, name, template, *, at):
    resources = dict(template["resources"])
    node = make_schedulable_node(pool, resources=resources)[0]
    ProviderMachine.objects.create(pool=pool, provider="webhook", name=name, node=node, state="ready",
                                   template=template, requested_at=at, ready_at=at)  # fmt: skip
    return node


def step(pool, at):
    return consolidation.consolidate_pool(pool_id=pool.pk, actor=ACTOR, now=at)


def disruptions(pool) -> int:
    """Everything consolidation could have done: decisions that act, holds, machines leaving."""
    return (
        ScaleDecision.objects.filter(pool=pool, data__has_key="consolidation").exclude(outcome="blocked").count()
        + NodeHold.objects.filter(owner="system:consolidation").count()
        + ProviderMachine.objects.filter(pool=pool).exclude(state="ready").count()
    )


def test_an_empty_machine_is_removed_after_consolidate_after_and_not_before(operator_api, receiver):
    pool = consolidating(operator_api, receiver)
    t0 = timezone.now()
    empty = machine(pool, "m-0", SMALL, at=t0)
    busy = machine(pool, "m-1", SMALL, at=t0)
    make_lease(busy, "job-1", resources={"cpu": 3000})
    assert step(pool, t0 + timedelta(seconds=200)) == "nothing"  # not settled yet
    assert step(pool, t0 + timedelta(seconds=301)) == "deleted"
    assert ProviderMachine.objects.get(name="m-0").state == "draining"
    assert NodeHold.objects.filter(node=empty, owner="system:consolidation").exists()
    decision = ScaleDecision.objects.get(pool=pool, data__consolidation="delete")
    assert decision.data["node_id"] == str(empty.pk) and "empty for 300s" in decision.reason
    from operations.metrics import samples

    assert samples()["nodepool_consolidations_total"] == {("general", "delete"): 1}
    machines.follow_machines(pool_id=pool.pk, actor=ACTOR, now=t0 + timedelta(seconds=302))
    assert ProviderMachine.objects.get(name="m-0").state == "deleted"
    assert [r["action"] for r in receiver.requests] == ["delete"]
    assert ProviderMachine.objects.get(name="m-1").state == "ready"  # its lease fits nowhere else


def test_consolidation_is_off_unless_consolidate_after_is_set(operator_api, receiver):
    pool = consolidating(operator_api, receiver, consolidate_after=None)
    machine(pool, "m-0", SMALL, at=timezone.now() - timedelta(days=1))
    assert step(pool, timezone.now()) == "off"
    assert disruptions(pool) == 0


def test_a_node_whose_leases_fit_on_the_others_together_is_merged(operator_api, receiver):
    pool = consolidating(operator_api, receiver)
    t0 = timezone.now() - timedelta(hours=1)
    a, b, c = (machine(pool, f"m-{n}", SMALL, at=t0) for n in range(3))
    make_lease(a, "a", resources={"cpu": 2000})
    make_lease(b, "b", resources={"cpu": 2000})
    make_lease(c, "c-1", resources={"cpu": 1000})
    make_lease(c, "c-2", resources={"cpu": 500})
    Lease.objects.update(granted_at=t0)
    assert step(pool, timezone.now()) == "deleted"  # the emptiest, c: its two leases fit on a and b
    assert ProviderMachine.objects.get(name="m-2").state == "draining"
    assert "merged: its 2 lease(s) fit elsewhere" in ScaleDecision.objects.get(data__consolidation="delete").reason


def test_two_leases_that_each_fit_alone_but_not_together_keep_their_node(operator_api, receiver):
    pool = consolidating(operator_api, receiver)
    t0 = timezone.now() - timedelta(hours=1)
    a, c = machine(pool, "m-0", SMALL, at=t0), machine(pool, "m-1", SMALL, at=t0)
    make_lease(a, "a", resources={"cpu": 2000})  # 2 CPUs free on a
    make_lease(c, "c-1", resources={"cpu": 2000})
    make_lease(c, "c-2", resources={"cpu": 2000})  # each alone fits on a; both do not
    Lease.objects.update(granted_at=t0)
    assert step(pool, timezone.now()) == "nothing"
    assert disruptions(pool) == 0


@pytest.mark.parametrize(
    ("min_saving", "lease_cpu", "replaced"),
    [(0.5, 2000, True), (0.9, 2000, False), (0.5, 6000, False)],
    ids=["saves-80%-of-50%", "saves-80%-of-90%", "leases-exceed-the-template"],
)
def test_an_under_used_dear_node_is_replaced_only_when_its_leases_fit_and_it_saves_enough(
    operator_api, receiver, min_saving, lease_cpu, replaced
):
    pool = consolidating(operator_api, receiver, consolidation_min_saving=min_saving, scale_down_utilization=0.5)
    t0 = timezone.now() - timedelta(hours=1)
    old = machine(pool, "m-big", BIG, at=t0)
    make_lease(old, "job", resources={"cpu": lease_cpu})
    Lease.objects.update(granted_at=t0)
    outcome = step(pool, timezone.now())
    if not replaced:
        assert outcome == "nothing"
        assert not receiver.requests and disruptions(pool) == 0
        return
    assert outcome == "replacing"
    decision = ScaleDecision.objects.get(data__consolidation="replace")
    assert (decision.data["consolidation_of"], decision.data["saving"]) == (str(old.pk), 0.8)
    assert decision.outcome == "succeeded"
    assert [m["template"]["resources"]["cpu"] for m in receiver.requests[0]["machines"]] == ["4"]
    new = ProviderMachine.objects.get(decision=decision)
    assert new.template["price"] == "0.20"
    # The old node stays in service until its replacement is ready ...
    assert step(pool, timezone.now()) == "waiting"
    assert old.reload().lifecycle == "ready"
    node = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})[0]
    ProviderMachine.objects.filter(pk=new.pk).update(state="ready", node=node, ready_at=timezone.now())
    # ... and idle on purpose meanwhile: scale-down leaves the replacement alone.
    PoolOperations.objects.filter(pool=pool).update(
        scale_down_after=0, scale_down_cooldown=0, scale_down_utilization=0.1
    )  # the old node is above it
    autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=timezone.now())
    assert ProviderMachine.objects.get(pk=new.pk).state == "ready"
    # Then the old node is taken out through the gate.
    assert step(pool, timezone.now()) == "disrupted"
    assert ProviderMachine.objects.get(name="m-big").state == "draining"
    assert NodeHold.objects.filter(node=old, owner="system:consolidation").exists()


def test_a_replacement_is_not_launched_while_the_gate_would_refuse_the_node(operator_api, receiver):
    pool = consolidating(operator_api, receiver, scale_down_utilization=0.5)
    PoolOperations.objects.filter(pool=pool).update(disruption_budgets=[{"nodes": "0", "reasons": ["consolidation"]}])
    t0 = timezone.now() - timedelta(hours=1)
    old = machine(pool, "m-big", BIG, at=t0)
    make_lease(old, "job", resources={"cpu": 2000})
    Lease.objects.update(granted_at=t0)
    for minutes in range(0, 60, 5):
        assert step(pool, timezone.now() + timedelta(minutes=minutes)) == "blocked"
    assert not receiver.requests
    assert ProviderMachine.objects.count() == 1
    block = DisruptionBlock.objects.get(node=old)
    assert (block.reason, block.kind) == ("consolidation", "pool_budget")
    assert ScaleDecision.objects.filter(outcome="blocked").count() == 1  # said once, not every pass


def test_a_steady_fleet_is_never_churned(operator_api, receiver):
    """Many passes over an hour: busy nodes whose leases fit nowhere else, and an under-used node of
    the template's own type and price (replacing it would change nothing): zero disruptions."""
    pool = consolidating(operator_api, receiver, scale_down_utilization=0.6)
    t0 = timezone.now() - timedelta(hours=1)
    for n in range(3):
        make_lease(machine(pool, f"m-{n}", SMALL, at=t0), f"job-{n}", resources={"cpu": 3000})
    make_lease(machine(pool, "m-3", SMALL, at=t0), "small", resources={"cpu": 2000})
    Lease.objects.update(granted_at=t0)
    now = timezone.now()
    for minute in range(0, 60, 3):
        assert step(pool, now + timedelta(minutes=minute)) == "nothing"
    assert disruptions(pool) == 0
    assert not receiver.requests
    assert not NodeEvent.objects.filter(type="disruption_blocked").exists()


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_consolidation_passes_at_once_take_out_one_node(operator_api, receiver):
    pool = consolidating(operator_api, receiver, min_nodes=1)
    t0 = timezone.now() - timedelta(hours=1)
    machine(pool, "m-0", SMALL, at=t0)
    machine(pool, "m-1", SMALL, at=t0)
    now = timezone.now()
    with Hold("operations.consolidation._pending_replacements", parties=2, timeout=2.0) as hold:
        outcome = race(lambda i: step(pool, now), 2)
    assert not outcome.errors, outcome.errors
    assert sorted(outcome.results) == ["deleted", "waiting"]
    assert ProviderMachine.objects.filter(state="draining").count() == 1
    assert hold.max_inside == 1


def test_the_beat_task_consolidates_after_autoscaling(operator_api, receiver):
    from operations import tasks

    pool = consolidating(operator_api, receiver, min_nodes=1)
    t0 = timezone.now() - timedelta(hours=1)
    machine(pool, "m-0", SMALL, at=t0)
    machine(pool, "m-1", SMALL, at=t0)
    PoolOperations.objects.filter(pool=pool).update(scale_down_after=10**6)  # scale-down would not act
    result = tasks.autoscale.apply().get()
    assert result["consolidated"] == {str(pool.pk): "deleted"}
    assert ProviderMachine.objects.filter(state__in=["draining", "deleted"]).count() == 1
