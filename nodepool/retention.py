"""Retention: how long events and ended leases are kept, and the hook that keeps evidence.

The beat tasks ``fleet.prune_events`` (fleet/retention.py) and ``leases.prune_ended_leases``
(leases/retention.py) delete rows older than ``NODEPOOL["RETENTION_DAYS"]`` in bounded batches.
They never delete:

* the last ``NODEPOOL["RETENTION_KEEP_EVENTS_PER_NODE"]`` events of a node (its story stays readable);
* events of the types in ``NODEPOOL["RETENTION_KEEP_EVENT_TYPES"]`` (usage, statement, appeal,
  security, quarantine by default);
* anything a keep hook protects. Apps that must keep evidence (the marketplace's usage records,
  statements and appeals) register, in their ``AppConfig.ready()``::

      from nodepool import retention
      retention.keep_leases(lambda: Q(usage_records__finalized_at__isnull=True))  # Q over leases.Lease
      retention.keep_events(lambda: Q(lease_id__in=Subquery(...)))              # Q over fleet.NodeEvent

  Each hook returns a ``Q`` over the model named; rows matching any hook are excluded from
  deletion. A lease that an undeclared ``PROTECT`` foreign key still holds is skipped, not an error.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from django.db.models import Q

from . import conf

KeepHook = Callable[[], Q]
_event_hooks: list[KeepHook] = []
_lease_hooks: list[KeepHook] = []


def keep_events(hook: KeepHook) -> KeepHook:
    """Register ``hook() -> Q`` over ``fleet.NodeEvent``: matching events are never pruned."""
    if hook not in _event_hooks:
        _event_hooks.append(hook)
    return hook


def keep_leases(hook: KeepHook) -> KeepHook:
    """Register ``hook() -> Q`` over ``leases.Lease``: matching ended leases are never pruned."""
    if hook not in _lease_hooks:
        _lease_hooks.append(hook)
    return hook


def _any(hooks: list[KeepHook]) -> Q | None:
    kept = None
    for hook in hooks:
        q = hook()
        kept = q if kept is None else kept | q
    return kept


def protected_events() -> Q | None:
    """The union of every event keep hook, or None when none is registered."""
    return _any(_event_hooks)


def protected_leases() -> Q | None:
    """The union of every lease keep hook, or None when none is registered."""
    return _any(_lease_hooks)


def policy() -> dict:
    """``{"max_age": timedelta, "keep_per_node": int, "keep_types": [...], "batch": int, "max_batches": int}``."""
    return {
        "max_age": timedelta(days=conf.get("RETENTION_DAYS")),
        "keep_per_node": conf.get("RETENTION_KEEP_EVENTS_PER_NODE"),
        "keep_types": list(conf.get("RETENTION_KEEP_EVENT_TYPES")),
        "batch": conf.get("RETENTION_BATCH"),
        "max_batches": conf.get("RETENTION_MAX_BATCHES"),
    }
