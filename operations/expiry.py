"""Expiry: a node is replaced once it has served ``expire_after`` seconds (issue #34 item 4).

A node's **expiry time** is its latest admission (:attr:`~operations.models.NodeShape.admitted_at`:
a node re-admitted after a replacement starts over) plus the pool's ``expire_after`` plus a
**spread** of up to ``EXPIRY_SPREAD`` (10 %) of ``expire_after``, fixed per node (the first 8 bytes
of ``sha256(node id)`` as a fraction): nodes created together do not all fall due together, and
the pool's budgets pace whatever falls due at once anyway. The time is **control-plane time**:
every gap the control plane detected and paused (:func:`fleet.clock.detected_gaps`) after the
admission is added, so a control-plane outage does not age nodes.

Expired nodes are replaced like drifted ones (:mod:`operations.replacement`, reason ``expiry``,
hold owner ``system:expiry``), **within the budgets and windows** — a departure from Karpenter v1,
whose expiry is forceful and ignores budgets (kubernetes-sigs/karpenter #1750, #1590 asked for
this). ``termination_grace`` (seconds, optional) bounds the wait: an expired node still waiting
``termination_grace`` after its expiry time is taken out anyway, and the replacement names the
budget it overrode (``overrode``; Karpenter's ``terminationGracePeriod`` bounds the drain in the
same spirit).

Nothing expires while the control plane's own guards are engaged (:func:`guard_engaged`): right
after a detected outage or clock gap, and while the liveness sweep's mass-silence guard holds a
pool or zone — the timers stop, so an outage never triggers mass replacements.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

from fleet.clock import extend_past_gaps
from fleet.models import ControlPlaneClock, LivenessSweepState

from . import conf

MAX_SECONDS = 10 * 365 * 86400


def spread_fraction(node_id) -> float:
    """A fixed fraction in [0, 1) for ``node_id`` (the first 8 bytes of ``sha256(str(node_id))``)."""
    return int.from_bytes(hashlib.sha256(str(node_id).encode()).digest()[:8], "big") / 2**64


def expires_at(*, node_id, admitted_at: datetime, expire_after: int, gaps=()) -> datetime:
    """When a node admitted at ``admitted_at`` expires: ``admitted_at + expire_after`` seconds plus
    its spread (``EXPIRY_SPREAD × expire_after × spread_fraction(node_id)``), moved later by every
    paused gap (``gaps``: :func:`fleet.clock.detected_gaps`) that began in between."""
    spread = float(conf.get("EXPIRY_SPREAD")) * expire_after * spread_fraction(node_id)
    due = admitted_at + timedelta(seconds=expire_after + spread)
    return extend_past_gaps(admitted_at, due, list(gaps))


def guard_engaged(now: datetime) -> str:
    """Why automated timers (expiry; repair may share it) must stand still now, or ``""``:
    within ``AUTONOMY_GUARD_SECONDS`` (300) of a detected control-plane gap or outage (the clock's
    ``last_gap_ended_at``, the liveness sweep's ``recovered_at``), or while the mass-silence guard
    holds any pool or zone (``LivenessSweepState.guarded_groups``)."""
    settle = timedelta(seconds=float(conf.get("AUTONOMY_GUARD_SECONDS")))
    state = LivenessSweepState.objects.filter(pk=1).values("recovered_at", "guarded_groups").first() or {}
    if state.get("guarded_groups"):
        return f"mass-silence guard engaged ({', '.join(sorted(state['guarded_groups']))})"
    if state.get("recovered_at") and now - state["recovered_at"] < settle:
        return f"the control plane recovered from an outage at {state['recovered_at'].isoformat()}"
    gap_end = ControlPlaneClock.objects.filter(pk=1).values_list("last_gap_ended_at", flat=True).first()
    if gap_end and now - gap_end < settle:
        return f"the control plane's clock gap ended at {gap_end.isoformat()}"
    return ""
