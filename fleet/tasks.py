"""Fleet Celery tasks: thin wrappers over services (dispatched with ``on_commit``)."""

from __future__ import annotations

from celery import current_task, shared_task
from django.db import OperationalError

from nodepool import metrics

from . import admission, benchmarks, fleet_state, reliability, retention, reverification
from .events import Actor
from .liveness_sweep import sweep_liveness


@shared_task(
    name="fleet.run_admission",
    bind=True,
    acks_late=True,
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    max_retries=5,
)
def run_admission(self, node_id: str, attempt: int) -> str:
    """Run or resume admission attempt ``attempt`` of node ``node_id`` (idempotent)."""
    actor = Actor.system("fleet.run_admission", self.request.id or "")
    return admission.run_admission(node_id=node_id, attempt=attempt, actor=actor)


@shared_task(name="fleet.expire_benchmarks", bind=True)
def expire_benchmarks(self) -> int:
    """Beat: time out benchmarks past their deadline and fail their admission checks."""
    return benchmarks.benchmarks_expire(actor=Actor.system("fleet.expire_benchmarks", self.request.id or ""))


@shared_task(name="fleet.resume_stalled_admissions")
def resume_stalled_admissions() -> int:
    """Beat: re-dispatch admission for nodes left ``admitting`` by a lost task or a crash."""
    return admission.admissions_resume()


@shared_task(name="fleet.sweep_liveness", ignore_result=True)
def sweep_liveness_task() -> dict:
    """Run one liveness sweep (safe to run twice at once; beat entry in fleet/schedule.py)."""
    task_id = getattr(getattr(current_task, "request", None), "id", "") or ""
    with metrics.LIVENESS_SWEEP_SECONDS.time():
        summary = sweep_liveness(actor=Actor.system("fleet.sweep_liveness", task_id=task_id))
    return {k: v for k, v in summary.items() if k != "now"}


@shared_task(name="fleet.prune_events", ignore_result=True)
def prune_events_task() -> dict:
    """Beat: delete old events in bounded batches (fleet/retention.py; rules in nodepool/retention.py)."""
    return retention.prune_events()


@shared_task(name="fleet.refresh_fleet_state", ignore_result=True)
def refresh_fleet_state_task() -> float:
    """Beat: recompute the fleet-wide figures /metrics and the fleet overview read (fleet/fleet_state.py).

    Returns the computation's duration in seconds (a measurement, so its log line stays routine)."""
    return fleet_state.refresh().duration_seconds


@shared_task(name="fleet.reverify_due_nodes", bind=True, ignore_result=True)
def reverify_due_nodes(self) -> dict:
    """Beat: schedule, start and cancel scheduled re-verifications (fleet/reverification.py; safe twice at once)."""
    return reverification.reverify_due(actor=Actor.system("fleet.reverify_due_nodes", self.request.id or ""))


@shared_task(name="fleet.rollup_reliability", ignore_result=True)
def rollup_reliability_task() -> dict:
    """Beat: rewrite today's and yesterday's reliability rows and every node's score
    (fleet/reliability.py; safe to run twice at once)."""
    return reliability.rollup()
