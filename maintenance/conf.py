"""Maintenance settings, read from ``settings.NODEPOOL`` with these defaults (override there)."""

from django.conf import settings

DEFAULTS = {
    # How often the safety-net sweep re-evaluates active drains (seconds).
    "DRAIN_SWEEP_INTERVAL": 10,
    # Longest drain an operator may ask for (seconds): a forgotten drain should not hold a node for a year.
    "DRAIN_MAX_DURATION": 30 * 24 * 3600,
    # Usage may exceed capacity by this fraction before it is "impossible" (measurement noise).
    "IMPOSSIBLE_USAGE_TOLERANCE": 0.05,
    # Declared capacity above verified x this factor is "far above" (automatic quarantine).
    "CAPACITY_ABOVE_VERIFIED_FACTOR": 1.5,
}


def get(name: str):
    """The configured value of ``name`` (``settings.NODEPOOL[name]`` or the default above)."""
    return getattr(settings, "NODEPOOL", {}).get(name, DEFAULTS[name])
