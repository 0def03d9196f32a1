"""Celery tasks for maintenance: thin wrappers over :mod:`maintenance.drains`."""

from __future__ import annotations

from celery import shared_task

from fleet import clock
from fleet.events import Actor

from . import drains, holds


@shared_task(name="maintenance.enforce_drain_deadline", ignore_result=True)
def enforce_drain_deadline(drain_id: str) -> str:
    """Queued with ``eta`` = the drain's deadline. Early, late or repeated runs are harmless:
    enforcement claims the drain with a compare-and-swap on ``state=active, deadline<=now``."""
    task_id = enforce_drain_deadline.request.id or ""
    actor = Actor.system("maintenance.drain_deadline", task_id)
    clock.observe(actor=actor)  # a clock jump since the last sweep moves the deadline first
    try:
        drain = drains.evaluate_drain(drain_id=drain_id, actor=actor)
    except drains.NotFound:
        return "missing"
    return drain.state


@shared_task(name="maintenance.sweep_drains", ignore_result=True)
def sweep_drains() -> dict:
    """Beat safety net: evaluate every active drain (progress, completion, overdue deadlines), and
    end cordon holds past their ``expires_at``."""
    task_id = sweep_drains.request.id or ""
    result = drains.sweep_drains(actor=Actor.system("maintenance.sweep_drains", task_id))
    result["holds_expired"] = holds.expire_holds(actor=Actor.system("maintenance.expire_holds", task_id))
    return result
