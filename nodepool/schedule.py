"""Celery beat entries of the plumbing (merged by nodepool.celery.collect_beat_schedule)."""

BEAT_SCHEDULE = {
    # Expired user API tokens are refused at once; their rows go within the hour.
    "nodepool.prune_expired_tokens": {
        "task": "nodepool.prune_expired_tokens",
        "schedule": 3600.0,
        "options": {"expires": 3000.0},
    },
}
