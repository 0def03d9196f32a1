"""Queued lease requests wait with their reasons and are placed in priority, then arrival, order."""

from __future__ import annotations

import pytest
from django.core.cache import cache

from fleet.models import NodeResource
from leases.models import Lease, LeaseRequest
from leases.sweeps import place_pending_requests
from tests.factories import PoolFactory, make_schedulable_node

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_cache():
    cache.clear()  # the queue kick is deduplicated through the cache


@pytest.fixture
def node():
    return make_schedulable_node(PoolFactory(name="general"), resources={"cpu": 4000, "memory": 2**34})[0]


def ask(api, workload_id, cpu="4", **extra):
    body = {"workload_id": workload_id, "pool": "general", "resources": {"cpu": cpu}, **extra}
    return api.post("/api/v1/node-leases", body, format="json")


def test_a_queued_request_waits_with_its_reasons(client_api, node):
    first = ask(client_api, "job-1").json()
    response = ask(client_api, "job-2", queue=True)
    assert response.status_code == 202
    body = response.json()
    assert body["state"] == "pending"
    assert body["reasons"] == {"insufficient_cpu": 1}
    detail = client_api.get(f"/api/v1/lease-requests/{body['lease_request']}")
    assert detail.status_code == 200
    assert detail.json()["message"].startswith("0/1 nodes are available: 1 Insufficient cpu")
    assert detail.json()["pending_seconds"] >= 0
    assert first["state"] == "granted"


def test_a_released_lease_places_the_waiting_request(client_api, node, django_capture_on_commit_callbacks):
    first = ask(client_api, "job-1").json()
    waiting = ask(client_api, "job-2", queue=True).json()
    with django_capture_on_commit_callbacks(execute=True):
        client_api.post(
            f"/api/v1/node-leases/{first['id']}/release",
            {"fencing_token": first["fencing_token"], "node_incarnation": first["node_incarnation"]},
            format="json",
        )
    request = LeaseRequest.objects.get(pk=waiting["id"])
    assert request.state == "placed"
    assert request.lease.workload_id == "job-2"
    assert request.placed_at is not None
    shown = client_api.get(f"/api/v1/lease-requests/{request.pk}").json()
    assert shown["lease_id"] == str(request.lease_id)
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 4000


def test_higher_priority_goes_first_then_arrival_order(client_api, node):
    first = ask(client_api, "job-0").json()
    low = ask(client_api, "low", cpu="2", queue=True).json()
    high = ask(client_api, "high", cpu="2", queue=True, priority=10).json()
    later_high = ask(client_api, "high-later", cpu="2", queue=True, priority=10).json()
    Lease.objects.filter(pk=first["id"]).update(state="released")
    NodeResource.objects.filter(node=node, name="cpu").update(allocated=0)
    assert place_pending_requests() == {"placed": 2, "pending": 1}
    states = {str(r.pk): r.state for r in LeaseRequest.objects.all()}
    assert states[high["id"]] == states[later_high["id"]] == "placed"
    assert str(states[low["id"]]) == "pending"


def test_a_pending_request_can_be_cancelled_by_its_client(client_api, node):
    ask(client_api, "job-1")
    waiting = ask(client_api, "job-2", queue=True).json()
    assert client_api.delete(f"/api/v1/lease-requests/{waiting['id']}").json()["state"] == "cancelled"
    assert client_api.delete(f"/api/v1/lease-requests/{waiting['id']}").status_code == 409


def test_queued_retry_with_the_same_key_returns_the_same_request(client_api, node):
    ask(client_api, "job-1")
    body = {"workload_id": "job-2", "pool": "general", "resources": {"cpu": "4"}, "queue": True}
    first = client_api.post("/api/v1/node-leases", body, format="json", HTTP_IDEMPOTENCY_KEY="q1")
    again = client_api.post("/api/v1/node-leases", body, format="json", HTTP_IDEMPOTENCY_KEY="q1")
    assert first.status_code == 202
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert LeaseRequest.objects.count() == 1


