"""Scheduled re-verification and deverification (fleet.reverification; issue 32 items 1 and 2)."""

import random
from datetime import timedelta

import pytest
from django.utils import timezone

from fleet import reverification
from fleet.choices import ReverificationState
from fleet.events import Actor
from fleet.models import Benchmark, Device, Node, NodeEvent, NodeResource, Reverification
from fleet.reverification import draw_due, reverification_start, reverify_due
from fleet.tasks import expire_benchmarks, reverify_due_nodes
from fleet.trust import UNVERIFIED_TAINT_KEY
from tests.device_support import gpus, make_gpu_node, report_devices
from tests.factories import make_schedulable_node
from tests.fleet_support import make_pool
from tests.heartbeat_support import beat, node_api
from tests.races import Hold, race
from tests.support import grant

pytestmark = pytest.mark.django_db
SWEEP = Actor.system("test:sweep")
HOUR = 3600
VERIFIED = {"cpu": 8000, "memory": 32 * 2**30}


def _pool(**fields):
    fields = {"reverification_period": HOUR, "reverification_window": 600, "reverification_tolerance_percent": 20,
              **fields}  # fmt: skip
    return make_pool(name=fields.pop("name", "rack"), **fields)


def _due_now(node) -> Reverification:
    """Schedule the node (if it has no open run) and bring its drawn due time to now."""
    reverification.reverifications_schedule(now=timezone.now())
    Reverification.objects.filter(node=node, state="scheduled").update(due_at=timezone.now() - timedelta(seconds=1))
    return Reverification.objects.get(node=node, state="scheduled")


def _answer(node, secret, *, cpu, memory):
    bench = Benchmark.objects.filter(node=node, status="requested").get()
    body = {"cpu_millicores": cpu, "memory_bytes": memory, "duration_seconds": 1.0, "details": {}}
    return node_api(secret).post(f"/api/v1/nodes/{node.pk}/benchmarks/{bench.nonce}", body, format="json"), bench


def _marked(node) -> bool:
    node.refresh_from_db()
    return any(t["key"] == UNVERIFIED_TAINT_KEY for t in node.taints)


# --- the schedule ---------------------------------------------------------------------------------


def test_each_check_falls_in_the_last_window_of_the_period_at_a_random_moment():
    pool = _pool(reverification_period=HOUR, reverification_window=600)
    anchor = timezone.now()
    rng = random.Random(5)
    offsets = [(draw_due(pool, anchor, rng=rng) - anchor).total_seconds() for _ in range(200)]
    assert all(HOUR - 600 <= offset <= HOUR for offset in offsets)
    assert max(offsets) - min(offsets) > 500  # spread over the window, not one fixed moment


def test_the_sweep_schedules_ready_nodes_of_pools_with_a_schedule_once():
    scheduled, _ = make_schedulable_node(_pool())
    unscheduled, _ = make_schedulable_node(make_pool(name="plain"))
    assert reverify_due(actor=SWEEP)["scheduled"] == 1
    assert reverify_due(actor=SWEEP)["scheduled"] == 0
    assert Reverification.objects.get().node == scheduled
    assert not Reverification.objects.filter(node=unscheduled).exists()


def test_the_due_time_is_never_told_to_the_node():
    node, secret = make_schedulable_node(_pool())
    reverify_due(actor=SWEEP)
    run = Reverification.objects.get(node=node)
    api = node_api(secret)
    answer = api.post(f"/api/v1/nodes/{node.pk}/heartbeats", beat(sequence=1), format="json").json()
    assert answer["instructions"]["run_benchmark"] is None
    assert run.due_at.isoformat()[:16] not in str(answer)
    assert api.get(f"/api/v1/nodes/{node.pk}/verification").status_code == 403
    assert api.get(f"/api/v1/nodes/{node.pk}").status_code == 403


def test_the_beat_task_runs_in_process_and_the_schedule_is_registered():
    from fleet.schedule import BEAT_SCHEDULE

    node, _ = make_schedulable_node(_pool())
    entry = BEAT_SCHEDULE["fleet-reverify-due-nodes"]
    assert entry["task"] == "fleet.reverify_due_nodes" and entry["options"]["expires"] < entry["schedule"]
    assert reverify_due_nodes.apply().get()["scheduled"] == 1
    assert Reverification.objects.filter(node=node, state="scheduled").exists()


