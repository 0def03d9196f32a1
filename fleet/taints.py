"""When each of a node's taints was added: ``Node.taints_added_at``.

A ``NoExecute`` taint's ``toleration_seconds`` counts from the moment the taint was put on the
node (Kubernetes' taint manager, pkg/controller/tainteviction, reads ``Taint.TimeAdded``), so
every path that sets taints keeps this map: enrollment, a pool's taints reaching its members
(API, admin), the Kubernetes importer (from ``timeAdded`` when the dump has one).

A taint is identified by ``key`` and ``effect``, as in Kubernetes (a node holds at most one
taint per key and effect, and changing only the value does not restart the clock).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils.dateparse import parse_datetime


def taint_id(taint: dict[str, Any]) -> str:
    """``"key:effect"``: the identity of a taint on a node."""
    return f"{taint.get('key', '')}:{taint.get('effect', '')}"


def stamp(
    previous: dict[str, str] | None, taints: list[dict], now: datetime, *, given: dict[str, datetime] | None = None
) -> dict[str, str]:
    """The ``taints_added_at`` map for a node that now has ``taints``.

    Args:
        previous: the node's map before the change (``{"key:effect": ISO 8601}``), or None.
        taints: the node's taints after the change (``[{"key", "value", "effect"}]``).
        now: the time of the change (aware datetime): taints new to the node get it.
        given: times a source already knows (the importer's ``timeAdded``), by taint id; they win
            over ``previous`` and ``now``.

    Returns one entry per taint id in ``taints``; ids no longer present are dropped, ids still
    present keep their time.
    """
    previous, given = previous or {}, given or {}
    stamped = {}
    for taint in taints:
        tid = taint_id(taint)
        if tid in stamped:
            continue
        if tid in given:
            stamped[tid] = given[tid].isoformat()
        else:
            stamped[tid] = previous.get(tid) or now.isoformat()
    return stamped


def added_at(times: dict[str, str] | None, taint: dict[str, Any]) -> datetime | None:
    """When ``taint`` was added according to a ``taints_added_at`` map, or None if not recorded."""
    raw = (times or {}).get(taint_id(taint))
    try:
        return parse_datetime(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
