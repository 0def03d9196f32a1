"""Admin pages, Celery tasks, beat entries and the queue trigger on a node turning schedulable."""

from __future__ import annotations

import pytest
from django.core.cache import cache

from fleet.choices import Liveness
from fleet.events import Actor
from fleet.models import Node
from leases import tasks
from leases.models import Lease, LeaseRequest, Shape
from leases.schedule import BEAT_SCHEDULE
from leases.services import lease_create
from tests.factories import PoolFactory, make_schedulable_node

pytestmark = pytest.mark.django_db


def test_admin_pages_for_leases_shapes_and_requests_load(admin_client, client_user):
    node, _ = make_schedulable_node(PoolFactory(name="general"))
    lease, _ = lease_create(
        data={"workload_id": "j", "pool": "general", "resources": {"cpu": "1"}},
        client=client_user,
        actor=Actor.system("t"),
    )
    Shape.objects.create(name="large", version=1, resources={"cpu": 8000})
    for url in (
        "/admin/leases/lease/",
        f"/admin/leases/lease/{lease.pk}/change/",
        "/admin/leases/shape/",
        "/admin/leases/shape/add/",
        "/admin/leases/leaserequest/",
        "/admin/leases/fencingsequence/",
        "/admin/leases/consistencyreport/",
    ):
        assert admin_client.get(url).status_code == 200, url


def test_editing_a_shape_in_the_admin_publishes_a_new_version(admin_client):
    shape = Shape.objects.create(name="large", version=1, resources={"cpu": 8000})
    response = admin_client.post(
        f"/admin/leases/shape/{shape.pk}/change/",
        {"name": "large", "resources": '{"cpu": 16000}', "features": "{}", "description": ""},
    )
    assert response.status_code == 302
    assert list(Shape.objects.filter(name="large").values_list("version", "resources")) == [
        (2, {"cpu": 16000}),
        (1, {"cpu": 8000}),
    ]


def test_admin_revoke_action_returns_capacity(admin_client, client_user):
    node, _ = make_schedulable_node(PoolFactory(name="general"))
    lease, _ = lease_create(
        data={"workload_id": "j", "pool": "general", "resources": {"cpu": "1"}},
        client=client_user,
        actor=Actor.system("t"),
    )
    admin_client.post("/admin/leases/lease/", {"action": "revoke", "_selected_action": [str(lease.pk)]})
    assert Lease.objects.get(pk=lease.pk).state == "revoked"
    assert node.resources.get(name="cpu").allocated == 0


def test_beat_entries_name_real_tasks_and_expire_before_their_period():
    from nodepool.celery import app

    for entry in BEAT_SCHEDULE.values():
        assert entry["task"] in app.tasks
        assert entry["options"]["expires"] < entry["schedule"]


def test_tasks_run_the_sweeps(client_user):
    make_schedulable_node(PoolFactory(name="general"))
    assert tasks.expire_leases.delay().get() == 0
    assert tasks.place_pending_requests.delay().get() == {"placed": 0, "pending": 0}
    assert tasks.check_consistency.delay().get() == 0


def test_a_node_turning_schedulable_places_a_waiting_request(client_api, django_capture_on_commit_callbacks):
    cache.clear()
    pool = PoolFactory(name="general")
    node, _ = make_schedulable_node(pool)
    Node.objects.filter(pk=node.pk).update(liveness=Liveness.STALE)
    body = {"workload_id": "waiting", "pool": "general", "resources": {"cpu": "1"}, "queue": True}
    waiting = client_api.post("/api/v1/node-leases", body, format="json").json()
    assert waiting["reasons"] == {"not_alive": 1}
    node.refresh_from_db()
    node.liveness = Liveness.ALIVE
    with django_capture_on_commit_callbacks(execute=True):
        node.save(update_fields=["liveness"])
    assert LeaseRequest.objects.get(pk=waiting["id"]).state == "placed"