# --- a run ----------------------------------------------------------------------------------------------


def test_an_idle_node_measuring_up_passes_and_is_scheduled_again():
    node, secret = make_schedulable_node(_pool())
    _due_now(node)
    assert reverify_due(actor=SWEEP)["started"] == 1
    run = Reverification.objects.get(node=node, state="running")
    assert (run.mode, run.expected) == ("full", VERIFIED)
    response, bench = _answer(node, secret, cpu=7000, memory=30 * 2**30)
    assert response.status_code == 200, response.json()
    assert bench.limits == {}
    run.refresh_from_db()
    assert (run.state, run.code) == ("passed", "passed") and run.evidence["ratios"]["cpu"] == 0.875
    assert not _marked(node)
    next_run = Reverification.objects.get(node=node, state="scheduled")
    assert timedelta(seconds=HOUR - 600) <= next_run.due_at - run.finished_at <= timedelta(seconds=HOUR)


def test_a_node_measuring_below_tolerance_is_deverified_with_the_evidence():
    node, secret = make_schedulable_node(_pool())
    _due_now(node)
    reverify_due(actor=SWEEP)
    _answer(node, secret, cpu=4000, memory=32 * 2**30)
    run = Reverification.objects.get(node=node, state="failed")
    assert run.code == "measured_below_verified" and "measured cpu 4 is 50%" in run.reason
    assert _marked(node)
    (condition,) = [c for c in node.conditions if c["type"] == "Unverified"]
    assert condition["status"] == "True" and condition["reason"] == "MeasuredBelowVerified"
    event = NodeEvent.objects.get(node=node, type="reverification", to_state="failed")
    assert event.data["ratios"] == {"cpu": 0.5, "memory": 1.0} and event.data["expected"] == VERIFIED


def test_a_busy_node_measures_only_what_is_free_and_its_leases_are_untouched(client_user):
    pool = _pool(name="general")
    node, secret = make_schedulable_node(pool)
    lease = grant(client_user, pool="general", cpu="6")
    assert lease.node_id == node.pk
    before = dict(NodeResource.objects.filter(node=node).values_list("name", "allocated"))
    _due_now(node)
    assert reverify_due(actor=SWEEP)["started"] == 1
    run = Reverification.objects.get(node=node, state="running")
    free = {"cpu": 2000, "memory": 32 * 2**30}
    assert (run.mode, run.expected) == ("free", free)
    response, bench = _answer(node, secret, cpu=1900, memory=31 * 2**30)
    assert response.status_code == 200 and bench.limits == free
    run.refresh_from_db()
    assert run.state == "passed"
    lease.refresh_from_db()
    assert lease.state in ("granted", "active")
    assert dict(NodeResource.objects.filter(node=node).values_list("name", "allocated")) == before
    node.refresh_from_db()
    assert node.measured == {}  # a partial measurement is the run's evidence, not the node's capability


def test_the_idle_policy_postpones_a_busy_node_without_starting(client_user):
    pool = _pool(name="general", reverification_busy_policy="idle")
    node, _ = make_schedulable_node(pool)
    grant(client_user, pool="general", cpu="1")
    run = _due_now(node)
    summary = reverify_due(actor=SWEEP)
    assert (summary["started"], summary["postponed"]) == (0, 1)
    run.refresh_from_db()
    assert run.state == "scheduled" and run.postponed == 1 and run.due_at > timezone.now()
    assert not Benchmark.objects.filter(node=node).exists()


def test_late_and_repeated_answers_get_the_benchmark_refusals():
    node, secret = make_schedulable_node(_pool())
    _due_now(node)
    reverify_due(actor=SWEEP)
    first, bench = _answer(node, secret, cpu=8000, memory=32 * 2**30)
    assert first.status_code == 200
    again = node_api(secret).post(
        f"/api/v1/nodes/{node.pk}/benchmarks/{bench.nonce}",
        {"cpu_millicores": 1, "memory_bytes": 1, "duration_seconds": 1.0, "details": {}},
        format="json",
    )
    assert (again.status_code, again.json()["code"]) == (409, "benchmark_already_completed")
    assert Reverification.objects.get(node=node, state="passed")  # the repeat changed nothing

    _due_now(node)
    reverify_due(actor=SWEEP)
    late = Benchmark.objects.get(node=node, status="requested")
    Benchmark.objects.filter(pk=late.pk).update(deadline=timezone.now() - timedelta(seconds=1))
    response, _ = _answer(node, secret, cpu=8000, memory=32 * 2**30)
    assert (response.status_code, response.json()["code"]) == (410, "benchmark_expired")


