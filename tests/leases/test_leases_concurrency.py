"""Many clients racing for one node: never oversubscribed, never two live leases per workload."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from fleet.events import Actor
from fleet.models import Node, NodeResource
from leases.models import Lease
from leases.services import lease_create
from leases.sweeps import check_consistency, expire_leases
from tests.factories import PoolFactory, make_schedulable_node
from tests.races import Hold, race
from tests.support import grant_status

THREADS = 16


def run_in_threads(count, target):
    outcome = race(target, count)
    return outcome.results, outcome.errors


def grant(user, workload_id, cpu="1"):
    return grant_status(user, workload_id, pool="race", cpu=cpu)


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_racing_clients_never_oversubscribe_one_node(client_user):
    node, _ = make_schedulable_node(PoolFactory(name="race"), resources={"cpu": 8000, "memory": 2**34})
    results, errors = run_in_threads(THREADS, lambda i: grant(client_user, f"job-{i}"))
    assert not errors
    assert sorted(results, key=str).count(201) == 8
    assert results.count(409) == THREADS - 8
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 8000
    assert Lease.objects.filter(state="granted").count() == 8
    assert check_consistency().drift == []


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_racing_requests_for_one_workload_get_one_live_lease(client_user):
    node, _ = make_schedulable_node(PoolFactory(name="race"), resources={"cpu": 64000, "memory": 2**34})
    results, errors = run_in_threads(THREADS, lambda i: grant(client_user, "the-one-job"))
    assert not errors
    assert results.count(201) == 1
    assert results.count(409) == THREADS - 1
    assert Lease.objects.filter(workload_id="the-one-job").count() == 1
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 1000


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_racing_retries_with_one_idempotency_key_share_one_lease(client_user):
    make_schedulable_node(PoolFactory(name="race"), resources={"cpu": 64000, "memory": 2**34})
    body = {"workload_id": "job-k", "pool": "race", "resources": {"cpu": "1"}}

    def retry(_):
        lease, status = lease_create(data=body, client=client_user, actor=Actor.system("t"), idempotency_key="k")
        return str(lease.pk), status

    results, errors = run_in_threads(8, retry)
    assert not errors, errors
    assert len({lease_id for lease_id, _ in results}) == 1
    assert Lease.objects.count() == 1


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_a_loser_of_the_race_takes_the_next_node(client_user):
    pool = PoolFactory(name="race")
    nodes = [make_schedulable_node(pool, resources={"cpu": 2000, "memory": 2**34})[0] for _ in range(4)]
    results, errors = run_in_threads(8, lambda i: grant(client_user, f"job-{i}"))
    assert not errors
    assert results.count(201) == 8
    for node in nodes:
        assert NodeResource.objects.get(node=node, name="cpu").allocated == 2000


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_expiry_sweeps_at_once_return_capacity_once(client_user):
    node, _ = make_schedulable_node(PoolFactory(name="race"), resources={"cpu": 8000, "memory": 2**34})
    for i in range(6):
        grant(client_user, f"job-{i}")
    later = timezone.now() + timedelta(hours=1)
    with time_machine.travel(later):
        results, errors = run_in_threads(4, lambda i: expire_leases())
    assert not errors
    assert sum(results) == 6
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 0
    assert Lease.objects.filter(state="expired").count() == 6


@pytest.mark.django_db
def test_a_node_cordoned_after_it_was_chosen_gets_no_lease(client_user, monkeypatch):
    from leases import placement
    from tests.factories import place_test_hold

    pool = PoolFactory(name="race")
    chosen, _ = make_schedulable_node(pool, resources={"cpu": 8000, "memory": 2**34})
    other, _ = make_schedulable_node(pool, resources={"cpu": 1000, "memory": 2**34})
    find = placement.find_candidates

    def find_then_cordon(*args, **kwargs):
        search = find(*args, **kwargs)
        # An operator cordons the best candidate between the read and the reservation.
        place_test_hold(chosen, "user:olivia")
        return search._replace(candidates=sorted(search.candidates, key=lambda c: c.node.pk != chosen.pk))

    monkeypatch.setattr(placement, "find_candidates", find_then_cordon)
    assert grant(client_user, "job-late-cordon") == 201
    lease = Lease.objects.get(workload_id="job-late-cordon")
    assert lease.node_id == other.pk
    assert NodeResource.objects.get(node=chosen, name="cpu").allocated == 0


@pytest.mark.django_db
def test_a_node_restarted_after_it_was_chosen_gets_the_lease_on_its_new_incarnation(client_user, monkeypatch):
    """The lease takes the incarnation read under the grant's hold on the node, not the one the
    candidate search read: otherwise the restart's next report would declare the new lease lost."""
    from django.db.models import F

    from leases import placement

    pool = PoolFactory(name="race")
    node, _ = make_schedulable_node(pool, resources={"cpu": 8000, "memory": 2**34})
    find = placement.find_candidates

    def find_then_restart(*args, **kwargs):
        search = find(*args, **kwargs)
        Node.objects.filter(pk=node.pk).update(incarnation=F("incarnation") + 1)  # a restart reported
        return search

    monkeypatch.setattr(placement, "find_candidates", find_then_restart)
    assert grant(client_user, "job-restart") == 201
    assert Lease.objects.get(workload_id="job-restart").node_incarnation == node.incarnation + 1


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_a_grant_racing_a_quarantine_never_leaves_a_live_lease_on_the_quarantined_node(client_user, operator):
    from fleet.choices import Lifecycle
    from leases.choices import LIVE_LEASE_STATES
    from maintenance.services import quarantine_node

    node, _ = make_schedulable_node(PoolFactory(name="race"), resources={"cpu": 64000, "memory": 2**36})
    version = node.version
    # The grant stops inside its transaction right after re-checking (and on PostgreSQL share-
    # locking) the node; the quarantine starts then. Without the lock it would commit first, miss
    # the uncommitted lease, and leave it live on a quarantined node.
    inside = Hold("leases.services._hold_schedulable_node", parties=2, timeout=1.0)

    def act(index):
        if index == 0:
            assert inside.arrived.wait(10), "the grant never reached its critical section"
            return quarantine_node(
                node_id=node.pk, expected_version=version, reason="incident", evidence={}, actor=Actor.system("test")
            )
        return grant(client_user, "job-q")

    with inside:
        outcome = race(act, 2)
    assert not outcome.errors, outcome.errors
    assert outcome.results[1] == 201
    assert Node.objects.get(pk=node.pk).lifecycle == Lifecycle.QUARANTINED
    assert not Lease.objects.filter(node=node, state__in=LIVE_LEASE_STATES).exists()
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 0


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_operators_checkpointing_one_lease_on_the_same_version_one_wins(client_user, operator_api):
    make_schedulable_node(PoolFactory(name="race"), resources={"cpu": 8000, "memory": 2**34})
    assert grant(client_user, "job-checkpoint") == 201
    lease = Lease.objects.get(workload_id="job-checkpoint")

    def checkpoint(index):
        return operator_api.post(
            f"/api/v1/node-leases/{lease.pk}/checkpoint", {}, format="json", HTTP_IF_MATCH=f'"{lease.version}"'
        ).status_code

    results, errors = run_in_threads(4, checkpoint)
    assert not errors, errors
    assert sorted(results) == [200, 412, 412, 412]
    assert Lease.objects.get(pk=lease.pk).version == lease.version + 1
