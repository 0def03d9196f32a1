"""Spot pools: preemption notices drain the node at once with their deadline, the work is requeued
for its client in the fallback pool under a new fencing token, and the old lease says so."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from fleet.models import NodeEvent
from leases.models import Lease, LeaseRequest
from leases.sweeps import place_pending_requests
from operations import preemption as preemption_service
from operations.models import Preemption
from operations.providers import signed_headers
from tests.factories import PoolFactory, make_schedulable_node
from tests.heartbeat_support import node_api

pytestmark = pytest.mark.django_db
SPOT_TOLERATION = {"key": "nodepool.dev/spot", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture(autouse=True)
def _fresh_cache():
    cache.clear()


@pytest.fixture
def pools(operator_api):
    spot, ondemand = PoolFactory(name="spot"), PoolFactory(name="ondemand")
    response = operator_api.patch(
        "/api/v1/pools/spot/operations",
        {"spot": True, "fallback_pool": "ondemand", "provider_secret": "s3cret"},
        format="json",
        HTTP_IF_MATCH='"1"',
    )
    assert response.status_code == 200, response.content
    spot.refresh_from_db()
    spot_node, spot_secret = make_schedulable_node(spot, resources={"cpu": 4000, "memory": 2**33},
                                                   taints=list(spot.taints))  # fmt: skip
    ondemand_node, _ = make_schedulable_node(ondemand, resources={"cpu": 4000, "memory": 2**33})
    return spot, spot_node, spot_secret, ondemand_node


def grant(api, workload_id="job-1", **extra):
    body = {"workload_id": workload_id, "pool": "spot", "resources": {"cpu": "2"}, "tolerations": [SPOT_TOLERATION],
            "command": ["sleep", "600"], **extra}  # fmt: skip
    response = api.post("/api/v1/node-leases", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def notice(secret, node, seconds=30, **body):
    deadline = (timezone.now() + timedelta(seconds=seconds)).isoformat()
    return node_api(secret).post(f"/api/v1/nodes/{node.pk}/preemption-notice", {"deadline": deadline, **body},
                                 format="json")  # fmt: skip


def checkpointed(secret, lease):
    return node_api(secret).post(
        f"/api/v1/node-leases/{lease['id']}/events",
        {"fencing_token": lease["fencing_token"], "node_incarnation": lease["node_incarnation"],
         "state": "checkpointed", "message": "state saved"},
        format="json",
    )  # fmt: skip


def test_marking_a_pool_spot_taints_it_so_only_tolerating_requests_land_there(pools, client_api):
    spot, *_ = pools
    assert {"key": "nodepool.dev/spot", "value": "true", "effect": "NoSchedule"} in spot.taints
    refused = client_api.post("/api/v1/node-leases", {"workload_id": "plain", "pool": "spot",
                                                     "resources": {"cpu": "1"}}, format="json")  # fmt: skip
    assert refused.status_code == 409
    assert "untolerated_taint" in refused.json()["reasons"]
    assert grant(client_api)["state"] == "granted"


def test_a_notice_drains_at_once_and_the_work_moves_to_the_fallback_pool(
    pools, client_api, django_capture_on_commit_callbacks
):
    spot, spot_node, secret, ondemand_node = pools
    old = grant(client_api)
    with django_capture_on_commit_callbacks(execute=True):
        response = notice(secret, spot_node, seconds=30)
    assert response.status_code == 201, response.content
    spot_node.refresh_from_db()
    assert spot_node.lifecycle == "draining"
    drain = spot_node.drains.get()
    assert (drain.policy, drain.requested_by_name) == ("checkpoint", "system:preemption")
    # The drain ends a margin before the notice: max(10 % of 30 s, 10 s) = 10 s.
    assert abs((Preemption.objects.get().deadline - drain.deadline).total_seconds() - 10) < 1
    assert Lease.objects.get(pk=old["id"]).checkpoint_requested_at is not None

    with django_capture_on_commit_callbacks(execute=True):
        assert checkpointed(secret, old).status_code == 200
        preemption_service.sweep(actor=preemption_service.Actor.system("test"))
        place_pending_requests()

    previous = Lease.objects.get(pk=old["id"])
    request = LeaseRequest.objects.get(requeued_from=previous)
    assert previous.state == "revoked"
    assert (request.state, request.pool.name, request.client.username) == ("placed", "ondemand", "carla-client")
    new = request.lease
    assert (new.node_id, new.workload_id) == (ondemand_node.pk, "job-1")
    assert new.fencing_token > previous.fencing_token
    assert previous.superseded_by_id == new.pk
    shown = client_api.get(f"/api/v1/node-leases/{previous.pk}").json()
    assert (shown["state"], shown["superseded_by"]) == ("revoked", str(new.pk))
    assert client_api.get(f"/api/v1/lease-requests/{request.pk}").json()["requeued_from"] == str(previous.pk)
    lease_events = NodeEvent.objects.filter(lease_id=previous.pk).values_list("reason", flat=True)
    assert any(reason.startswith("requeued") for reason in lease_events)
    assert any(reason.startswith("superseded by") for reason in lease_events)
    assert Preemption.objects.get().leases_requeued == 1


def test_the_clients_own_re_request_still_works_and_supersedes_the_requeue(
    pools, client_api, django_capture_on_commit_callbacks
):
    spot, spot_node, secret, ondemand_node = pools
    old = grant(client_api)
    blocker = client_api.post("/api/v1/node-leases", {"workload_id": "big", "pool": "ondemand",
                                                     "resources": {"cpu": "4"}}, format="json")  # fmt: skip
    assert blocker.status_code == 201  # the fallback pool is full: the requeue has to wait
    with django_capture_on_commit_callbacks(execute=True):
        notice(secret, spot_node, seconds=30)
        checkpointed(secret, old)
        preemption_service.sweep(actor=preemption_service.Actor.system("test"))
    requeue = LeaseRequest.objects.get(requeued_from_id=old["id"])
    assert requeue.state == "pending"

    make_schedulable_node(spot, resources={"cpu": 4000, "memory": 2**33}, taints=list(spot.taints))
    again = grant(client_api)

    requeue.refresh_from_db()
    assert requeue.state == "cancelled" and "client requested itself" in requeue.message
    assert str(Lease.objects.get(pk=old["id"]).superseded_by_id) == again["id"]
    assert again["fencing_token"] > old["fencing_token"]


def test_preemptions_are_counted_per_pool_per_day(pools, operator_api):
    spot, spot_node, secret, _ = pools
    assert notice(secret, spot_node).status_code == 201
    assert notice(secret, spot_node, seconds=10).status_code == 200  # the same notice, deadline moved earlier
    body = operator_api.get("/api/v1/pools/spot/preemptions?days=3").json()
    assert body["per_day"] == [{"date": timezone.now().date().isoformat(), "preemptions": 1}]
    assert len(body["latest"]) == 1
    assert Preemption.objects.get().deadline <= timezone.now() + timedelta(seconds=11)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({}, 400, "invalid_deadline"),
        ({"deadline": "tomorrow"}, 400, "invalid_deadline"),
        ({"deadline": "2026-01-01T00:00:00"}, 400, "timezone_required"),  # the API-wide rule
        ({"deadline": "2026-02-30T00:00:00Z"}, 400, "invalid_deadline"),  # no such day
        ({"deadline": "2020-01-01T00:00:00Z"}, 422, "deadline_out_of_range"),
        ({"deadline": "2999-01-01T00:00:00Z"}, 422, "deadline_out_of_range"),
    ],
)
def test_bad_notices_are_refused_and_change_nothing(pools, body, status, code):
    _, spot_node, secret, _ = pools
    response = node_api(secret).post(f"/api/v1/nodes/{spot_node.pk}/preemption-notice", body, format="json")
    assert (response.status_code, response.json()["code"]) == (status, code)
    spot_node.refresh_from_db()
    assert spot_node.lifecycle == "ready" and not Preemption.objects.exists()


def test_a_node_outside_a_spot_pool_cannot_be_preempted(pools):
    _, _, _, ondemand_node = pools
    _, other_secret = make_schedulable_node(ondemand_node.pool)
    own = make_schedulable_node(ondemand_node.pool)
    response = notice(own[1], own[0])
    assert (response.status_code, response.json()["code"]) == (409, "pool_not_spot")
    assert notice(other_secret, ondemand_node).status_code == 403  # another node's credential


def test_a_provider_notice_must_be_signed_with_the_pools_secret_and_is_not_replayable(pools, client):
    import json

    _, spot_node, _, _ = pools
    deadline = (timezone.now() + timedelta(seconds=30)).isoformat()
    payload = {"delivery_id": "d-1", "node_id": str(spot_node.pk), "deadline": deadline}
    body = json.dumps(payload).encode()
    url = "/api/v1/pools/spot/preemption-notices"

    def post(secret, raw=body, delivery="d-1"):
        headers = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in signed_headers(secret, raw, delivery).items()
                   if k != "Content-Type"}  # fmt: skip
        return client.post(url, raw, content_type="application/json", **headers)

    forged = post("not-the-secret")
    assert (forged.status_code, forged.json()["code"]) == (403, "signature_invalid")
    assert not Preemption.objects.exists()
    accepted = post("s3cret")
    assert accepted.status_code == 201, accepted.content
    assert Preemption.objects.get().source == "provider"
    replay = post("s3cret")
    assert (replay.status_code, replay.json()["code"]) == (403, "replayed")
    unsigned = client.post(url, payload, content_type="application/json")
    assert unsigned.status_code == 403


@pytest.mark.parametrize(
    "bad",
    [{"unknown": 1}, {"node_id": 5}, {"node_id": "not-a-uuid"}, {"deadline": "tomorrow"}],
    ids=["unknown-member", "node-id-not-a-string", "no-such-node", "bad-deadline"],
)
def test_a_refused_signed_notice_leaves_no_trace_and_its_delivery_may_be_sent_again(pools, client, bad):
    import json

    from operations.models import SeenDelivery

    _, spot_node, _, _ = pools
    url = "/api/v1/pools/spot/preemption-notices"
    good = {
        "delivery_id": "d-7",
        "node_id": str(spot_node.pk),
        "deadline": (timezone.now() + timedelta(seconds=30)).isoformat(),
    }

    def post(payload):
        raw = json.dumps(payload).encode()
        headers = {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in signed_headers("s3cret", raw, "d-7").items()
                   if k != "Content-Type"}  # fmt: skip
        return client.post(url, raw, content_type="application/json", **headers)

    refused = post({**good, **bad})
    assert 400 <= refused.status_code < 500 and refused.status_code != 403, refused.content
    assert not SeenDelivery.objects.exists() and not Preemption.objects.exists()
    assert post(good).status_code == 201


def test_a_preemption_that_cannot_be_followed_does_not_stop_the_others(monkeypatch, caplog):
    pool = PoolFactory(name="spot-sweep")
    now = timezone.now()
    stuck, other = (
        Preemption.objects.create(
            node=make_schedulable_node(pool)[0], pool=pool, source="agent", deadline=now, received_at=now
        )
        for _ in range(2)
    )
    follow, followed = preemption_service.follow, []

    def fails_for_the_stuck_one(*, preemption_id, **kwargs):
        if preemption_id == stuck.pk:
            raise RuntimeError("a deadlock victim")
        followed.append(preemption_id)
        return follow(preemption_id=preemption_id, **kwargs)

    monkeypatch.setattr(preemption_service, "follow", fails_for_the_stuck_one)
    preemption_service.sweep(actor=preemption_service.Actor.system("test"))
    assert followed == [other.pk]
    assert f"preemption {stuck.pk} could not be followed" in caplog.text
