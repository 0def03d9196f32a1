"""The queue kick never drops the last trigger of a burst (found by CI's autoscaling run: three
machines turned schedulable within one second, the second and third kicks were dropped by the
one-a-second limit, and two queued requests waited for beat's next pass)."""

from __future__ import annotations

import pytest
from django.core.cache import cache

from leases import kick
from leases.models import LeaseRequest
from tests.factories import PoolFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def sent(monkeypatch):
    calls = []

    def apply_async(args=None, kwargs=None, *, retry=True, **options):
        assert retry is False  # sent once from a request path (nodepool.failsafe.publish)
        calls.append(options)

    monkeypatch.setattr("leases.tasks.place_pending_requests.apply_async", apply_async)
    cache.delete_many(["leases:queue-kick", "leases:queue-kick-trailing"])
    return calls


def test_a_burst_of_kicks_places_at_once_and_once_more_after_the_window(sent, client_user):
    LeaseRequest.objects.create(workload_id="job-1", pool=PoolFactory(), client=client_user, spec={})
    for _ in range(5):
        kick.kick_queue()
    assert sent == [{}, {"countdown": kick.KICK_WINDOW}]


def test_no_pending_request_no_placement(sent):
    kick.kick_queue()
    assert sent == []


def test_a_status_report_that_makes_a_node_ready_places_queued_work(
    sent, client_user, django_capture_on_commit_callbacks
):
    """A status report is one conditional UPDATE (no post_save): a node admitted while it still
    reported not-ready became ready by report only, and nothing kicked the queue."""
    from fleet.models import Node
    from tests.factories import make_schedulable_node
    from tests.heartbeat_support import beat
    from tests.support import node_api

    node, secret = make_schedulable_node()
    Node.objects.filter(pk=node.pk).update(ready=False)
    LeaseRequest.objects.create(workload_id="job-1", pool=node.pool, client=client_user, spec={})
    with django_capture_on_commit_callbacks(execute=True):
        response = node_api(secret).post(f"/api/v1/nodes/{node.pk}/heartbeats", beat(sequence=1), format="json")
    assert response.status_code == 200, response.content
    assert Node.objects.get(pk=node.pk).ready
    assert sent == [{}]


def test_a_renewal_that_revives_a_stale_node_places_queued_work(sent, client_user, django_capture_on_commit_callbacks):
    from fleet.choices import Liveness
    from fleet.models import Node
    from tests.factories import make_schedulable_node
    from tests.support import node_api

    node, secret = make_schedulable_node()
    Node.objects.filter(pk=node.pk).update(liveness=Liveness.STALE)
    LeaseRequest.objects.create(workload_id="job-1", pool=node.pool, client=client_user, spec={})
    with django_capture_on_commit_callbacks(execute=True):
        response = node_api(secret).post(
            f"/api/v1/nodes/{node.pk}/renewals", {"incarnation": node.incarnation, "sequence": 1}, format="json"
        )
    assert response.status_code == 200 and response.json()["applied"] is True, response.content
    assert Node.objects.get(pk=node.pk).liveness == Liveness.ALIVE
    assert sent == [{}]
