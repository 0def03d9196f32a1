"""Celery tasks for maintenance: thin wrappers over :mod:`maintenance.drains`."""

from __future__ import annotations

from celery import shared_task

from fleet.events import Actor

from . import drains


@shared_task(name="maintenance.enforce_drain_deadline", ignore_result=True)
def enforce_drain_deadline(drain_id: str) -> str:
    """Queued with ``eta`` = the drain's deadline. Early, late or repeated runs are harmless:
    enforcement claims the drain with a compare-and-swap on ``state=active, deadline<=now``."""
    task_id = enforce_drain_deadline.request.id or ""
    try:
        drain = drains.evaluate_drain(drain_id=drain_id, actor=Actor.system("maintenance.drain_deadline", task_id))
    except drains.NotFound:
        return "missing"
    return drain.state


@shared_task(name="maintenance.sweep_drains", ignore_result=True)
def sweep_drains() -> dict:
    """Beat safety net: evaluate every active drain (progress, completion, overdue deadlines)."""
    task_id = sweep_drains.request.id or ""
    return drains.sweep_drains(actor=Actor.system("maintenance.sweep_drains", task_id))
