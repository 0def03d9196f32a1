"""Many clients racing for one node: never oversubscribed, never two live leases per workload."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.contrib.auth.models import Group, User
from django.utils import timezone

from fleet.events import Actor
from fleet.models import Node, NodeResource
from leases.models import Lease
from leases.services import lease_create
from leases.sweeps import check_consistency, expire_leases
from nodepool.api.permissions import CLIENTS
from tests import support
from tests.factories import PoolFactory, make_schedulable_node
from tests.races import Hold, race
from tests.support import grant_status, lease_body

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
def test_an_idempotency_key_is_scoped_to_its_client_even_when_two_clients_race_with_it(client_user):
    """Client A holds a lease made with key ``k``; client B sends the same key at the same moment
    as A's retries. Each client gets one outcome, its own: A's retries replay A's lease, B gets a
    new lease of its own (never A's lease, never A's 422). Guards the key's client scope (issue 28:
    no test had two clients send the same key)."""
    other = User.objects.create_user("bruno-client")
    other.groups.add(Group.objects.get_or_create(name=CLIENTS)[0])
    make_schedulable_node(PoolFactory(name="race"), resources={"cpu": 64000, "memory": 2**34})
    bodies = {client_user.pk: lease_body("job-a", pool="race"), other.pk: lease_body("job-b", pool="race")}
    first, status = lease_create(
        data=bodies[client_user.pk], client=client_user, actor=Actor.system("t"), idempotency_key="k"
    )
    assert status == 201
    clients = [client_user, other, client_user, other]

    def send(i):
        client = clients[i]
        lease, status = lease_create(
            data=bodies[client.pk], client=client, actor=Actor.system("t"), idempotency_key="k"
        )
        return client.pk, str(lease.pk), status

    results, errors = run_in_threads(len(clients), send)
    assert not errors, errors
    answers = {pk: {(lease_id, status) for who, lease_id, status in results if who == pk} for pk in bodies}
    assert answers[client_user.pk] == {(str(first.pk), 200)}
    b_leases = {lease_id for lease_id, _ in answers[other.pk]}
    assert len(b_leases) == 1 and b_leases != {str(first.pk)}
    assert sorted(status for _, status in answers[other.pk]) in ([200, 201], [201])  # a replay, or one answer twice
    [b_lease] = b_leases
    assert Lease.objects.get(pk=b_lease).client == other and Lease.objects.get(pk=b_lease).workload_id == "job-b"
    assert Lease.objects.count() == 2
    # A later retry of each client still finds its own lease.
    for client in (client_user, other):
        lease, status = lease_create(
            data=bodies[client.pk], client=client, actor=Actor.system("t"), idempotency_key="k"
        )
        assert (status, lease.client) == (200, client)


@pytest.mark.django_db
def test_the_expiry_sweep_rechecks_expiry_when_it_claims_a_renewed_lease(client_user, monkeypatch):
    """A renewal that lands between the sweep's read of due leases and its claim of one keeps the
    lease: the claim repeats ``expires_at <= now`` (issue 28: no test renewed between read and claim)."""
    from leases import sweeps
    from leases.fencing import lease_renew

    make_schedulable_node(PoolFactory(name="race"), resources={"cpu": 8000, "memory": 2**34})
    lease = support.grant(client_user, "job-renewed", pool="race", ttl_seconds=60)
    renewed_at = lease.expires_at - timedelta(seconds=1)  # the renewal's own clock: still live
    sweep_at = lease.expires_at + timedelta(seconds=1)  # the sweep's: due
    claim = sweeps.end_lease

    def renew_then_claim(lease_id, **kwargs):
        lease_renew(
            lease_id=lease_id,
            data={"fencing_token": lease.fencing_token, "node_incarnation": lease.node_incarnation},
            user=client_user,
            actor=Actor.system("t"),
            now=renewed_at,
        )
        return claim(lease_id, **kwargs)

    monkeypatch.setattr(sweeps, "end_lease", renew_then_claim)
    assert expire_leases(now=sweep_at) == 0
    stored = Lease.objects.get(pk=lease.pk)
    assert stored.state == "granted" and stored.expires_at == renewed_at + timedelta(seconds=60)
    assert NodeResource.objects.get(name="cpu").allocated == 1000


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
    inside = Hold("leases.grant._hold_schedulable_node", parties=2, timeout=1.0)

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
