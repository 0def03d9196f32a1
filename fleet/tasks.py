"""Celery tasks of the fleet app (thin: each calls one service)."""

from __future__ import annotations

from celery import shared_task

from .events import Actor
from .liveness import sweep_liveness


@shared_task(name="fleet.sweep_liveness", ignore_result=True)
def sweep_liveness_task() -> dict:
    """Run one liveness sweep (safe to run twice at once; beat entry in fleet/schedule.py)."""
    from celery import current_task

    task_id = getattr(getattr(current_task, "request", None), "id", "") or ""
    summary = sweep_liveness(actor=Actor.system("fleet.sweep_liveness", task_id=task_id))
    return {k: v for k, v in summary.items() if k != "now"}