def test_other_clients_cannot_see_a_lease_request(client_api, operator_api, node):
    ask(operator_api, "job-1")
    waiting = ask(operator_api, "job-2", queue=True).json()
    assert client_api.get(f"/api/v1/lease-requests/{waiting['id']}").status_code == 404
    assert client_api.delete(f"/api/v1/lease-requests/{waiting['id']}").status_code == 404


def test_a_queued_request_is_explained_again_at_most_every_explanation_ttl(client_api, node, monkeypatch):
    from leases import placement

    ask(client_api, "job-1")
    ask(client_api, "job-2", queue=True)
    calls = []
    real = placement.diagnose
    monkeypatch.setattr(placement, "diagnose", lambda *a, **k: calls.append(1) or real(*a, **k))
    for _ in range(5):
        assert place_pending_requests() == {"placed": 0, "pending": 1}
    assert len(calls) == 1, "five retries, one full explanation"
    request = LeaseRequest.objects.get(workload_id="job-2")
    assert request.attempts >= 5 and request.reasons == {"insufficient_cpu": 1}
    cache.clear()  # the explanation's time is up
    place_pending_requests()
    assert len(calls) == 2


def _waiting_request_with_room(client_api, node) -> LeaseRequest:
    """job-2 queued behind job-1 on a full node, then room added without kicking the queue."""
    ask(client_api, "job-1")
    ask(client_api, "job-2", queue=True)
    NodeResource.objects.filter(node=node, name="cpu").update(allocatable=12000)
    return LeaseRequest.objects.get(workload_id="job-2")


def test_a_grant_committed_under_a_queue_pass_leaves_the_request_waiting(client_api, node, monkeypatch):
    """The workload gets a live lease (a direct request) after the pass checked for one: the pass
    stands down for that request instead of failing, and changes nothing of it."""
    from leases import placement

    request = _waiting_request_with_room(client_api, node)
    real, raced = placement.find_candidates, []

    def direct_grant_first(pool, spec, **kwargs):
        if spec.workload_id == "job-2" and not raced:
            raced.append("granting")  # the direct request's own search comes through here too
            raced[0] = ask(client_api, "job-2", cpu="1").status_code
        return real(pool, spec, **kwargs)

    monkeypatch.setattr(placement, "find_candidates", direct_grant_first)
    assert place_pending_requests() == {"placed": 0, "pending": 1}
    assert raced == [201]
    request.refresh_from_db()
    assert (request.state, request.lease_id, request.version) == ("pending", None, 1)
    assert Lease.objects.filter(workload_id="job-2").count() == 1
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 5000, "job-1 and the direct job-2"


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_queue_passes_at_once_place_a_request_once(client_api, node):
    from tests.races import Hold, race

    request = _waiting_request_with_room(client_api, node)
    # Both passes have chosen their node before either reserves: without the claim on the
    # request, the second one's lease row hit the unique index and failed the whole pass.
    with Hold("leases.placement.find_candidates", parties=2, timeout=2):
        outcome = race(lambda _: place_pending_requests(), 2)
    assert not outcome.errors, outcome.errors
    assert sorted(r["placed"] for r in outcome.results) == [0, 1]
    request.refresh_from_db()
    assert request.state == "placed"
    assert Lease.objects.filter(workload_id="job-2").get() == request.lease
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 8000


def test_a_request_that_fails_for_another_reason_says_so_instead_of_waiting_silently(node, caplog):
    """A fencing sequence behind the workload's leases (a restored table, a hand fix) makes every
    grant of it fail on the token index: the pass logs it and writes it on the request."""
    import logging

    from django.utils import timezone

    now = timezone.now()
    Lease.objects.create(
        workload_id="job-2", fencing_token=1, node=node, node_incarnation=node.incarnation, pool=node.pool,
        state="released", resources={}, ttl_seconds=60, expires_at=now, granted_at=now, ended_at=now,
    )  # fmt: skip
    spec = {"workload_id": "job-2", "pool": "general", "resources": {"cpu": "1"}, "queue": True}
    request = LeaseRequest.objects.create(workload_id="job-2", pool=node.pool, spec=spec)
    with caplog.at_level(logging.ERROR, logger="leases.sweeps"):
        assert place_pending_requests() == {"placed": 0, "pending": 1}
    request.refresh_from_db()
    assert (request.state, request.attempts) == ("pending", 1)
    assert request.message.startswith("placement failed:") and "fencing_token" in request.message
    assert [r.getMessage() for r in caplog.records] == [f"lease request {request.pk} could not be placed"]


