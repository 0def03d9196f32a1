"""Celery beat entries of the maintenance app (wired into Celery by the foundation)."""

from . import conf

_SWEEP = conf.get("DRAIN_SWEEP_INTERVAL")

BEAT_SCHEDULE = {
    # The safety net for drain deadline tasks that fire late, twice or never, and the clock that
    # advances progress and completes drains. Expires before the next run so a backlog never piles up.
    "maintenance-sweep-drains": {
        "task": "maintenance.sweep_drains",
        "schedule": _SWEEP,
        "options": {"expires": _SWEEP * 0.9},
    },
}
