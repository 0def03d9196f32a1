"""Benchmarks: the node's figures compared with what it declared, a benchmark's completion and
its expiry (split from fleet.admission, issue 28 step 8). An admission benchmark completes or
fails its ``benchmark`` check and re-runs admission; another (a re-verification's) is handed to
``fleet.signals.benchmark_finished``.

Both moves are claims built from the model's transitions (``nodepool.fsm.move``):
``requested`` → ``completed`` (:func:`benchmark_complete`) or → ``timed_out``
(:func:`benchmarks_expire`), so of two writers only one moves a benchmark.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from humanunits import quantity
from nodepool import fsm
from nodepool.api.problems import Conflict, Gone, NotFound

from . import event_types, signals
from .admission import BENCHMARK, BENCHMARKED_RESOURCES, Outcome, dispatch_admission, failed, passed, record_outcome
from .choices import BenchmarkStatus, CheckStatus, PoolKind
from .errors import BENCHMARK_ALREADY_COMPLETED, BENCHMARK_EXPIRED, BENCHMARK_NOT_FOUND
from .events import Actor, record_event
from .models import AdmissionCheck, Benchmark, Node


def compare_benchmark(node: Node, measured: dict[str, int]) -> Outcome:
    """Measured vs declared cpu and memory; a ratio below ``pool.benchmark_tolerance`` fails.

    For a marketplace pool the failure reads "suspected misreported hardware", since the
    contributor's own declaration is what the measurement contradicts.
    """
    pool = node.pool
    declared = (node.declared or {}).get("resources") or {}
    shortfalls, ratios = [], {}
    for name in BENCHMARKED_RESOURCES:
        want = declared.get(name) or 0
        if not want:
            continue
        ratio = measured.get(name, 0) / want
        ratios[name] = round(ratio, 3)
        if ratio < pool.benchmark_tolerance:
            shortfalls.append(
                f"measured {name} {quantity(name, measured.get(name, 0))} is {ratio:.0%} "
                f"of declared {quantity(name, want)} "
                f"(tolerance {pool.benchmark_tolerance:.0%})"
            )
    if shortfalls:
        prefix = "suspected misreported hardware" if pool.kind == PoolKind.MARKETPLACE else "benchmark shortfall"
        return failed(f"{prefix}: " + "; ".join(shortfalls), ratios=ratios)
    return passed("benchmark confirms the declared capacity", ratios=ratios)


def benchmark_complete(*, node: Node, nonce: str, figures: dict[str, Any], actor: Actor, now=None) -> Benchmark:
    """Record a node's benchmark figures, complete its admission check, and re-run admission.

    ``figures``: ``{"cpu_millicores": int, "memory_bytes": int, "duration_seconds": float, "details": {}}``.

    Raises: 404 ``benchmark_not_found`` (unknown nonce or another node's), 409
    ``benchmark_already_completed``, 410 ``benchmark_expired`` (past its deadline or timed out).
    """
    now = now or timezone.now()
    with transaction.atomic():
        bench = Benchmark.objects.filter(node=node, nonce=nonce).first()
        if bench is None:
            raise NotFound("No such benchmark for this node.", BENCHMARK_NOT_FOUND)
        if bench.status == BenchmarkStatus.COMPLETED:
            raise Conflict("This benchmark was already completed.", BENCHMARK_ALREADY_COMPLETED)
        if bench.status == BenchmarkStatus.TIMED_OUT or bench.deadline <= now:
            raise Gone("This benchmark's deadline has passed.", BENCHMARK_EXPIRED)
        won = fsm.move(Benchmark.objects.filter(pk=bench.pk), "complete", completed_at=now, result=figures)
        if not won:
            raise Conflict("This benchmark was completed or timed out meanwhile.", BENCHMARK_ALREADY_COMPLETED)
        measured = {"cpu": figures["cpu_millicores"], "memory": figures["memory_bytes"]}
        # A benchmark limited to the free part of a busy node (a re-verification's) measured only
        # that part: it is the re-verification's evidence, not the node's measured capability.
        Node.objects.filter(pk=node.pk).update(
            **(
                {}
                if bench.limits
                else {
                    "measured": {
                        "resources": measured,
                        "benchmark": {"nonce": nonce, "completed_at": now.isoformat(), **figures},
                    }
                }
            ),
            version=F("version") + 1,
        )
        record_event(
            node, event_types.BENCHMARK, actor, to_state=BenchmarkStatus.COMPLETED,
            reason="benchmark figures received", data={"nonce": nonce, "measured": measured},
        )  # fmt: skip
        check = AdmissionCheck.objects.filter(
            node=node, name=BENCHMARK, status=CheckStatus.PENDING, data__nonce=nonce
        ).first()
        if check is not None:
            node.refresh_from_db(fields=["declared", "pool"])
            record_outcome(check, compare_benchmark(node, measured), actor, started_at=bench.requested_at, now=now)
            dispatch_admission(node.pk, check.attempt)
        else:
            signals.benchmark_finished.send(sender=Benchmark, benchmark=bench, measured=measured, actor=actor, now=now)
    bench.refresh_from_db()
    return bench


def benchmarks_expire(*, actor: Actor, now: datetime | None = None, limit: int = 500) -> int:
    """Time out requested benchmarks past their deadline; their admission checks fail.

    Safe to run twice at once: each benchmark is claimed with its ``time_out`` transition
    (``status IN <sources>`` → ``timed_out``, ``nodepool.fsm.move``), its deadline checked again.
    Returns the number timed out by this run.
    """
    now = now or timezone.now()
    count = 0
    due = Benchmark.objects.filter(status=BenchmarkStatus.REQUESTED, deadline__lte=now).order_by("deadline")
    for bench in due[:limit]:
        with transaction.atomic():
            # The deadline again in the claim: one moved later since the read (the clock's outage
            # credit, fleet.clock) keeps the benchmark, as a completion since the read does.
            claim = Benchmark.objects.filter(pk=bench.pk, deadline__lte=now)
            won = fsm.move(claim, "time_out", completed_at=now)
            if not won:
                continue
            count += 1
            record_event(
                bench.node_id, event_types.BENCHMARK, actor, to_state=BenchmarkStatus.TIMED_OUT,
                reason=f"no benchmark result by the deadline {bench.deadline.isoformat()}", data={"nonce": bench.nonce},
            )  # fmt: skip
            check = AdmissionCheck.objects.filter(
                node_id=bench.node_id, name=BENCHMARK, status=CheckStatus.PENDING, data__nonce=bench.nonce
            ).first()
            if check is not None:
                outcome = failed(f"the node did not return the benchmark by its deadline {bench.deadline.isoformat()}")
                record_outcome(check, outcome, actor, started_at=bench.requested_at, now=now)
                dispatch_admission(bench.node_id, check.attempt)
            else:
                signals.benchmark_finished.send(sender=Benchmark, benchmark=bench, measured=None, actor=actor, now=now)
    return count