def test_no_answer_by_the_deadline_deverifies():
    node, _ = make_schedulable_node(_pool())
    _due_now(node)
    reverify_due(actor=SWEEP)
    Benchmark.objects.filter(node=node).update(deadline=timezone.now() - timedelta(seconds=1))
    assert expire_benchmarks.apply().get() == 1
    run = Reverification.objects.get(node=node, state="failed")
    assert run.code == "no_answer" and _marked(node)


def test_an_inventory_that_no_longer_matches_deverifies_at_once():
    node, _ = make_gpu_node(_pool(), count=2, tag="inv")
    report_devices(node, gpus(2, node="inv", model="NVIDIA A10"))
    _due_now(node)
    summary = reverify_due(actor=SWEEP)
    assert summary["failed"] == 1
    run = Reverification.objects.get(node=node, state="failed")
    assert run.code == "inventory_mismatch" and run.benchmark is None
    assert {d["field"] for d in run.evidence["inventory"]} == {"model"}
    node.refresh_from_db()
    assert [c["reason"] for c in node.conditions if c["type"] == "Unverified"] == ["InventoryMismatch"]


def test_devices_that_appeared_after_admission_are_verified_by_a_passing_run():
    node, secret = make_gpu_node(_pool(), count=2, tag="new", verified=False)
    Node.objects.filter(pk=node.pk).update(verified={"resources": {"cpu": 64000, "memory": 2**38}})
    assert not Device.objects.filter(node=node, verified_at__isnull=False).exists()
    _due_now(node)
    reverify_due(actor=SWEEP)
    _answer(node, secret, cpu=64000, memory=2**38)
    run = Reverification.objects.get(node=node, state="passed")
    assert len(run.evidence["verified_devices"]) == 2
    assert Device.objects.filter(node=node, verified_at__isnull=False).count() == 2
    assert NodeResource.objects.get(node=node, name="nvidia.com/gpu").allocatable == 2


def test_a_later_pass_lifts_the_mark_and_its_owner_reads_why_in_between(owner, owner_api, other_owner):
    node, secret = make_schedulable_node(_pool(), owner=owner)
    _due_now(node)
    reverify_due(actor=SWEEP)
    _answer(node, secret, cpu=8000, memory=10 * 2**30)
    seen = owner_api.get(f"/api/v1/nodes/{node.pk}/verification").json()
    assert (seen["state"], seen["code"], seen["verified"]) == ("unverified", "measured_below_verified", False)
    assert seen["evidence"]["ratios"]["memory"] < 0.8 and seen["next_steps"]
    assert [h["state"] for h in seen["history"]] == ["failed"]
    assert "due" not in " ".join(seen) and seen["schedule"] == "on"

    _due_now(node)
    reverify_due(actor=SWEEP)
    _answer(node, secret, cpu=8000, memory=32 * 2**30)
    assert not _marked(node)
    seen = owner_api.get(f"/api/v1/nodes/{node.pk}/verification").json()
    assert (seen["state"], seen["code"]) == ("verified", None)
    assert [h["state"] for h in seen["history"]] == ["passed", "failed"]
    from rest_framework.test import APIClient

    stranger = APIClient()
    stranger.force_authenticate(other_owner)
    assert stranger.get(f"/api/v1/nodes/{node.pk}/verification").status_code == 404


def test_runs_of_nodes_that_left_service_are_cancelled():
    node, _ = make_schedulable_node(_pool())
    reverify_due(actor=SWEEP)
    Node.objects.filter(pk=node.pk).update(lifecycle="maintenance")
    assert reverify_due(actor=SWEEP)["cancelled"] == 1
    assert Reverification.objects.get(node=node).code == "node_left_service"


