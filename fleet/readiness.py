"""Stale is never shown as healthy (issue 33 item 2): readiness and health as a person should read them.

A node's ``ready`` (its own word) and ``health`` (the control plane's judgement of its conditions)
describe the node as of its last status report. Once the node is ``unreachable``, ``lost`` or was
never heard from (liveness ``unknown``), that report no longer describes it, so both are *shown*
as ``unknown``, the way Kubernetes' node controller sets ``Ready=Unknown`` after its grace period;
``stale`` is still within grace and shows the reported values. The stored fields keep their
meaning (the last reported values, with ``last_heartbeat_at`` as their time); these functions
derive what the API's ``readiness`` / ``health_state``, the CLI, ``/metrics`` and the overview show.
"""

from __future__ import annotations

from collections import Counter

from .choices import SIGNALS_UNKNOWN_LIVENESS, Health, Readiness


def signals_current(liveness: str) -> bool:
    """Does the node's last report still describe it (liveness ``alive`` or ``stale``)?"""
    return liveness not in SIGNALS_UNKNOWN_LIVENESS


def readiness_state(*, liveness: str, ready: bool) -> str:
    """``ready`` / ``not_ready`` from the reported boolean, ``unknown`` when signals are not current."""
    if not signals_current(liveness):
        return Readiness.UNKNOWN
    return Readiness.READY if ready else Readiness.NOT_READY


def health_state(*, liveness: str, health: str) -> str:
    """The judged health while signals are current, else ``unknown``."""
    return health if signals_current(liveness) else Health.UNKNOWN


def shown_counts(figures: dict) -> tuple[Counter, Counter]:
    """Nodes by readiness and by health *as shown* (fleet.readiness: ``unknown`` once a node is
    unreachable, lost or never heard from): ``({(pool pk, readiness): n}, {(pool pk, health): n})``."""
    readiness: Counter = Counter()
    health_shown: Counter = Counter()
    for pool, _lifecycle, liveness, health, n, *rest in figures["nodes"]:
        reports_ready = rest[4] if len(rest) > 4 else 0  # absent from figures stored before it was added
        if signals_current(liveness):
            readiness[(pool, Readiness.READY.value)] += reports_ready
            readiness[(pool, Readiness.NOT_READY.value)] += n - reports_ready
            health_shown[(pool, health)] += n
        else:
            readiness[(pool, Readiness.UNKNOWN.value)] += n
            health_shown[(pool, Health.UNKNOWN.value)] += n
    return readiness, health_shown
