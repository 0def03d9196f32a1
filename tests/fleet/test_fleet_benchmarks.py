from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone

from fleet import admission
from fleet import event_types as fleet_events
from fleet.choices import BenchmarkStatus, CheckStatus, Lifecycle, PoolKind
from fleet.events import Actor
from fleet.models import AdmissionCheck, Benchmark, Node, NodeEvent
from fleet.selectors import pending_benchmark
from fleet.services import node_admit
from fleet.tasks import expire_benchmarks
from tests.fleet_support import enroll, fresh_throttles, make_pool, make_token, node_api  # noqa: F401

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fresh_throttles")]
FIGURES = {"cpu_millicores": 7900, "memory_bytes": 33 * 2**30, "duration_seconds": 3.2, "details": {"tool": "x"}}


@pytest.fixture
def benchmarked(anon_api, django_capture_on_commit_callbacks):
    """An enrolled node in a benchmark-requiring pool, admitted and waiting for its benchmark."""

    def make(kind=PoolKind.STANDARD, owner=None):
        pool = make_pool(benchmark_required=True, benchmark_tolerance=0.8, kind=kind)
        token = make_token(pool, owner=owner)
        body = enroll(anon_api, token).json()
        node = Node.objects.get(pk=body["node_id"])
        with django_capture_on_commit_callbacks(execute=True):
            node_admit(node_id=node.pk, expected_version=node.version, actor=Actor.system("test"))
        node.refresh_from_db()
        return node, node_api(body["credential"])

    return make


def _post(api, node, nonce, body=None):
    return api.post(f"/api/v1/nodes/{node.pk}/benchmarks/{nonce}", body or FIGURES, format="json")


def test_admission_waits_for_the_benchmark_and_tells_the_heartbeat(benchmarked):
    node, _ = benchmarked()
    assert node.lifecycle == Lifecycle.ADMITTING
    bench = pending_benchmark(node)
    assert bench is not None and bench.status == BenchmarkStatus.REQUESTED
    assert bench.deadline == bench.requested_at + timedelta(seconds=300)
    check = AdmissionCheck.objects.get(node=node, name="benchmark")
    assert check.status == CheckStatus.PENDING and check.data["nonce"] == bench.nonce
    assert NodeEvent.objects.filter(node=node, type=fleet_events.BENCHMARK).count() == 1


def test_a_second_run_requests_no_second_benchmark(benchmarked):
    node, _ = benchmarked()
    assert admission.run_admission(node_id=node.pk, attempt=1, actor=Actor.system("t")) == "waiting_benchmark"
    assert Benchmark.objects.filter(node=node).count() == 1


def test_figures_within_tolerance_make_the_node_ready(benchmarked, django_capture_on_commit_callbacks):
    node, api = benchmarked()
    nonce = pending_benchmark(node).nonce
    with django_capture_on_commit_callbacks(execute=True):
        response = _post(api, node, nonce)
    assert response.status_code == 200, response.json()
    assert response.json()["status"] == "completed"
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.READY
    assert node.measured["resources"] == {"cpu": 7900, "memory": 33 * 2**30}
    assert node.verified["resources"]["cpu"] == 8000
    assert AdmissionCheck.objects.get(node=node, name="benchmark").status == CheckStatus.PASSED
    assert pending_benchmark(node) is None


def test_a_large_shortfall_on_a_marketplace_pool_is_suspected_misreported_hardware(
    benchmarked, owner, django_capture_on_commit_callbacks
):
    node, api = benchmarked(kind=PoolKind.MARKETPLACE, owner=owner)
    nonce = pending_benchmark(node).nonce
    with django_capture_on_commit_callbacks(execute=True):
        _post(api, node, nonce, {**FIGURES, "cpu_millicores": 2000})
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.REJECTED
    assert "suspected misreported hardware" in node.lifecycle_reason
    assert "measured cpu 2 is 25% of declared 8" in node.lifecycle_reason


def test_a_shortfall_on_a_standard_pool_reads_benchmark_shortfall(benchmarked, django_capture_on_commit_callbacks):
    node, api = benchmarked()
    with django_capture_on_commit_callbacks(execute=True):
        _post(api, node, pending_benchmark(node).nonce, {**FIGURES, "memory_bytes": 2**30})
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.REJECTED
    assert node.lifecycle_reason.startswith("admission failed: benchmark: benchmark shortfall")


def test_an_unanswered_benchmark_times_out_and_rejects(benchmarked, time_machine, django_capture_on_commit_callbacks):
    time_machine.move_to(timezone.now(), tick=False)
    node, api = benchmarked()
    nonce = pending_benchmark(node).nonce
    assert expire_benchmarks.delay().get() == 0
    time_machine.shift(301)
    with django_capture_on_commit_callbacks(execute=True):
        assert expire_benchmarks.delay().get() == 1
    assert expire_benchmarks.delay().get() == 0
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.REJECTED
    assert "did not return the benchmark" in node.lifecycle_reason
    assert Benchmark.objects.get().status == BenchmarkStatus.TIMED_OUT
    late = _post(api, node, nonce)
    assert late.status_code == 410 and late.json()["code"] == "benchmark_expired"


