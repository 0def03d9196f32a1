"""Celery beat entries of the marketplace app."""

from . import conf

_SWEEP = conf.get("RECONCILE_SWEEP_INTERVAL")

BEAT_SCHEDULE = {
    # The safety net for reconciliation tasks that fire late, twice or never (a lost broker
    # message), and the re-run of held records once their quarantine is released.
    "marketplace-reconcile-due": {
        "task": "marketplace.reconcile_due",
        "schedule": _SWEEP,
        "options": {"expires": _SWEEP * 0.9},
    },
    # Pool periods that ended: reconcile them (waiting ones and re-runs after operators resolved
    # mismatch items are picked up on the next pass).
    "marketplace-reconcile-pool-periods": {
        "task": "marketplace.reconcile_pool_periods",
        "schedule": 300.0,
        "options": {"expires": 270.0},
    },
    # Payout webhook notices that failed or whose task was lost (marketplace.webhooks): retried
    # with backoff; a pass with nothing due is one indexed query.
    "marketplace-deliver-payout-webhooks": {
        "task": "marketplace.deliver_payout_webhooks",
        "schedule": 30.0,
        "options": {"expires": 27.0},
    },
}
