"""The admin fleet overview: what it shows per pool, who may open it, and that the index links it."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User

from fleet import event_types as fleet_events
from fleet.events import Actor, record_event
from fleet.fleet_state import refresh as refresh_fleet_state
from fleet.models import LivenessSweepState, NodeResource
from leases.models import LeaseRequest
from leases.overview import fleet_overview
from leases.preview import refresh_request_class_fits
from tests.factories import NodeFactory, PoolFactory, make_schedulable_node

GiB = 2**30
pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet():
    gpu = PoolFactory(name="gpu", request_classes=[{"name": "two-cores", "resources": {"cpu": 2000}}])
    busy, _ = make_schedulable_node(gpu, hostname="busy", resources={"cpu": 8000, "memory": 32 * GiB})
    NodeResource.objects.filter(node=busy, name="cpu").update(allocated=6000)
    make_schedulable_node(gpu, hostname="idle", resources={"cpu": 8000, "memory": 32 * GiB})
    NodeFactory(pool=gpu, hostname="newcomer")
    PoolFactory(name="empty")
    LeaseRequest.objects.create(workload_id="w", pool=gpu, spec={})
    LivenessSweepState.objects.update_or_create(
        pk=1, defaults={"guarded_groups": {"gpu/eu-1": {"scope": "zone", "silent": 4, "total": 5, "fraction": 0.8}}}
    )
    record_event(
        busy, fleet_events.LIVENESS, Actor.system("fleet.sweep_liveness"), from_state="alive", to_state="stale"
    )
    refresh_request_class_fits()
    return gpu


def test_the_overview_summarises_each_pool(fleet):
    empty, gpu = fleet_overview()
    assert (empty["pool"].name, gpu["pool"].name) == ("empty", "gpu")
    assert (gpu["total"], gpu["schedulable"], gpu["ready"], gpu["in_service"]) == (3, 2, 2, 2)
    assert gpu["lifecycle"] == {"pending": 1, "ready": 2}
    assert gpu["capacity"][0] == {
        "resource": "cpu", "allocatable": 16000, "allocated": 6000, "percent": 37.5, "label": "6 of 16",
    }  # fmt: skip
    assert gpu["request_classes"] == [{"name": "two-cores", "fits": 5}]
    assert gpu["request_classes_at"] is not None
    assert gpu["pending"] == 1
    assert gpu["guards"] == [{"scope": "zone", "silent": 4, "total": 5, "fraction": 0.8, "zone": "eu-1"}]
    assert [e.to_state for e in gpu["events"]] == ["stale"]
    assert empty["total"] == 0 and empty["guards"] == [] and empty["capacity"] == []


def test_operators_open_the_page_from_the_admin_index(client, operator, fleet):
    operator.is_staff = True
    operator.save()
    client.force_login(operator)
    index = client.get("/admin/")
    assert b'href="/admin/fleet-overview/"' in index.content
    page = client.get("/admin/fleet-overview/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "Pool gpu" in text and "can serve two-cores: <strong>5</strong>" in text
    assert "Mass-silence guard engaged (zone eu-1: 4 of 5 silent)" in text


def test_owners_may_not_open_the_fleet_overview(client, owner, fleet):
    owner.is_staff = True
    owner.save()
    client.force_login(owner)
    assert client.get("/admin/fleet-overview/").status_code == 403


def test_anonymous_users_are_sent_to_the_login_page(client, fleet):
    response = client.get("/admin/fleet-overview/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert User.objects.count() == 0


def test_request_classes_not_yet_evaluated_say_so(client, operator):
    PoolFactory(name="fresh", request_classes=[{"name": "tiny", "resources": {"cpu": 100}}])
    (entry,) = fleet_overview()
    assert entry["request_classes"] == [{"name": "tiny", "fits": None}] and entry["request_classes_at"] is None


def test_each_pool_shows_its_own_last_events_newest_first(django_assert_max_num_queries):
    pools = [PoolFactory(name=name) for name in ("a", "b", "c")]
    for pool in pools:
        node = NodeFactory(pool=pool, hostname=f"{pool.name}-node")
        for i in range(7):
            record_event(node, fleet_events.LIVENESS, Actor.system("test"), from_state=str(i), to_state=str(i + 1))
    refresh_fleet_state()
    with django_assert_max_num_queries(5):  # as many with three pools as with one: events in one query
        entries = fleet_overview(events_per_pool=3)
    for pool, entry in zip(pools, entries, strict=True):
        assert [(e.pool_id, e.to_state) for e in entry["events"]] == [(pool.pk, "7"), (pool.pk, "6"), (pool.pk, "5")]
        assert str(entry["events"][0].node) == f"{pool.name}-node"
