"""Celery beat entries of the fleet app (wired into Celery by nodepool.celery).

Each job is safe to run twice at once (compare-and-swap claims) and expires before its next run,
so a backlog never piles up; a missed run is harmless because the next one catches up.
"""

from . import conf

_SWEEP = conf.get("LIVENESS_SWEEP_INTERVAL")
_FLEET_STATE = conf.get("FLEET_STATE_INTERVAL")
_RELIABILITY = conf.get("RELIABILITY_ROLLUP_INTERVAL")

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
    # Node counts, capacity, usage, drift and inconsistent usage for /metrics and the fleet overview
    # (fleet/fleet_state.py): computed here so that a scrape never scans the fleet.
    "fleet-refresh-fleet-state": {
        "task": "fleet.refresh_fleet_state",
        "schedule": _FLEET_STATE,
        "options": {"expires": _FLEET_STATE * 0.8},
    },
    # Scheduled re-verification (fleet/reverification.py): the due times are drawn per node, so a
    # minute's resolution is plenty; a run cut short is finished by the next pass.
    "fleet-reverify-due-nodes": {"task": "fleet.reverify_due_nodes", "schedule": 60.0, "options": {"expires": 50.0}},
    # Retention (nodepool/retention.py): hourly, bounded batches; a run cut short resumes next hour.
    "fleet-prune-events": {"task": "fleet.prune_events", "schedule": 3600.0, "options": {"expires": 3000.0}},
    # The reliability record (fleet/reliability.py): today's and yesterday's uptime, device faults
    # and every node's score, from events still within retention.
    "fleet-rollup-reliability": {
        "task": "fleet.rollup_reliability",
        "schedule": _RELIABILITY,
        "options": {"expires": _RELIABILITY * 0.8},
    },
}
