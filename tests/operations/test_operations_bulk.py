"""Bulk cordon / uncordon / drain by label selector (issue 33 item 9): dry run, expected count,
limit per call, the disruption gate for drains, refusal of an empty selector; a race on PostgreSQL."""

from __future__ import annotations

import pytest

from fleet.models import Node, NodeHold
from maintenance.models import DisruptionBudget, Drain
from operations.models import PoolOperations
from tests.factories import PoolFactory, make_schedulable_node
from tests.maintenance_support import make_lease
from tests.races import Hold, race

BULK = "/api/v1/nodes/bulk"


@pytest.fixture
def fleet(db):
    pool = PoolFactory(name="general")
    other = PoolFactory(name="gpu")
    nodes = {f"rack1-n{i}": make_schedulable_node(pool, hostname=f"rack1-n{i}", labels={"rack": "r1"})[0]
             for i in range(1, 4)}  # fmt: skip
    nodes["rack2-n1"] = make_schedulable_node(other, hostname="rack2-n1", labels={"rack": "r2"})[0]
    return nodes


def post(api, action: str, **body):
    response = api.post(f"{BULK}/{action}", {"reason": "bios update", **body}, format="json")
    return response.status_code, response.json()


def test_cordon_and_uncordon_by_selector(operator_api, fleet, operator):
    code, body = post(operator_api, "cordon", selector="rack=r1", expected_count=3)
    assert code == 200, body
    assert (body["matched"], body["counts"]) == (3, {"cordoned": 3})
    assert [n["name"] for n in body["nodes"]] == ["rack1-n1", "rack1-n2", "rack1-n3"]
    assert set(Node.objects.filter(cordoned=True).values_list("hostname", flat=True)) == {
        "rack1-n1", "rack1-n2", "rack1-n3"}  # fmt: skip
    assert NodeHold.objects.filter(owner=f"user:{operator.username}", removed_at__isnull=True).count() == 3

    code, body = post(operator_api, "uncordon", selector="rack=r1", expected_count=3)
    assert code == 200 and body["counts"] == {"uncordoned": 3}, body
    assert not Node.objects.filter(cordoned=True).exists()


def test_dry_run_changes_nothing(operator_api, fleet):
    code, body = post(operator_api, "cordon", selector="rack in (r1,r2)", expected_count=4, dry_run=True)
    assert code == 200 and body["dry_run"] is True and body["counts"] == {"would_cordon": 4}, body
    code, body = post(operator_api, "drain", selector="rack=r2", expected_count=1, dry_run=True, deadline_in=3600)
    assert code == 200 and body["counts"] == {"would_drain": 1}, body
    assert not Node.objects.filter(cordoned=True).exists() and not Drain.objects.exists()


@pytest.mark.parametrize("selector", ["", "   "])
def test_an_empty_selector_is_refused(operator_api, fleet, selector):
    code, body = post(operator_api, "drain", selector=selector, expected_count=4, deadline_in=60)
    assert (code, body["code"]) == (400, "empty_selector"), body
    assert not Drain.objects.exists()


def test_the_expected_count_must_match_and_nothing_is_done_otherwise(operator_api, fleet):
    code, body = post(operator_api, "cordon", selector="rack=r1", expected_count=2)
    assert (code, body["code"], body["matched"], body["expected_count"]) == (409, "bulk_count_mismatch", 3, 2)
    assert body["nodes"] == ["rack1-n1", "rack1-n2", "rack1-n3"]
    assert not Node.objects.filter(cordoned=True).exists()
    code, body = post(operator_api, "cordon", selector="rack=r1")
    assert (code, body["code"]) == (400, "validation_error")


def test_at_most_the_limit_per_call(operator_api, fleet, settings):
    settings.NODEPOOL = {**getattr(settings, "NODEPOOL", {}), "BULK_MAX_NODES": 2}
    code, body = post(operator_api, "cordon", selector="rack=r1", expected_count=3)
    assert (code, body["code"], body["matched"], body["limit"]) == (422, "bulk_too_many", 3, 2), body
    assert not Node.objects.filter(cordoned=True).exists()


def test_bad_inputs_are_problems_with_stable_codes(operator_api, client_api, fleet):
    assert post(operator_api, "cordon", selector="rack in (r1", expected_count=1)[1]["code"] == "invalid_filter"
    code, body = post(operator_api, "cordon", selector="rack=r1", expected_count=3, pool="nope")
    assert (code, body["code"]) == (404, "pool_not_found")
    code, body = post(operator_api, "cordon", selector="rack=r1", expected_count=3, deadline_in=60)
    assert (code, body["code"]) == (400, "validation_error")  # a cordon takes no deadline
    assert post(operator_api, "drain", selector="rack=r1", expected_count=3)[1]["code"] == "validation_error"
    code, body = post(operator_api, "cordon", selector="rack=r1", expected_count=3, extra=1)
    assert code == 400, body
    assert post(client_api, "cordon", selector="rack=r1", expected_count=3)[0] == 403
    assert not Node.objects.filter(cordoned=True).exists()


def test_the_pool_narrows_the_selector(operator_api, fleet):
    code, body = post(operator_api, "cordon", selector="rack", pool="gpu", expected_count=1)
    assert code == 200 and [n["name"] for n in body["nodes"]] == ["rack2-n1"], body


def test_drains_respect_the_pool_budget_and_workload_budgets(operator_api, fleet):
    PoolOperations.objects.create(pool=fleet["rack1-n1"].pool, disruption_budgets=[{"nodes": "1"}])
    code, body = post(operator_api, "drain", selector="rack=r1", expected_count=3, deadline_in=3600)
    assert code == 200, body
    assert body["counts"] == {"draining": 1, "blocked": 2}, body
    blocked = [n for n in body["nodes"] if n["outcome"] == "blocked"]
    assert all(n["blocker"]["kind"] == "pool_budget" for n in blocked), blocked
    assert Drain.objects.count() == 1

    DisruptionBudget.objects.create(group="web", max_unavailable=0)
    make_lease(fleet["rack2-n1"], "web-1", group="web")
    code, body = post(operator_api, "drain", selector="rack=r2", expected_count=1, deadline_in=3600)
    assert body["counts"] == {"blocked": 1} and body["nodes"][0]["blocker"]["kind"] == "workload_budget", body
    assert Drain.objects.count() == 1


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_bulk_drains_at_once_stay_within_the_pool_budget():
    from fleet.events import Actor
    from operations import bulk

    pool = PoolFactory(name="general")
    for i in range(4):
        make_schedulable_node(pool, hostname=f"n{i}", labels={"rack": "r1"})
    PoolOperations.objects.create(pool=pool, disruption_budgets=[{"nodes": "1"}])

    def drain(i):
        from datetime import timedelta

        from django.utils import timezone

        nodes = bulk.select_nodes("rack=r1")
        outcomes = bulk.run("drain", nodes, actor=Actor.system(f"test:{i}"), reason="r",
                            deadline=timezone.now() + timedelta(hours=1))  # fmt: skip
        return [o.outcome for o in outcomes]

    with Hold("operations.disruption.lock_pool_operations", parties=2, after=False):
        outcome = race(drain, 2)
    assert not outcome.errors, outcome.errors
    assert Drain.objects.count() == 1
    assert sum(r.count("draining") for r in outcome.results) == 1
