"""Celery tasks of the marketplace: thin wrappers over :mod:`marketplace.reconciliation`."""

from __future__ import annotations

from celery import shared_task

from fleet.events import Actor

from . import periods, reconciliation, webhooks


@shared_task(name="marketplace.reconcile_usage_record", ignore_result=True)
def reconcile_usage_record(record_id: int) -> str:
    """Queued at the lease's end with ``countdown`` = the settlement window. Early, late or
    repeated runs are harmless: an early one changes nothing, a repeated one finds it settled."""
    task_id = reconcile_usage_record.request.id or ""
    record = reconciliation.reconcile_usage(record_id, actor=Actor.system("marketplace.reconcile", task_id))
    return record.state if record is not None else "missing"


@shared_task(name="marketplace.reconcile_due", ignore_result=True)
def reconcile_due() -> dict:
    """Beat safety net: records past their window, and held ones whose quarantine was released."""
    task_id = reconcile_due.request.id or ""
    return reconciliation.reconcile_due(actor=Actor.system("marketplace.reconcile_due", task_id))


@shared_task(name="marketplace.reconcile_pool_periods", ignore_result=True)
def reconcile_pool_periods() -> dict:
    """Beat: reconcile every pool period that is over (marketplace.periods). Safe twice at once:
    each period is reconciled under its row lock, and a reconciled one is never evaluated again."""
    task_id = reconcile_pool_periods.request.id or ""
    return periods.reconcile_due_periods(actor=Actor.system("marketplace.reconcile_pool_periods", task_id))


@shared_task(name="marketplace.deliver_payout_webhook", ignore_result=True)
def deliver_payout_webhook(delivery_id: int) -> str:
    """Send one payout webhook notice (marketplace.webhooks), queued after the transition's commit.
    A failure is not raised: the row's ``next_attempt_at`` is set and the beat sweep retries it."""
    return webhooks.deliver(delivery_id)


@shared_task(name="marketplace.deliver_payout_webhooks", ignore_result=True)
def deliver_payout_webhooks() -> dict:
    """Beat: retry the payout webhook notices that are due (failed sends, lost broker messages)."""
    return webhooks.deliver_due()
