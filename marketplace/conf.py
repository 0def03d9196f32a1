"""Marketplace settings, declared once (nodepool.appsettings: ``settings.NODEPOOL[NAME]``, else the
environment variable ``NODEPOOL_<NAME>``, else the default below). Read with ``conf.get(NAME)``."""

from nodepool.appsettings import AppSettings, Setting

SETTINGS = AppSettings(
    "marketplace",
    Setting("SETTLEMENT_WINDOW_MIN", int, 15 * 60,
            "the settlement window's floor (seconds; a pool's default is the larger of this and twice its "
            "scaled loss threshold)"),
    Setting("RECONCILE_SWEEP_INTERVAL", float, 60.0, "how often the reconciliation sweep runs (seconds)"),
    Setting("PAYOUT_WEBHOOK_URL", str, "",
            "the optional payout webhook: every payout transition is POSTed there, signed "
            "(docs/marketplace.md, \"Payout webhook\"); empty: off"),
    Setting("PAYOUT_WEBHOOK_SECRET", str, "", "the payout webhook's HMAC-SHA256 key; without it nothing is sent"),
)  # fmt: skip

get = SETTINGS.get
