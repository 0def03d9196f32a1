"""Lease settings, declared once (nodepool.appsettings: ``settings.NODEPOOL[NAME]``, else the
environment variable ``NODEPOOL_<NAME>``, else the default below). Read with ``conf.get(NAME)``."""

from nodepool.appsettings import AppSettings, Setting

SETTINGS = AppSettings(
    "leases",
    Setting("LEASE_SECRET_KEY", str, "",
            "per-lease secrets (leases.secrets): the HMAC server key; empty derives one from SECRET_KEY"),
    Setting("LEASE_MISSED_REPORTS", int, 3,
            "status reports in a row a live lease may go unreported before it is declared lost"),
)  # fmt: skip

get = SETTINGS.get
