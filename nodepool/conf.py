"""The plumbing's own settings (nodepool.metrics, nodepool.retention), declared once
(nodepool.appsettings: ``settings.NODEPOOL[NAME]``, else the environment variable
``NODEPOOL_<NAME>``, else the default below). Read with ``conf.get(NAME)``.

The process-level settings (database, Redis, proxies, body limits: ``NODEPOOL_DB_*`` and the like)
stay top-level Django settings in nodepool/settings.py: Django and its libraries read them there."""

from nodepool.appsettings import AppSettings, Setting

SETTINGS = AppSettings(
    "nodepool",
    Setting("METRICS_CACHE_SECONDS", float, 5.0,
            "/metrics: how long one process reuses the fleet-state answer (seconds)"),
    Setting("RETENTION_DAYS", float, 90.0, "events and ended leases older than this are pruned hourly (days)"),
    Setting("RETENTION_KEEP_EVENTS_PER_NODE", int, 50, "a node's last events always kept"),
    Setting("RETENTION_KEEP_EVENT_TYPES", list, ["usage", "statement", "appeal", "security", "quarantine"],
            "event types never pruned (comma-separated)"),
    Setting("RETENTION_BATCH", int, 1000, "rows deleted per batch"),
    Setting("RETENTION_MAX_BATCHES", int, 20, "batches per run"),
    # Failed authentication (nodepool.auth_failures; docs/foundation.md, "Failed authentication").
    Setting("AUTH_FAILURE_LIMIT", int, 60,
            "refused user tokens / node credentials per client address (IPv6: /64) and window before "
            "429 auth_failures_throttled (0: off)"),
    Setting("AUTH_FAILURE_WINDOW_SECONDS", int, 60, "the window of that limit (seconds)"),
    Setting("AUTH_GOOD_MEMORY_SECONDS", int, 900,
            "a credential a process accepted this recently still passes while its address is blocked (seconds)"),
    Setting("LOGIN_ACCOUNT_FAILURE_LIMIT", int, 20,
            "failed logins per account across addresses in a window before unfamiliar addresses are refused "
            "(0: off)"),
    Setting("LOGIN_ACCOUNT_WINDOW_MINUTES", int, 15, "the window of the per-account ceiling (minutes)"),
    Setting("LOGIN_FAMILIAR_DAYS", int, 90,
            "an address the account logged in from successfully this recently is never refused by the ceiling "
            "(days)"),
)  # fmt: skip

get = SETTINGS.get
