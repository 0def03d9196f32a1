"""AdmissionCheck and Benchmark on django-fsm-2 (issue 28, step 6): their claims are built from the
declared transitions (``nodepool.fsm.move``), so each statement moves exactly the rows the graph
allows; and the two known risks of protected FSM fields — a stale instance saved after a set-based
move, and refreshes from several threads at once — stay harmless."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from django_fsm import ConcurrentTransition

from fleet import admission, benchmarks
from fleet.choices import BenchmarkStatus, CheckStatus, Lifecycle, ReverificationState
from fleet.events import Actor
from fleet.models import OUTCOME_TRANSITIONS, AdmissionCheck, Benchmark, Reverification
from fleet.reverification import reverifications_cancel
from nodepool import fsm
from tests.factories import NodeFactory, set_lifecycle
from tests.races import race

ACTOR = Actor.system("test")


def test_the_declared_graphs():
    for status, verb in OUTCOME_TRANSITIONS.items():
        assert fsm.sources(AdmissionCheck, verb) == (CheckStatus.PENDING,)
        assert fsm.target(AdmissionCheck, verb) == status
    assert set(OUTCOME_TRANSITIONS) == set(CheckStatus.values) - {CheckStatus.PENDING}
    for verb, goal in (("complete", BenchmarkStatus.COMPLETED), ("time_out", BenchmarkStatus.TIMED_OUT)):
        assert fsm.sources(Benchmark, verb) == (BenchmarkStatus.REQUESTED,)
        assert fsm.target(Benchmark, verb) == goal


def test_status_is_protected_and_moves_only_by_its_verbs():
    check = AdmissionCheck(attempt=1, name="labels")
    with pytest.raises(AttributeError):
        check.status = CheckStatus.PASSED
    check.succeed()
    assert check.status == CheckStatus.PASSED
    bench = Benchmark(nonce="n")
    bench.time_out()
    assert bench.status == BenchmarkStatus.TIMED_OUT


def _bench(node, status, nonce, *, deadline):
    return Benchmark.objects.create(node=node, nonce=nonce, status=status, requested_at=deadline, deadline=deadline)


@pytest.mark.django_db
def test_the_benchmark_expiry_sweep_moves_exactly_the_declared_sources():
    node, past = NodeFactory(), timezone.now() - timedelta(minutes=1)
    rows = {status: _bench(node, status, f"n-{status}", deadline=past) for status in BenchmarkStatus.values}
    assert benchmarks.benchmarks_expire(actor=ACTOR) == len(fsm.sources(Benchmark, "time_out"))
    for status, bench in rows.items():
        bench.refresh_from_db()
        moved = status in fsm.sources(Benchmark, "time_out")
        assert bench.status == (fsm.target(Benchmark, "time_out") if moved else status), status


@pytest.mark.django_db
def test_a_rejection_skips_exactly_the_declared_sources(django_capture_on_commit_callbacks):
    node = set_lifecycle(NodeFactory(admission_attempt=1), Lifecycle.ADMITTING)
    names = {status: f"check-{status}" for status in CheckStatus.values}
    for status, name in names.items():
        AdmissionCheck.objects.create(node=node, attempt=1, name=name, status=status, detail=status)
    with django_capture_on_commit_callbacks(execute=False):
        assert admission.finalize_admission(node_id=node.pk, attempt=1, actor=ACTOR) == Lifecycle.REJECTED
    for status, name in names.items():
        moved = status in fsm.sources(AdmissionCheck, "skip")
        assert AdmissionCheck.objects.get(node=node, name=name).status == (
            fsm.target(AdmissionCheck, "skip") if moved else status
        ), status


@pytest.mark.django_db
def test_the_reverification_cancel_sweep_moves_exactly_the_declared_sources():
    now = timezone.now()
    runs = {}
    for state in ReverificationState.values:
        node = set_lifecycle(NodeFactory(), Lifecycle.RETIRED)  # out of service: every open run goes
        runs[state] = Reverification.objects.create(node=node, pool=node.pool, due_at=now, state=state)
    assert reverifications_cancel(actor=ACTOR, now=now) == len(fsm.sources(Reverification, "cancel"))
    for state, run in runs.items():
        moved = state in fsm.sources(Reverification, "cancel")
        assert Reverification.objects.get(pk=run.pk).state == (fsm.target(Reverification, "cancel") if moved else state)


@pytest.mark.django_db
def test_a_stale_instance_saved_after_a_set_based_move_is_refused_until_refreshed():
    """ConcurrentTransitionMixin adds ``WHERE status = <as loaded>`` to a save: a copy loaded before
    the sweep's UPDATE cannot write its old status back over the move; refreshed, it saves."""
    bench = _bench(NodeFactory(), BenchmarkStatus.REQUESTED, "n-1", deadline=timezone.now() - timedelta(seconds=1))
    assert benchmarks.benchmarks_expire(actor=ACTOR) == 1
    bench.result = {"late": True}
    with pytest.raises(ConcurrentTransition), transaction.atomic():
        bench.save()
    assert Benchmark.objects.get(pk=bench.pk).status == BenchmarkStatus.TIMED_OUT
    bench.refresh_from_db()
    bench.result = {"late": True}
    bench.save()
    saved = Benchmark.objects.get(pk=bench.pk)
    assert (saved.status, saved.result) == (BenchmarkStatus.TIMED_OUT, {"late": True})


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_threads_refreshing_checks_and_benchmarks_never_trip_the_protected_status():
    node = NodeFactory()
    check = AdmissionCheck.objects.create(node=node, attempt=1, name="labels")
    bench = _bench(node, BenchmarkStatus.REQUESTED, "n-1", deadline=timezone.now() + timedelta(minutes=5))

    def refresh_many(_):
        for _ in range(100):
            for model, pk in ((AdmissionCheck, check.pk), (Benchmark, bench.pk)):
                copy = model.objects.only("id", "status").get(pk=pk)
                copy.refresh_from_db()  # the whole row, the protected status included
                assert copy.node_id == node.pk  # deferred: loaded by a refresh too
        return "ok"

    outcome = race(refresh_many, 4)
    assert not outcome.errors, outcome.errors
    assert outcome.results == ["ok"] * 4
