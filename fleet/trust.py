"""The unverified mark: the ``nodepool.dev/unverified:NoSchedule`` taint and the ``Unverified``
condition a node carries while a re-verification found it below what was verified.

Pure functions on a :class:`~fleet.models.Node` instance (memory only, no queries); the caller
saves ``taints``, ``taints_added_at`` and ``conditions`` and records the event. Used by
:mod:`fleet.reverification` (deverify, pass) and :mod:`fleet.admission` (a fresh admission
verifies the node anew, so it lifts the mark).

The taint follows Kubernetes' ``NoSchedule`` semantics (running work stays; new work that does
not tolerate it goes elsewhere: leases.placement). The condition is server-owned, like
``ClockSkew``: a node's own report never sets or clears it (fleet.heartbeat_rules.merge_conditions).
Its polarity is a pressure-style one (bad when ``"True"``), and it is in no pool's health lists by
default, so it does not make the node unhealthy: the taint is what keeps work away.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime

from . import health
from . import taints as taint_times
from .choices import Lifecycle
from .models import Node

UNVERIFIED_TAINT_KEY = "nodepool.dev/unverified"
UNVERIFIED_TAINT = {"key": UNVERIFIED_TAINT_KEY, "value": "", "effect": "NoSchedule"}
UNVERIFIED = health.UNVERIFIED


def is_unverified(node: Node) -> bool:
    """Whether ``node`` carries the unverified taint."""
    return any(t.get("key") == UNVERIFIED_TAINT_KEY for t in node.taints or [])


def _set_condition(node: Node, status: str, reason: str, message: str, now: datetime) -> None:
    conditions = [c for c in node.conditions or [] if c.get("type") != UNVERIFIED]
    before = next((c for c in node.conditions or [] if c.get("type") == UNVERIFIED), None)
    same = before is not None and before.get("status") == status
    stamp = before.get("last_transition_time") if same else now.isoformat()
    conditions.append(
        {"type": UNVERIFIED, "status": status, "reason": reason, "message": message, "last_transition_time": stamp}
    )
    node.conditions = conditions


def mark_unverified(node: Node, *, reason: str, message: str, now: datetime) -> None:
    """Put the taint (once; its ``taints_added_at`` kept if already there) and set the condition
    ``Unverified=True`` with ``reason`` (a CamelCase code such as ``MeasuredBelowVerified``) and
    ``message`` (what was found, for people)."""
    if not is_unverified(node):
        node.taints = [*(node.taints or []), dict(UNVERIFIED_TAINT)]
    node.taints_added_at = taint_times.stamp(node.taints_added_at, node.taints, now)
    _set_condition(node, health.TRUE, reason, message, now)


def clear_unverified(node: Node, *, message: str, now: datetime) -> bool:
    """Lift the taint and set ``Unverified=False`` (reason ``Verified``) if the node was marked.
    Returns whether anything changed (an unmarked node is left as it is)."""
    marked = is_unverified(node) or any(
        c.get("type") == UNVERIFIED and c.get("status") == health.TRUE for c in node.conditions or []
    )
    if not marked:
        return False
    node.taints = [t for t in node.taints or [] if t.get("key") != UNVERIFIED_TAINT_KEY]
    node.taints_added_at = taint_times.stamp(node.taints_added_at, node.taints, now)
    _set_condition(node, health.FALSE, "Verified", message, now)
    return True


def metric_rows() -> list[list[int]]:
    """``[[pool pk, n]]``: nodes (not retired) carrying the unverified taint, per pool, for the
    gauge ``nodepool_nodes_unverified`` (fleet.fleet_state stores it, fleet.collectors exports it).
    Reads only nodes with any taint (the taint lists are JSON, matched here rather than in SQL so
    that SQLite and PostgreSQL count alike)."""
    counts: Counter = Counter()
    tainted = Node.objects.exclude(lifecycle=Lifecycle.RETIRED).exclude(taints=[]).values_list("pool_id", "taints")
    for pool_id, taints in tainted.iterator(chunk_size=2000):
        if any(isinstance(t, dict) and t.get("key") == UNVERIFIED_TAINT_KEY for t in taints or []):
            counts[pool_id] += 1
    return [[pool_id, n] for pool_id, n in sorted(counts.items())]
