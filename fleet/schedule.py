"""Celery beat entries of the fleet app (wired into Celery by the foundation)."""

from django.conf import settings

_SWEEP = float(settings.NODEPOOL.get("LIVENESS_SWEEP_INTERVAL", 5.0))

BEAT_SCHEDULE = {
    # Degrade liveness of silent nodes. Expires before the next run so a backlog never piles up;
    # a missed run is harmless (the next one catches up) and an overlap is safe (compare-and-swap).
    "fleet-sweep-liveness": {
        "task": "fleet.sweep_liveness",
        "schedule": _SWEEP,
        "options": {"expires": _SWEEP * 0.8},
    },
}
