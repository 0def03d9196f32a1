"""Celery beat entries of the fleet app (wired into Celery by the foundation).

Each job is safe to run twice at once (compare-and-swap claims) and expires before its next run.
"""

BEAT_SCHEDULE = {
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
