"""Disruption budgets holding drains back, the drain dry run, and the budgets API."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import time_machine

from fleet.events import Actor
from fleet.models import NodeEvent
from leases import reconcile as lease_reconcile
from leases.models import Lease
from maintenance import drains, tasks
from maintenance.models import DisruptionBudget, Drain
from nodepool.api.versioning import etag_for
from tests.factories import PoolFactory, make_schedulable_node
from tests.maintenance_support import act, allocated, make_lease
from tests.races import Hold, race

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)
SYSTEM = Actor.system("test")


@pytest.fixture
def clock():
    with time_machine.travel(T0, tick=False) as traveller:
        yield traveller


@pytest.fixture
def pool(clock):
    return PoolFactory(name="general")


@pytest.fixture
def node(pool):
    return make_schedulable_node(pool)[0]


@pytest.fixture
def spare(pool):
    return make_schedulable_node(pool)[0]


def start(api, node, policy, deadline_in=3600):
    response = act(api, node, "drain", {"reason": "patching", "policy": policy, "deadline_in": deadline_in})
    assert response.status_code == 201, response.json()
    return Drain.objects.get(pk=response.json()["id"])


def states(*leases) -> list[str]:
    return [Lease.objects.get(pk=lease.pk).state for lease in leases]


def test_a_max_unavailable_budget_holds_a_terminate_drain_and_the_drain_says_so(operator_api, node, spare, clock):
    DisruptionBudget.objects.create(group="web", max_unavailable=1)
    first = make_lease(node, "web-1", group="web")
    clock.shift(1)
    second = make_lease(node, "web-2", group="web")

    drain = start(operator_api, node, "terminate")

    assert states(first, second) == ["revoked", "active"]
    waiting = {item["code"]: item for item in drain.progress["waiting_on"]}
    assert waiting["disruption_budget"]["groups"] == ["web"]
    assert waiting["disruption_budget"]["lease_ids"] == [str(second.pk)]
    assert drain.progress["budgets"] == [
        {
            "group": "web",
            "max_unavailable": 1,
            "min_available": None,
            "healthy": 1,
            "disrupted": 1,
            "allowed_disruptions": 0,
        }
    ]
    assert NodeEvent.objects.filter(node=node, reason__contains="disruption_budget").exists()

    clock.shift(30)
    drains.evaluate_drain(drain_id=drain.pk, actor=SYSTEM)
    assert states(second) == ["active"]  # web-1 not yet placed elsewhere

    make_lease(spare, "web-1", group="web")  # the replacement, with a larger fencing token
    drains.evaluate_drain(drain_id=drain.pk, actor=SYSTEM)
    assert states(second) == ["revoked"]


def test_a_min_available_budget_lets_a_checkpoint_drain_ask_only_as_many_as_it_allows(operator_api, node, spare):
    DisruptionBudget.objects.create(group="db", min_available=2)
    on_node = [make_lease(node, f"db-{i}", group="db") for i in range(2)]
    make_lease(spare, "db-2", group="db")

    start(operator_api, node, "checkpoint")

    requested = Lease.objects.filter(pk__in=[le.pk for le in on_node], checkpoint_requested_at__isnull=False)
    assert requested.count() == 1


def test_an_eviction_stops_counting_after_the_replacement_grace(operator_api, node, clock):
    DisruptionBudget.objects.create(group="web", max_unavailable=1, replacement_grace=60)
    make_lease(node, "web-1", group="web")
    clock.shift(1)
    second = make_lease(node, "web-2", group="web")
    drain = start(operator_api, node, "terminate")
    assert states(second) == ["active"]

    clock.shift(61)
    drains.evaluate_drain(drain_id=drain.pk, actor=SYSTEM)

    assert states(second) == ["revoked"]


def test_a_budget_never_holds_a_drain_past_its_deadline(operator_api, node, clock):
    DisruptionBudget.objects.create(group="web", max_unavailable=0)
    lease = make_lease(node, "web-1", group="web")
    drain = start(operator_api, node, "terminate", deadline_in=600)
    assert states(lease) == ["active"]

    clock.shift(600)
    tasks.sweep_drains()

    drain.refresh_from_db()
    assert drain.state == "forced"
    assert states(lease) == ["revoked"]


def test_a_budget_is_shared_by_drains_of_different_nodes(operator_api, node, spare):
    DisruptionBudget.objects.create(group="web", max_unavailable=1)
    first = make_lease(node, "web-1", group="web")
    second = make_lease(spare, "web-2", group="web")

    start(operator_api, node, "terminate")
    start(operator_api, spare, "terminate")

    assert sorted(states(first, second)) == ["active", "revoked"]


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_drains_starting_at_once_never_spend_the_same_allowed_disruption(operator_api):
    pool = PoolFactory(name="race")
    nodes = [make_schedulable_node(pool)[0] for _ in range(3)]
    DisruptionBudget.objects.create(group="web", max_unavailable=1)
    leases = [make_lease(n, f"web-{i}", group="web") for i, n in enumerate(nodes)]

    def drain(index):
        # version given: refresh_from_db of FSM models is not thread-safe (see Node.reload)
        body = {"reason": "r", "policy": "terminate", "deadline_in": 600}
        return act(operator_api, nodes[index], "drain", body, version=1).status_code

    # Each drain waits, budget rows read, for the others: without the budget row lock all three
    # would read "one disruption allowed" and all three would spend it. Only calls that lock rows
    # count: a drain whose lease is already gone rations nothing (and, with eager Celery, the
    # deadline task evaluates each drain again as soon as it commits).
    locking = Hold("maintenance.drains.ration", parties=3, when=lambda candidates, *, lock, **kw: lock and candidates)
    with locking as hold:
        outcome = race(drain, len(nodes))

    assert not outcome.errors, outcome.errors
    assert outcome.results == [201, 201, 201]
    assert sorted(states(*leases)) == ["active", "active", "revoked"]
    assert hold.max_inside == 1


def test_a_dry_run_changes_nothing_and_answers_leases_placement_and_budgets(operator_api, node, spare, monkeypatch):
    DisruptionBudget.objects.create(group="web", max_unavailable=1)
    web = [make_lease(node, f"web-{i}", group="web") for i in range(2)]
    batch = make_lease(node, "batch-1", ttl=99999)
    asked = []

    def simulate(lease, *, exclude_node_ids):
        asked.append((lease.workload_id, list(exclude_node_ids)))
        fits = lease.workload_id != "batch-1"
        return {"placeable": fits, "node_id": str(spare.pk) if fits else None, "reasons": {}, "message": ""}

    monkeypatch.setattr(lease_reconcile, "simulate_placement", simulate)
    events_before = NodeEvent.objects.count()

    response = act(
        operator_api, node, "drain", {"reason": "r", "policy": "terminate", "deadline_in": 3600}, query="?dry_run=true"
    )

    assert response.status_code == 200
    plan = response.json()
    assert plan["dry_run"] is True
    assert {(w, tuple(ex)) for w, ex in asked} == {(le.workload_id, (node.pk,)) for le in [*web, batch]}
    by_workload = {entry["workload_id"]: entry for entry in plan["leases"]}
    assert by_workload["batch-1"]["placement"]["placeable"] is False
    assert by_workload["batch-1"]["at_risk"] is True
    assert sorted(entry["action"] for entry in plan["leases"]) == ["blocked_by_budget", "revoke", "revoke"]
    assert plan["budgets"][0]["group"] == "web"
    assert plan["budgets"][0]["blocks"] is True
    assert plan["budgets"][0]["leases_on_node"] == 2
    assert plan["summary"] == {
        "leases": 3,
        "placeable_elsewhere": 2,
        "unplaceable": 1,
        "pool_can_take_all": False,
        "at_risk": 1,
        "blocked_by_budgets": 1,
        "would_complete_at_once": False,
    }
    node.refresh_from_db()
    assert (node.lifecycle, node.version) == ("ready", 1)
    assert not Drain.objects.exists()
    assert NodeEvent.objects.count() == events_before
    assert states(*web, batch) == ["active"] * 3
    assert allocated(node) == 3000


def test_a_dry_run_needs_no_version_but_refuses_a_stale_one_and_a_refused_transition(operator_api, node):
    url = f"/api/v1/nodes/{node.pk}/drain?dry_run=true"
    body = {"reason": "r", "deadline_in": 600}

    without = operator_api.post(url, body)
    stale = operator_api.post(url, body, HTTP_IF_MATCH='"4"')
    act(operator_api, node, "quarantine", {"reason": "incident"})
    refused = operator_api.post(url, body)

    assert without.status_code == 200
    assert without.json()["summary"]["would_complete_at_once"] is True
    assert stale.status_code == 412
    assert refused.status_code == 409
    assert refused.json()["allowed_actions"] == ["cordon", "release", "retire"]


def test_operators_manage_budgets_with_versions(operator_api, client_api, owner_api):
    created = operator_api.post("/api/v1/disruption-budgets", {"group": "web", "max_unavailable": 1})
    assert created.status_code == 201
    budget = created.json()
    assert budget["status"] == {"healthy": 0, "disrupted": 0, "allowed_disruptions": 1}
    url = f"/api/v1/disruption-budgets/{budget['id']}"

    assert client_api.get("/api/v1/disruption-budgets").json()["count"] == 1
    assert client_api.post("/api/v1/disruption-budgets", {"group": "x", "max_unavailable": 1}).status_code == 403
    assert owner_api.get("/api/v1/disruption-budgets").status_code == 403
    assert operator_api.patch(url, {"max_unavailable": 2}).status_code == 428
    assert operator_api.patch(url, {"max_unavailable": 2}, HTTP_IF_MATCH='"3"').status_code == 412
    changed = operator_api.patch(url, {"max_unavailable": None, "min_available": 2}, HTTP_IF_MATCH='"1"')
    assert changed.status_code == 200
    assert (changed.json()["min_available"], changed.json()["version"]) == (2, 2)
    assert changed["ETag"] == etag_for(2, changed.json())
    assert operator_api.delete(url, HTTP_IF_MATCH='"1"').status_code == 412
    assert operator_api.delete(url, HTTP_IF_MATCH='"2"').status_code == 204
    assert not DisruptionBudget.objects.exists()


@pytest.mark.parametrize(
    "body",
    [
        {"group": "web"},
        {"group": "web", "max_unavailable": 1, "min_available": 1},
        {"group": "web", "max_unavailable": -1},
        {"group": "", "max_unavailable": 1},
        {"group": "web", "max_unavailable": 1, "replacement_grace": -5},
        {"group": "taken", "max_unavailable": 1},
    ],
)
def test_bad_budgets_are_400_and_nothing_is_stored(operator_api, body):
    DisruptionBudget.objects.create(group="taken", max_unavailable=1)

    response = operator_api.post("/api/v1/disruption-budgets", body, format="json")

    assert response.status_code == 400
    assert response.json()["code"] == "validation_error"
    assert DisruptionBudget.objects.count() == 1


def test_a_patch_that_would_set_both_limits_is_400(operator_api):
    budget = DisruptionBudget.objects.create(group="web", max_unavailable=1)

    response = operator_api.patch(f"/api/v1/disruption-budgets/{budget.pk}", {"min_available": 2}, HTTP_IF_MATCH='"1"')

    assert response.status_code == 400
    budget.refresh_from_db()
    assert (budget.max_unavailable, budget.min_available, budget.version) == (1, None, 1)
