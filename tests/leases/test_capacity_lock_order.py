"""The grant locks a node's resource rows in name order (leases.sql.grant.take_capacity), the order
a lease's end gives them back in (leases.lifecycle.return_capacity, one row at a time, sorted).

A bare multi-row UPDATE locked them in its plan's scan order: on a small table a sequential scan,
so in the order the rows lie in the heap, which a non-HOT update changes. Two grants on one node, or
a grant and an end, then locked cpu and memory in opposite orders and PostgreSQL broke the deadlock
by failing one of them (seen under six threads of grants: 2 in 480).

PostgreSQL row locks: another transaction holds the cpu row (as an ending lease does first); the
grant waits for it, and while it waits it must hold no other resource row of the node — a third
connection takes the memory row with ``NOWAIT``. Here the memory row lies before the cpu row in the
heap, so with the scan order the grant held memory while it waited, and the ``NOWAIT`` failed.
"""

from __future__ import annotations

import pytest
from django.db import DatabaseError, connection, transaction

from fleet.models import NodeResource
from leases.models import Lease
from tests.factories import PoolFactory, make_schedulable_node
from tests.races import in_thread, wait_until_waiting_on_locks
from tests.support import grant_status


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_a_grant_waiting_for_one_resource_row_holds_none_of_the_others(client_user):
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite serialises every writing transaction")
    errors: list = []
    # Memory first: its row lies before the cpu row in the heap (the sequential scan's order).
    node, _ = make_schedulable_node(PoolFactory(name="general"), resources={"memory": 32 * 2**30, "cpu": 8000})
    outcome: dict = {}

    def grant():
        outcome["grant"] = grant_status(client_user, "job-1", resources={"cpu": "1", "memory": "1Gi"})

    def probe():
        try:
            with transaction.atomic():
                outcome["probed"] = len(
                    list(NodeResource.objects.select_for_update(nowait=True).filter(node=node, name="memory"))
                )
        except DatabaseError as exc:
            outcome["probed"] = exc

    with transaction.atomic():
        NodeResource.objects.select_for_update(no_key=True).get(node=node, name="cpu")  # an ending lease's first row
        granter = in_thread(grant, errors)
        assert wait_until_waiting_on_locks(), f"the grant never waited for the cpu row: {errors!r}"
        in_thread(probe, errors).join(20)
    granter.join(20)
    assert outcome["probed"] == 1, f"the waiting grant held the memory row: {outcome['probed']!r}"
    assert outcome["grant"] == 201, outcome["grant"]
    assert Lease.objects.filter(workload_id="job-1", state="granted").count() == 1
    assert dict(NodeResource.objects.filter(node=node).values_list("name", "allocated")) == {
        "cpu": 1000,
        "memory": 2**30,
    }


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_a_grant_passes_over_a_node_another_grant_is_reserving_then_waits_when_it_is_the_only_one(client_user):
    """The first round over the candidates passes over a node whose capacity rows another
    transaction holds (another grant between its UPDATE and its COMMIT): the grant takes the next
    node at once instead of queueing behind that COMMIT. With one node left, the second round waits."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite serialises every writing transaction")
    errors: list = []
    pool = PoolFactory(name="general", scheduling_policy="binpack")
    fuller, _ = make_schedulable_node(pool, resources={"cpu": 2000, "memory": 32 * 2**30})
    emptier, _ = make_schedulable_node(pool, resources={"cpu": 8000, "memory": 32 * 2**30})
    outcome: dict = {}

    def grant(name):
        outcome[name] = grant_status(client_user, name, resources={"cpu": "1"})

    with transaction.atomic():
        NodeResource.objects.select_for_update(no_key=True).get(node=fuller, name="cpu")  # a grant in flight
        first = in_thread(lambda: grant("first"), errors)
        first.join(20)
        assert outcome.get("first") == 201, (outcome, errors)  # granted while the fuller node was held
    assert Lease.objects.get(workload_id="first").node_id == emptier.pk

    NodeResource.objects.filter(node=emptier).delete()  # one node left: the second round must wait for it
    with transaction.atomic():
        NodeResource.objects.select_for_update(no_key=True).get(node=fuller, name="cpu")
        second = in_thread(lambda: grant("second"), errors)
        assert wait_until_waiting_on_locks(), f"the grant never waited for the only node: {errors!r}"
    second.join(20)
    assert outcome.get("second") == 201, (outcome, errors)
    assert Lease.objects.get(workload_id="second").node_id == fuller.pk
