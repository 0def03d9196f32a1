"""Pool-operation settings, declared once (nodepool.appsettings: ``settings.NODEPOOL[NAME]``, else
the environment variable ``NODEPOOL_<NAME>``, else the default below). Read with ``conf.get(NAME)``."""

from nodepool.appsettings import AppSettings, Setting

SETTINGS = AppSettings(
    "operations",
    Setting("UPGRADE_TICK", float, 2.0,
            "how often a moving upgrade re-evaluates itself (its self-scheduled tick; seconds)"),
    Setting("UPGRADE_SWEEP_INTERVAL", float, 10.0,
            "the beat safety net over every active upgrade (restarts a dead tick chain; seconds)"),
    Setting("AUTOSCALE_INTERVAL", float, 15.0,
            "how often the autoscaler looks at every pool with a provider (seconds)"),
    Setting("PROVIDER_MAX_ATTEMPTS", int, 3, "provider calls: attempts before a scale request is given up"),
    Setting("PROVIDER_TIMEOUT", float, 10.0, "provider calls: the HTTP timeout (seconds)"),
    Setting("WEBHOOK_TOLERANCE", int, 300, "webhook signatures older or newer than this are refused (seconds)"),
    Setting("PREEMPTION_MARGIN_FRACTION", float, 0.1,
            "a preemption notice's drain ends this share of the notice before its deadline..."),
    Setting("PREEMPTION_MARGIN_MIN", float, 10.0, "...and at least this long before (seconds)"),
    Setting("SIMULATED_PROVIDER_URL", str, "http://127.0.0.1:8000",
            "where simulator machines started by the simulated provider find the control plane"),
    Setting("REPLACEMENT_SWEEP_INTERVAL", float, 30.0,
            "how often drifted and expired nodes are looked for and their replacements moved (seconds)"),
    Setting("EXPIRY_SPREAD", float, 0.1,
            "a node's expiry is spread over this share of expire_after (fixed per node): "
            "nodes made together do not expire together"),
    Setting("AUTONOMY_GUARD_SECONDS", float, 300.0,
            "expiry stands still this long after a detected control-plane outage or clock gap (seconds)"),
    Setting("REPAIR_INTERVAL", float, 15.0,
            "how often the repair sweep looks at every pool with repair rules (seconds)"),
    Setting("REPAIR_SETTLE", float, 300.0,
            "after a detected outage or clock gap of the control plane, repair timers count from the "
            "recovery, and no repair starts for this long (seconds)"),
    Setting("REPAIR_REBOOT_TIMEOUT", float, 900.0,
            "a node told to reboot that shows no new boot within this long fails its repair (seconds)"),
    Setting("BULK_MAX_NODES", int, 100,
            "most nodes one bulk cordon / uncordon / drain by label selector may act on (operations.bulk)"),
)  # fmt: skip

get = SETTINGS.get
