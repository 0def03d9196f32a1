"""The benchmarks' raw-SQL baseline views: absent unless NODEPOOL_BENCH is on, loopback clients only."""

import importlib
import json
import uuid
from datetime import timedelta

import pytest
from django.test import override_settings
from django.urls import NoReverseMatch, clear_url_caches, reverse

import nodepool.urls
from fleet.models import Node, NodeResource
from leases.models import Lease
from leases.sweeps import check_consistency
from nodepool.bench_views import is_loopback
from tests.factories import NodeFactory, set_capacity

pytestmark = pytest.mark.django_db


@pytest.fixture
def bench_urls(settings):
    """The URLconf as a bench server builds it (NODEPOOL_BENCH=1, DEBUG off), restored afterwards."""
    settings.NODEPOOL_BENCH, settings.DEBUG = True, False
    importlib.reload(nodepool.urls)
    clear_url_caches()
    yield
    settings.NODEPOOL_BENCH = False
    importlib.reload(nodepool.urls)
    clear_url_caches()


def test_the_bench_views_are_absent_by_default(settings, client):
    assert settings.NODEPOOL_BENCH is False
    with pytest.raises(NoReverseMatch):
        reverse("bench-one-update", args=[uuid.uuid4()])
    with pytest.raises(NoReverseMatch):
        reverse("bench-one-grant")
    response = client.post(f"/bench/one-update/{uuid.uuid4()}", "{}", content_type="application/json")
    assert response.status_code == 404
    response = client.post("/bench/one-grant", "{}", content_type="application/json")
    assert response.status_code == 404


@override_settings(DEBUG=True)
def test_debug_alone_does_not_mount_it(client):
    importlib.reload(nodepool.urls)
    clear_url_caches()
    try:
        response = client.post(f"/bench/one-update/{uuid.uuid4()}", "{}", content_type="application/json")
        assert response.status_code == 404
        response = client.post("/bench/one-grant", "{}", content_type="application/json")
        assert response.status_code == 404
    finally:
        importlib.reload(nodepool.urls)
        clear_url_caches()


def test_with_the_bench_setting_it_serves_loopback_clients_only(bench_urls, client):
    node = NodeFactory()
    url = reverse("bench-one-update", args=[node.pk])

    refused = client.post(url, '{"sequence": 7}', content_type="application/json", REMOTE_ADDR="10.0.0.5")
    assert refused.status_code == 404
    assert Node.objects.get(pk=node.pk).sequence == -1, "a refused request writes nothing"

    served = client.post(url, '{"sequence": 7}', content_type="application/json", REMOTE_ADDR="127.0.0.1")
    assert served.status_code == 200
    assert Node.objects.get(pk=node.pk).sequence == 7


def _cpu_row(capacity: int = 1000, reserved: int = 0) -> NodeResource:
    node = NodeFactory(incarnation=3)
    set_capacity(node, {"cpu": capacity, "memory": 2**30}, reserved={"cpu": reserved})
    return NodeResource.objects.get(node=node, name="cpu")


def test_the_grant_baseline_reserves_capacity_and_writes_one_lease(bench_urls, client):
    row = _cpu_row()
    url = reverse("bench-one-grant")
    body = {"workload_id": "w-1", "resource": row.pk, "amount": 10}

    response = client.post(url, json.dumps(body), content_type="application/json", REMOTE_ADDR="127.0.0.1")

    assert response.status_code == 201
    lease = Lease.objects.get()
    assert response.json() == {"lease_id": str(lease.pk), "node_id": str(row.node_id)}
    assert (lease.workload_id, lease.state, lease.fencing_token) == ("w-1", "granted", 1)
    assert (lease.node_id, lease.pool_id, lease.node_incarnation) == (row.node_id, row.node.pool_id, 3)
    assert lease.resources == {"cpu": 10}
    assert lease.spec == body
    assert lease.expires_at - lease.granted_at == timedelta(seconds=600)
    row.refresh_from_db()
    assert row.allocated == 10
    assert NodeResource.objects.get(node=row.node, name="memory").allocated == 0
    assert check_consistency().drift == [], "the counter equals the live lease, as after a real grant"


def test_the_grant_baseline_refuses_what_does_not_fit_and_writes_nothing(bench_urls, client):
    row = _cpu_row(capacity=100, reserved=80)  # allocatable 20
    url = reverse("bench-one-grant")

    def grant(workload_id, amount):
        body = json.dumps({"workload_id": workload_id, "resource": row.pk, "amount": amount})
        return client.post(url, body, content_type="application/json", REMOTE_ADDR="127.0.0.1")

    assert grant("a", 15).status_code == 201
    refused = grant("b", 10)
    assert refused.status_code == 409
    assert refused.json() == {"granted": False}
    assert list(Lease.objects.values_list("workload_id", flat=True)) == ["a"]
    row.refresh_from_db()
    assert row.allocated == 15
    assert grant("c", 5).status_code == 201


def test_the_grant_baseline_serves_loopback_clients_only_and_checks_its_body(bench_urls, client):
    row = _cpu_row()
    url = reverse("bench-one-grant")
    body = json.dumps({"workload_id": "w", "resource": row.pk, "amount": 10})

    refused = client.post(url, body, content_type="application/json", REMOTE_ADDR="10.0.0.5")
    assert refused.status_code == 404
    for bad in ("not json", "{}", '{"workload_id": "w", "resource": "x", "amount": 1}'):
        assert client.post(url, bad, content_type="application/json", REMOTE_ADDR="127.0.0.1").status_code == 400
    assert not Lease.objects.exists()
    row.refresh_from_db()
    assert row.allocated == 0


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("10.0.0.5", False), ("", False), ("nope", False)],
)
def test_loopback_means_127_0_0_0_8_and_ipv6_1(address, loopback):
    assert is_loopback(address) is loopback