def test_a_database_error_on_one_request_leaves_it_waiting_and_the_pass_goes_on(client_api, node, monkeypatch):
    """A deadlock victim (or a statement timeout) on one grant rolls that grant back; the pass
    counts the request as waiting and places the requests behind it."""
    from django.db import OperationalError

    from leases import grant

    ask(client_api, "job-1")
    assert ask(client_api, "job-2", queue=True).status_code == 202
    second = ask(client_api, "job-3", cpu="1", queue=True)
    assert second.status_code == 202
    NodeResource.objects.filter(node=node, name="cpu").update(allocatable=12000)
    first = LeaseRequest.objects.get(workload_id="job-2")
    real, failed = grant._reserve, []

    def deadlock_on_job_2(**kwargs):
        if kwargs["spec"].workload_id == "job-2" and not failed:
            failed.append(True)
            raise OperationalError("deadlock detected")
        return real(**kwargs)

    monkeypatch.setattr(grant, "_reserve", deadlock_on_job_2)
    assert place_pending_requests() == {"placed": 1, "pending": 1}
    first.refresh_from_db()
    assert (first.state, first.lease_id) == ("pending", None)
    assert LeaseRequest.objects.get(workload_id="job-3").state == "placed"
    assert place_pending_requests() == {"placed": 1, "pending": 0}
    first.refresh_from_db()
    assert (first.state, first.attempts) == ("placed", 2)  # queued (1), then the pass that placed it


def test_a_queued_request_is_created_at_the_instant_of_its_first_attempt(client_user, node):
    """``created_at`` is the instant the request was judged by, like ``last_attempt_at``: with
    ``auto_now_add`` the row took the clock of its INSERT, a few ms after the attempt it records
    (so its attempt came before its creation), and hours after when the caller's ``now`` is not
    the wall clock."""
    from datetime import timedelta

    from django.utils import timezone

    from fleet.events import Actor
    from leases.services import lease_create

    lease_create(data={"workload_id": "job-1", "pool": "general", "resources": {"cpu": "4"}},
                 client=client_user, actor=Actor.system("t"))  # fmt: skip
    now = timezone.now() - timedelta(seconds=5)
    body = {"workload_id": "job-2", "pool": "general", "resources": {"cpu": "4"}, "queue": True}
    request, status = lease_create(data=body, client=client_user, actor=Actor.system("t"), now=now)
    assert status == 202
    request = LeaseRequest.objects.get(pk=request.pk)
    assert request.created_at == request.last_attempt_at == now


def test_a_requeued_request_is_created_at_the_instant_of_its_first_attempt(client_user, node):
    from datetime import timedelta

    from django.utils import timezone

    from fleet.events import Actor
    from leases import requeue
    from leases.lifecycle import end_lease
    from leases.services import lease_create

    lease, _ = lease_create(data={"workload_id": "job-1", "pool": "general", "resources": {"cpu": "4"}},
                            client=client_user, actor=Actor.system("t"))  # fmt: skip
    now = timezone.now() - timedelta(seconds=5)
    ended = end_lease(lease.pk, to_state="revoked", reason="test", now=now, actor=Actor.system("t"))
    request = requeue.requeue_lease(ended, pool=None, actor=Actor.system("t"), reason="test", now=now)
    request = LeaseRequest.objects.get(pk=request.pk)
    assert request.created_at == request.last_attempt_at == now