# --- the race ----------------------------------------------------------------------------------------


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_sweeps_picking_the_same_due_node_start_one_run():
    node, _ = make_schedulable_node(_pool())
    run = _due_now(node)
    with Hold("fleet.reverification.measurement_plan", parties=2) as hold:
        outcome = race(lambda i: reverification_start(run_id=run.pk, actor=SWEEP), 2)
    assert not outcome.errors, outcome.errors
    assert sorted(outcome.results) == ["not_due", "started"]
    assert hold.max_inside == 1
    assert Benchmark.objects.filter(node=node).count() == 1
    assert Reverification.objects.filter(node=node, state=ReverificationState.RUNNING).count() == 1
    assert NodeEvent.objects.filter(node=node, type="reverification").count() == 1


def test_operators_read_the_checks_in_the_admin_and_owners_do_not(admin_client, owner):
    from django.test import Client

    node, _ = make_schedulable_node(_pool(), owner=owner)
    reverify_due(actor=SWEEP)
    page = admin_client.get("/admin/fleet/reverification/")
    assert page.status_code == 200 and node.hostname in page.content.decode()
    owner.is_staff = True
    owner.save()
    browser = Client()
    browser.force_login(owner)
    assert browser.get("/admin/fleet/reverification/").status_code == 403


def test_metrics_count_the_deverified_nodes_per_pool(client, django_capture_on_commit_callbacks):
    from fleet import fleet_state
    from tests.metrics_support import scrape, value

    node, secret = make_schedulable_node(_pool())
    make_schedulable_node(_pool(name="other"))
    _due_now(node)
    reverify_due(actor=SWEEP)
    with django_capture_on_commit_callbacks(execute=True):
        _answer(node, secret, cpu=1000, memory=32 * 2**30)
    fleet_state.refresh()
    text = scrape(client)
    assert value(text, "nodepool_nodes_unverified", pool="rack") == 1
    assert value(text, "nodepool_nodes_unverified", pool="other") == 0
    assert value(text, "nodepool_node_reverifications_total", pool="rack", outcome="failed") >= 1


def test_attestation_that_no_longer_verifies_with_the_pools_key_deverifies():
    from fleet.models import Pool
    from tests.fleet_support import Signer

    old, new = Signer(), Signer()
    pool = _pool(attestation_required=True, attestation_public_key=old.public_pem)
    node, _ = make_schedulable_node(pool)
    Node.objects.filter(pk=node.pk).update(attestation=old.attest({"hostname": node.hostname, "pool": "rack"}))
    Pool.objects.filter(pk=pool.pk).update(attestation_public_key=new.public_pem)  # the pool rotated its key
    _due_now(node)
    assert reverify_due(actor=SWEEP)["failed"] == 1
    run = Reverification.objects.get(node=node, state="failed")
    assert run.code == "attestation_failed" and "does not verify" in run.reason
    assert _marked(node) and run.benchmark is None


def test_a_fresh_admission_lifts_the_mark():
    from fleet.admission import finalize_admission
    from fleet.models import AdmissionCheck
    from tests.factories import set_lifecycle

    node, secret = make_schedulable_node(_pool())
    _due_now(node)
    reverify_due(actor=SWEEP)
    _answer(node, secret, cpu=1000, memory=32 * 2**30)
    assert _marked(node)
    set_lifecycle(node, "admitting")
    Node.objects.filter(pk=node.pk).update(admission_attempt=2)
    AdmissionCheck.objects.create(node=node, attempt=2, name="agent_version", status="passed")
    assert finalize_admission(node_id=node.pk, attempt=2, actor=SWEEP) == "ready"
    assert not _marked(node)
    assert [c["status"] for c in node.conditions if c["type"] == "Unverified"] == ["False"]


def test_a_condition_lost_to_a_racing_status_report_is_put_back_by_the_sweep():
    node, secret = make_schedulable_node(_pool())
    _due_now(node)
    reverify_due(actor=SWEEP)
    _answer(node, secret, cpu=1000, memory=32 * 2**30)
    # A report read before the deverification and applied after it: its conditions lack Unverified.
    Node.objects.filter(pk=node.pk).update(conditions=[])
    assert reverify_due(actor=SWEEP)["repaired"] == 1
    node.refresh_from_db()
    (condition,) = [c for c in node.conditions if c["type"] == "Unverified"]
    assert (condition["status"], condition["reason"]) == ("True", "MeasuredBelowVerified")
    assert "measured cpu" in condition["message"]
    assert reverify_due(actor=SWEEP)["repaired"] == 0
