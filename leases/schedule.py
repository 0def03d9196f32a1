"""Celery beat entries for the leases app (wired into Celery by the foundation)."""

BEAT_SCHEDULE = {
    # Leases past their TTL lose their capacity within ~5 s.
    "leases.expire_leases": {"task": "leases.expire_leases", "schedule": 5.0, "options": {"expires": 4.0}},
    # Queued requests are also placed on lease end and when a node turns schedulable; this entry
    # catches the triggers that were missed (capacity raised by admission, a lost broker message).
    "leases.place_pending_requests": {
        "task": "leases.place_pending_requests",
        "schedule": 15.0,
        "options": {"expires": 14.0},
    },
    # NoExecute taints added while leases run (tolerationSeconds counts from the taint or the grant).
    "leases.evict_noexecute": {"task": "leases.evict_noexecute", "schedule": 10.0, "options": {"expires": 9.0}},
    "leases.check_consistency": {"task": "leases.check_consistency", "schedule": 300.0, "options": {"expires": 290.0}},
    # Retention (nodepool/retention.py): ended leases past the retention age, hourly, in batches.
    "leases.prune_ended_leases": {
        "task": "leases.prune_ended_leases",
        "schedule": 3600.0,
        "options": {"expires": 3000.0},
    },
    # "Can serve N now" per request class, read by /metrics and the fleet overview.
    "leases.refresh_request_class_fits": {
        "task": "leases.refresh_request_class_fits",
        "schedule": 30.0,
        "options": {"expires": 25.0},
    },
}
