"""Pool-operation settings, read from ``settings.NODEPOOL`` with these defaults (seconds)."""

from django.conf import settings

DEFAULTS = {
    # How often a moving upgrade re-evaluates itself (its self-scheduled tick), seconds.
    "UPGRADE_TICK": 2.0,
    # The beat safety net over every active upgrade (restarts a tick chain that died).
    "UPGRADE_SWEEP_INTERVAL": 10.0,
    # How often the autoscaler looks at every pool with a provider.
    "AUTOSCALE_INTERVAL": 15.0,
    # Provider calls: attempts before a scale request is given up, and the HTTP timeout.
    "PROVIDER_MAX_ATTEMPTS": 3,
    "PROVIDER_TIMEOUT": 10.0,
    # Webhook signatures older or newer than this are refused (replay window).
    "WEBHOOK_TOLERANCE": 300,
    # A preemption notice's drain ends this share of the notice before its deadline, and at
    # least PREEMPTION_MARGIN_MIN seconds before (work that checkpoints late still gets out).
    "PREEMPTION_MARGIN_FRACTION": 0.1,
    "PREEMPTION_MARGIN_MIN": 10.0,
    # Where simulator machines started by the `simulated` provider find the control plane.
    "SIMULATED_PROVIDER_URL": "http://127.0.0.1:8000",
}


def get(name: str):
    return getattr(settings, "NODEPOOL", {}).get(name, DEFAULTS[name])