def test_figures_after_the_deadline_are_gone_even_before_the_sweep(benchmarked, time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    node, api = benchmarked()
    time_machine.shift(301)
    response = _post(api, node, pending_benchmark(node, now=timezone.now() - timedelta(seconds=10)).nonce)
    assert response.status_code == 410
    assert Node.objects.get().lifecycle == Lifecycle.ADMITTING


def test_benchmark_endpoint_bad_inputs(benchmarked, operator_api, django_capture_on_commit_callbacks):
    node, api = benchmarked()
    nonce = pending_benchmark(node).nonce
    assert _post(api, node, "no-such-nonce").status_code == 404
    for bad in [
        {"cpu_millicores": -1, "memory_bytes": 1},
        {"cpu_millicores": "fast", "memory_bytes": 1},
        {"memory_bytes": 1},
        {**FIGURES, "verified": {"cpu": 1}},
        {**FIGURES, "details": {"x": "y" * 9000}},
    ]:
        response = _post(api, node, nonce, bad)
        assert response.status_code == 400, bad
    assert _post(operator_api, node, nonce).status_code == 403
    other, other_api = benchmarked()
    assert _post(other_api, node, nonce).status_code == 403
    assert _post(other_api, other, nonce).status_code == 404
    assert Benchmark.objects.get(nonce=nonce).status == BenchmarkStatus.REQUESTED
    with django_capture_on_commit_callbacks(execute=True):
        assert _post(api, node, nonce).status_code == 200
    again = _post(api, node, nonce)
    assert again.status_code == 409 and again.json()["code"] == "benchmark_already_completed"


def test_resume_sweep_redispatches_stalled_admissions_only(benchmarked, time_machine, monkeypatch):
    from tests.factories import NodeFactory

    time_machine.move_to(timezone.now(), tick=False)
    waiting, _ = benchmarked()
    Benchmark.objects.update(deadline=timezone.now() + timedelta(hours=1))
    stuck = NodeFactory()
    node_admit(node_id=stuck.pk, expected_version=1, actor=Actor.system("t"))  # its task is lost
    dispatched = []
    monkeypatch.setattr(admission, "run_admission_task", lambda: SimpleNamespace(delay=lambda *a: dispatched.append(a)))
    assert admission.admissions_resume() == 0
    time_machine.shift(11 * 60)
    assert admission.admissions_resume() == 1
    assert dispatched == [(str(stuck.pk), 1)]
    assert waiting.pk != stuck.pk


@pytest.mark.parametrize(
    "raw",
    [
        '{"cpu_millicores": 1, "memory_bytes": 1, "duration_seconds": NaN}',
        '{"cpu_millicores": 1, "memory_bytes": 1, "details": {"score": Infinity}}',
        '{"cpu_millicores": NaN, "memory_bytes": 1}',
    ],
)
def test_non_finite_benchmark_figures_are_refused(benchmarked, raw):
    node, api = benchmarked()
    nonce = pending_benchmark(node).nonce
    response = api.post(f"/api/v1/nodes/{node.pk}/benchmarks/{nonce}", raw, content_type="application/json")
    assert response.status_code == 400
    assert Benchmark.objects.get().status == BenchmarkStatus.REQUESTED


def test_the_expiry_sweep_rechecks_the_deadline_when_it_claims_an_extended_benchmark(benchmarked, monkeypatch):
    """A deadline moved later between the sweep's read of due benchmarks and its claim of one (the
    clock's outage credit, fleet.clock) keeps the benchmark: the claim repeats ``deadline <= now``
    as the lease expiry's claim repeats ``expires_at <= now``."""
    from fleet import benchmarks
    from nodepool import fsm

    node, _ = benchmarked()
    bench = pending_benchmark(node)
    sweep_at = bench.deadline + timedelta(seconds=1)  # due when the sweep reads it
    claim = fsm.move

    def extend_then_claim(queryset, name, **changes):
        if name == "time_out":
            Benchmark.objects.filter(pk=bench.pk).update(deadline=sweep_at + timedelta(seconds=300))
        return claim(queryset, name, **changes)

    monkeypatch.setattr(fsm, "move", extend_then_claim)
    assert benchmarks.benchmarks_expire(actor=Actor.system("t"), now=sweep_at) == 0
    stored = Benchmark.objects.get(pk=bench.pk)
    assert stored.status == BenchmarkStatus.REQUESTED and stored.deadline == sweep_at + timedelta(seconds=300)
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.ADMITTING
    assert not NodeEvent.objects.filter(node=node, type=fleet_events.BENCHMARK, to_state="timed_out").exists()
