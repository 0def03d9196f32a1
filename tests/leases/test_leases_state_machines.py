"""Lease, LeaseRequest and LeaseCheckpoint on django-fsm-2 (issue 28, step 6).

The services move rows with set-based claims built from the declared transitions
(``nodepool.fsm.move``); these tests check that each statement moves exactly the rows the
declaration allows, from every state, to the declared target — and the known risks of protected
fields: direct assignment, and ``refresh_from_db`` (deferred fields too) under threads.
"""

from __future__ import annotations

import pytest
from django.utils import timezone

from fleet.events import Actor
from leases import fencing, lifecycle, requeue, services
from leases.choices import LIVE_LEASE_STATES, TERMINAL_LEASE_STATES, CheckpointState, LeaseRequestState, LeaseState
from leases.models import ENDINGS, Lease, LeaseCheckpoint, LeaseRequest
from nodepool import fsm
from tests.factories import PoolFactory, make_schedulable_node
from tests.races import race
from tests.support import grant

ACTOR = Actor.system("t")


@pytest.fixture
def pool(db):
    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 64000, "memory": 2**36})
    return pool


def test_the_declared_graphs():
    assert fsm.sources(Lease, "activate") == (LeaseState.GRANTED,)
    assert fsm.target(Lease, "activate") == LeaseState.ACTIVE
    assert set(ENDINGS) == set(TERMINAL_LEASE_STATES)
    for to_state, verb in ENDINGS.items():
        assert fsm.sources(Lease, verb) == tuple(LIVE_LEASE_STATES)
        assert fsm.target(Lease, verb) == to_state
    for verb, goal in (("place", LeaseRequestState.PLACED), ("cancel", LeaseRequestState.CANCELLED)):
        assert fsm.sources(LeaseRequest, verb) == (LeaseRequestState.PENDING,)
        assert fsm.target(LeaseRequest, verb) == goal
    for verb, goal in (("take", CheckpointState.TAKEN), ("withdraw", CheckpointState.WITHDRAWN)):
        assert fsm.sources(LeaseCheckpoint, verb) == (CheckpointState.REQUESTED,)
        assert fsm.target(LeaseCheckpoint, verb) == goal


def _lease_in(client_user, state: str, name: str) -> Lease:
    lease = grant(client_user, name)
    Lease.objects.filter(pk=lease.pk).update(state=state)
    return lease


@pytest.mark.parametrize("to_state", sorted(TERMINAL_LEASE_STATES))
def test_end_lease_moves_exactly_the_declared_sources_to_the_declared_target(pool, client_user, to_state):
    """The ending statement (leases.lifecycle.end_lease) and Lease.<verb> agree, from every state."""
    verb, now = ENDINGS[to_state], timezone.now()
    for state in LeaseState.values:
        lease = _lease_in(client_user, state, f"job-{to_state}-{state}")
        ended = lifecycle.end_lease(lease.pk, to_state=to_state, actor=ACTOR, reason="t", now=now)
        after = Lease.objects.get(pk=lease.pk).state
        if state in fsm.sources(Lease, verb):
            assert ended is not None and after == fsm.target(Lease, verb), state
        else:
            assert ended is None and after == state, state


def test_activation_moves_only_a_granted_lease(pool, client_user, node_for):
    """The node's ``running`` report (leases.fencing.lease_report_event) and Lease.activate agree."""
    for state in LeaseState.values:
        lease = _lease_in(client_user, state, f"job-run-{state}")
        data = {"fencing_token": lease.fencing_token, "node_incarnation": lease.node_incarnation, "state": "running"}
        try:
            fencing.lease_report_event(lease_id=lease.pk, data=data, node=node_for(lease), actor=ACTOR)
        except Exception:  # a terminal lease is 410: the claim never ran
            assert state not in LIVE_LEASE_STATES, state
        after = Lease.objects.get(pk=lease.pk).state
        expected = fsm.target(Lease, "activate") if state in fsm.sources(Lease, "activate") else state
        assert after == expected, state


@pytest.fixture
def node_for():
    from fleet.models import Node

    return lambda lease: Node.objects.get(pk=lease.node_id)


def _request_in(pool, client_user, state: str, name: str) -> LeaseRequest:
    request = LeaseRequest.objects.create(workload_id=name, pool=pool, client=client_user, spec={})
    LeaseRequest.objects.filter(pk=request.pk).update(state=state)
    return request


