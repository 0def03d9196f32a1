"""Celery beat entries of the fleet app (wired into Celery by nodepool.celery).

Each job is safe to run twice at once (compare-and-swap claims) and expires before its next run,
so a backlog never piles up; a missed run is harmless because the next one catches up.
"""

from django.conf import settings

_SWEEP = float(settings.NODEPOOL.get("LIVENESS_SWEEP_INTERVAL", 5.0))

BEAT_SCHEDULE = {
    "fleet-sweep-liveness": {
        "task": "fleet.sweep_liveness",
        "schedule": _SWEEP,
        "options": {"expires": _SWEEP * 0.8},
    },
    "fleet-expire-benchmarks": {
        "task": "fleet.expire_benchmarks",
        "schedule": 15.0,
        "options": {"expires": 12.0},
    },
    "fleet-resume-stalled-admissions": {
        "task": "fleet.resume_stalled_admissions",
        "schedule": 120.0,
        "options": {"expires": 100.0},
    },
}
