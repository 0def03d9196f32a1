"""Maintenance settings, declared once (nodepool.appsettings: ``settings.NODEPOOL[NAME]``, else the
environment variable ``NODEPOOL_<NAME>``, else the default below). Read with ``conf.get(NAME)``."""

from nodepool.appsettings import AppSettings, Setting

SETTINGS = AppSettings(
    "maintenance",
    Setting("DRAIN_SWEEP_INTERVAL", float, 10.0, "how often the safety-net sweep re-evaluates active drains (seconds)"),
    Setting("DRAIN_MAX_DURATION", int, 30 * 24 * 3600,
            "longest drain an operator may ask for (seconds): a forgotten drain should not hold a node for a year"),
    Setting("IMPOSSIBLE_USAGE_TOLERANCE", float, 0.05,
            "usage may exceed capacity by this fraction before it is impossible (measurement noise)"),
    Setting("CAPACITY_ABOVE_VERIFIED_FACTOR", float, 1.5,
            "declared capacity above verified times this factor is far above (automatic quarantine)"),
)  # fmt: skip

get = SETTINGS.get