def test_cancelling_moves_only_a_pending_request(pool, client_user):
    """``DELETE /lease-requests/{id}`` (services.lease_request_cancel) and LeaseRequest.cancel agree."""
    for state in LeaseRequestState.values:
        request = _request_in(pool, client_user, state, f"job-cancel-{state}")
        try:
            services.lease_request_cancel(request_id=request.pk, user=client_user, actor=ACTOR)
        except Exception:  # 409 lease_request_not_pending
            assert state not in fsm.sources(LeaseRequest, "cancel"), state
        after = LeaseRequest.objects.get(pk=request.pk).state
        expected = fsm.target(LeaseRequest, "cancel") if state in fsm.sources(LeaseRequest, "cancel") else state
        assert after == expected, state


def test_a_grant_supersedes_only_pending_requeues(pool, client_user):
    """requeue.on_granted's cancel of another pending requeue of the workload: LeaseRequest.cancel."""
    old = grant(client_user, "job-requeued")
    lifecycle.end_lease(old.pk, to_state=LeaseState.REVOKED, actor=ACTOR, reason="t", now=timezone.now())
    requests = {}
    for state in LeaseRequestState.values:
        request = LeaseRequest.objects.create(
            workload_id="job-requeued", pool=pool, client=client_user, spec={}, requeued_from=old
        )
        LeaseRequest.objects.filter(pk=request.pk).update(state=state)
        requests[state] = request
    new = grant(client_user, "job-requeued")
    requeue.on_granted(new, None, actor=ACTOR)
    for state, request in requests.items():
        expected = fsm.target(LeaseRequest, "cancel") if state in fsm.sources(LeaseRequest, "cancel") else state
        assert LeaseRequest.objects.get(pk=request.pk).state == expected, state


def test_checkpoint_withdrawal_moves_only_requested_rows(pool, client_user):
    """fencing.withdraw_checkpoint_requests (a cancelled drain) and LeaseCheckpoint.withdraw agree."""
    rows = {}
    for state in CheckpointState.values:
        lease = grant(client_user, f"job-checkpoint-{state}")
        row = LeaseCheckpoint.objects.create(
            lease=lease, fencing_token=lease.fencing_token, node_incarnation=lease.node_incarnation, state=state
        )
        rows[state] = row
    moved = fencing.withdraw_checkpoint_requests([row.lease_id for row in rows.values()])
    assert moved == len(fsm.sources(LeaseCheckpoint, "withdraw"))
    for state, row in rows.items():
        expected = (
            fsm.target(LeaseCheckpoint, "withdraw") if state in fsm.sources(LeaseCheckpoint, "withdraw") else state
        )
        assert LeaseCheckpoint.objects.get(pk=row.pk).state == expected, state


def test_the_state_is_protected_and_a_verb_moves_an_instance(pool, client_user):
    lease = Lease.objects.get(pk=grant(client_user, "job-protected").pk)
    with pytest.raises(AttributeError):
        lease.state = LeaseState.RELEASED
    lease.activate()  # in memory only: the services move rows with fsm.move
    assert lease.state == LeaseState.ACTIVE
    lease.refresh_from_db()
    assert lease.state == LeaseState.GRANTED


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_threads_refreshing_leases_and_loading_deferred_states_never_trip_the_protected_field(client_user):
    """django-fsm-2 lifts the shared ``protected`` flag during a refresh; SerializedFSMRefresh
    (first in the bases) keeps two threads' refreshes from interleaving."""
    make_schedulable_node(PoolFactory(name="general"), resources={"cpu": 8000, "memory": 2**34})
    lease = grant(client_user, "job-threads")
    request = LeaseRequest.objects.create(workload_id="job-queued", client=client_user, spec={})

    def refresh_many(_):
        for _ in range(100):
            copy = Lease.objects.only("id", "workload_id").get(pk=lease.pk)
            assert copy.state == LeaseState.GRANTED  # deferred: loaded by a refresh
            copy.refresh_from_db()
            queued = LeaseRequest.objects.defer("state").get(pk=request.pk)
            assert queued.state == LeaseRequestState.PENDING
        return "ok"

    outcome = race(refresh_many, 4)
    assert not outcome.errors, outcome.errors
    assert outcome.results == ["ok"] * 4
