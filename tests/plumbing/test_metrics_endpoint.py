"""/metrics: fleet state and counters after a scripted scenario, the scrape token, bounded labels,
the scrape cache, and counters summed over processes (multiprocess mode)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from fleet.choices import Liveness
from fleet.events import Actor
from fleet.fleet_state import refresh as refresh_fleet_state
from fleet.models import LivenessSweepState, Node, NodeResource
from leases.models import Lease, LeaseRequest
from leases.preview import refresh_request_class_fits
from leases.reconcile import revoke_lease
from maintenance.choices import QuarantineRule
from maintenance.models import Drain, Quarantine
from nodepool.metrics import FLEET_STATE
from tests.factories import NodeFactory, PoolFactory, make_schedulable_node
from tests.metrics_support import samples, scrape, value

GiB = 2**30
ROOT = Path(__file__).resolve().parents[2]
UUID = re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}")
pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet():
    """general: schedulable 6-core and 4-core nodes, an 8-core one ready but unreachable, one pending."""
    pool = PoolFactory(
        name="general", ready_ratio_objective=0.995, request_classes=[{"name": "two-cores", "resources": {"cpu": 2000}}]
    )
    a, _ = make_schedulable_node(pool, hostname="a", resources={"cpu": 6000, "memory": 32 * GiB})
    b, _ = make_schedulable_node(pool, hostname="b", resources={"cpu": 4000, "memory": 32 * GiB})
    silent, _ = make_schedulable_node(pool, hostname="silent")
    Node.objects.filter(pk=silent.pk).update(liveness=Liveness.UNREACHABLE)
    NodeFactory(pool=pool, hostname="newcomer")
    return pool, a, b, silent


def test_metrics_after_a_scripted_scenario(client, client_api, fleet, django_capture_on_commit_callbacks):
    pool, a, b, silent = fleet
    before = samples(scrape(client))
    with django_capture_on_commit_callbacks(execute=True):
        granted = client_api.post(
            "/api/v1/node-leases", {"workload_id": "job-1", "pool": "general", "resources": {"cpu": "2"}}
        )
        refused = client_api.post(
            "/api/v1/node-leases", {"workload_id": "job-2", "pool": "general", "resources": {"cpu": "64"}}
        )
        queued = client_api.post(
            "/api/v1/node-leases", {"workload_id": "job-3", "pool": "general", "resources": {"cpu": "7"}, "queue": True}
        )
    assert (granted.status_code, refused.status_code, queued.status_code) == (201, 409, 202)
    LeaseRequest.objects.filter(pk=queued.json()["id"]).update(created_at=timezone.now() - timedelta(seconds=90))
    Node.objects.filter(pk=a.pk).update(
        clock_skew_seconds=-120.0,
        restart_count=3,
        measured={"resources": {"cpu": 4000}},
        usage={"cpu": 7000, "memory": GiB},
    )
    Drain.objects.create(node=b, reason="kernel", deadline=timezone.now() + timedelta(hours=1))
    Quarantine.objects.create(node=silent, reason="flapping", from_state="ready", actor_type="system")
    Quarantine.objects.create(
        node=a, reason="bad disk", from_state="ready", actor_type="system", released_at=timezone.now()
    )  # released: not counted
    LivenessSweepState.objects.update_or_create(
        pk=1,
        defaults={"last_run_at": timezone.now(), "guarded_groups": {"general/eu-1": {"scope": "zone", "silent": 3}}},
    )

    refresh_request_class_fits()  # the beat task behind "can serve N now"
    refresh_fleet_state()  # the beat task behind node counts, capacity, usage and drift
    after = samples(scrape(client))
    gen = {"pool": "general"}
    assert value(after, "nodepool_nodes", lifecycle="ready", liveness="alive", health="healthy", **gen) == 2
    assert value(after, "nodepool_nodes", lifecycle="ready", liveness="unreachable", health="healthy", **gen) == 1
    assert value(after, "nodepool_nodes", lifecycle="pending", liveness="unknown", health="unknown", **gen) == 1
    assert value(after, "nodepool_nodes_schedulable", **gen) == 2
    assert value(after, "nodepool_nodes_in_service", **gen) == 3
    assert value(after, "nodepool_nodes_ready", **gen) == 2
    assert value(after, "nodepool_pool_ready_ratio_objective", **gen) == 0.995
    assert value(after, "nodepool_pool_allocatable", resource="cpu", unit="core", **gen) == 18
    assert value(after, "nodepool_pool_allocated", resource="cpu", unit="core", **gen) == 2
    assert value(after, "nodepool_pool_allocatable", resource="memory", unit="byte", **gen) == 96 * GiB
    assert value(after, "nodepool_pool_used", resource="cpu", unit="core", **gen) == 7
    assert value(after, "nodepool_leases", state="granted", **gen) == 1
    assert value(after, "nodepool_lease_requests_pending", **gen) == 1
    assert value(after, "nodepool_lease_request_oldest_pending_age_seconds", **gen) >= 90
    # Binpack put job-1 on the 4-core node: 2 free cores there and 6 on the other, 1 + 3 two-core leases.
    assert Lease.objects.get(workload_id="job-1").node_id == b.pk
    assert value(after, "nodepool_pool_request_class_fits", request_class="two-cores", **gen) == 4
    assert value(after, "nodepool_nodes_clock_skewed", **gen) == 1
    assert value(after, "nodepool_node_restarts_total", **gen) == 3
    assert value(after, "nodepool_nodes_capability_drift", **gen) == 1  # measured 4 of 8 declared cores
    assert value(after, "nodepool_nodes_usage_inconsistent", **gen) == 1  # 7 cores used, none leased
    assert value(after, "nodepool_drains_active", **gen) == 1
    assert value(after, "nodepool_quarantines_active", rule=QuarantineRule.MANUAL, **gen) == 1
    assert value(after, "nodepool_mass_silence_guard_engaged", pool="general", scope="zone", zone="eu-1") == 1
    assert value(after, "nodepool_liveness_sweep_last_run_timestamp_seconds") == pytest.approx(
        timezone.now().timestamp(), abs=60
    )

    def delta(name, **labels):
        return (value(after, name, **labels) or 0) - (value(before, name, **labels) or 0)

    assert delta("nodepool_lease_grants_total", **gen) == 1
    assert delta("nodepool_lease_grant_duration_seconds_count", **gen) == 1
    assert delta("nodepool_lease_pending_duration_seconds_count", **gen) == 1
    assert delta("nodepool_placement_failures_total", reason="insufficient_cpu", **gen) == 2  # job-2 and job-3
    assert delta("nodepool_placement_failures_total", reason="not_alive", **gen) == 2
    assert delta("nodepool_placement_failures_total", reason="lifecycle_not_ready", **gen) == 2

    lease = Lease.objects.get(workload_id="job-1")
    with django_capture_on_commit_callbacks(execute=True):
        revoke_lease(lease, actor=Actor.system("test"), reason="node quarantined: stolen credential")
    refresh_fleet_state()
    final = samples(scrape(client))
    cause = {"state": "revoked", "cause": "quarantine", **gen}
    assert (value(final, "nodepool_lease_endings_total", **cause) or 0) - (
        value(before, "nodepool_lease_endings_total", **cause) or 0
    ) == 1
    assert value(final, "nodepool_pool_allocated", resource="cpu", unit="core", **gen) == 0


def test_no_label_carries_a_node_lease_or_workload_id(client, client_api, fleet):
    client_api.post("/api/v1/node-leases", {"workload_id": "job-1", "pool": "general", "resources": {"cpu": "1"}})
    for (_, labels), _ in samples(scrape(client)).items():
        for key, label_value in labels:
            assert not UUID.search(label_value), (key, label_value)
            assert label_value != "job-1"


def test_resource_names_beyond_the_cap_add_up_under_other(client, fleet):
    pool, a, _, _ = fleet
    for i in range(40):
        NodeResource.objects.create(node=a, name=f"example.com/r{i:02d}", capacity=1, allocatable=1)
    text = scrape(client)
    resources = {dict(labels)["resource"] for (name, labels) in samples(text) if name == "nodepool_pool_allocatable"}
    assert len(resources) <= 33 and "other" in resources


def test_metrics_need_the_scrape_token(client, settings):
    anonymous = client.get("/metrics")
    assert anonymous.status_code == 401
    assert anonymous["Content-Type"].startswith("application/problem+json")
    assert anonymous.json()["code"] == "metrics_token_required"
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Token {settings.METRICS_TOKEN}").status_code == 401
    assert client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {settings.METRICS_TOKEN}").status_code == 405


def test_scrapes_within_the_cache_window_do_not_query_the_database(client, fleet, settings, django_assert_num_queries):
    settings.NODEPOOL = {**settings.NODEPOOL, "METRICS_CACHE_SECONDS": 60}
    scrape(client)
    with django_assert_num_queries(0):
        response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {settings.METRICS_TOKEN}")
    assert response.status_code == 200
    FLEET_STATE.invalidate()


def test_a_failing_collector_is_reported_and_the_rest_still_answers(client, fleet, monkeypatch):
    from nodepool import metrics

    def broken():
        raise RuntimeError("boom")

    monkeypatch.setitem(metrics._collectors, "broken", broken)
    text = scrape(client)
    assert value(text, "nodepool_metrics_collector_up", collector="broken") == 0
    assert value(text, "nodepool_metrics_collector_up", collector="fleet") == 1
    assert value(text, "nodepool_nodes_schedulable", pool="general") == 2


CHILD = """
import json, os, sys, django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nodepool.settings")
django.setup()
from nodepool import metrics
if sys.argv[1] == "grant":
    for _ in range(int(sys.argv[2])):
        metrics.LEASE_GRANTS.labels("general").inc()
else:
    text = metrics.exposition().decode()
    print(json.dumps([l for l in text.splitlines() if l.startswith('nodepool_lease_grants_total{pool="general"}')]))
"""


def test_counters_from_several_processes_add_up_in_multiprocess_mode(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    for n in ("2", "3"):
        subprocess.run([sys.executable, "-c", CHILD, "grant", n], env=env, cwd=ROOT, check=True, timeout=120)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "read"],
        env=env,
        cwd=ROOT,
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    )
    lines = json.loads(out.stdout.strip().splitlines()[-1])
    assert lines == ['nodepool_lease_grants_total{pool="general"} 5.0']
