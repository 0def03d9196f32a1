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
from fleet.silence import belongs_to_pool

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


def recovered_at() -> datetime | None:
    """The end of the latest detected gap of the control plane (the clock's ``last_gap_ended_at``,
    the liveness sweep's ``recovered_at``), or None."""
    gap_end = ControlPlaneClock.objects.filter(pk=1).values_list("last_gap_ended_at", flat=True).first()
    liveness = LivenessSweepState.objects.filter(pk=1).values_list("recovered_at", flat=True).first()
    return max((t for t in (gap_end, liveness) if t is not None), default=None)


_READ = object()


def guard_engaged(now: datetime, *, pool=None, settle: float | None = None, recovered=_READ) -> str:
    """Why automated timers must stand still now, or ``""``: the one outage guard of expiry and
    repair (:func:`operations.repair_rules.guard`). Engaged while the mass-silence guard holds a
    group (``LivenessSweepState.guarded_groups``; of ``pool`` when given, any pool or zone when
    not), and within ``settle`` seconds (default ``AUTONOMY_GUARD_SECONDS``, 300; repair passes
    ``REPAIR_SETTLE``) of a detected control-plane gap or outage (``recovered``: the end of the
    latest, :func:`recovered_at` unless the caller read it already)."""
    groups = sorted(LivenessSweepState.objects.filter(pk=1).values_list("guarded_groups", flat=True).first() or {})
    if pool is not None:
        groups = [key for key in groups if belongs_to_pool(key, pool.name)]
    if groups:
        return f"mass-silence guard engaged ({', '.join(groups)})"
    settle = float(conf.get("AUTONOMY_GUARD_SECONDS")) if settle is None else settle
    recovered = recovered_at() if recovered is _READ else recovered
    if recovered is not None and now - recovered < timedelta(seconds=settle):
        return f"the control plane recovered from an outage or a clock gap at {recovered.isoformat()}"
    return ""
