"""Pruning old events in bounded batches (the rules and the keep hook: nodepool/retention.py)."""

from __future__ import annotations

from datetime import datetime

from django.db.models import F, OuterRef, Q, Subquery
from django.utils import timezone

from nodepool import metrics, retention

from .models import NodeEvent


def prunable_events(*, now: datetime, max_age, keep_per_node: int, keep_types: list[str]):
    """Events older than ``now - max_age`` that no rule keeps (a queryset; nothing is deleted).

    A node's event is prunable only when it is older than the node's ``keep_per_node``-th newest
    event (served by the ``nodeevent_node_recent`` index), so the last N of every node survive
    however old they are.
    """
    cutoff = now - max_age
    events = NodeEvent.objects.filter(created_at__lt=cutoff).exclude(type__in=keep_types)
    if keep_per_node > 0:
        nth_newest = (
            NodeEvent.objects.filter(node_id=OuterRef("node_id"))
            .order_by("-created_at", "-id")
            .values("created_at")[keep_per_node - 1 : keep_per_node]
        )
        # A node with fewer than N events has no N-th newest (NULL): nothing of it is prunable.
        events = events.annotate(nth_newest=Subquery(nth_newest)).filter(
            Q(node__isnull=True) | Q(created_at__lt=F("nth_newest"))
        )
    kept = retention.protected_events()
    return events.exclude(kept) if kept is not None else events


def prune_events(*, now: datetime | None = None) -> dict:
    """Delete prunable events, at most ``batch × max_batches`` per run. Returns ``{"deleted", "more"}``.

    Safe to run twice at once: both delete by primary key from their own reads; a row already
    gone is simply not counted twice.
    """
    now = now or timezone.now()
    rules = retention.policy()
    query = prunable_events(
        now=now, max_age=rules["max_age"], keep_per_node=rules["keep_per_node"], keep_types=rules["keep_types"]
    )
    deleted = 0
    for _ in range(rules["max_batches"]):
        ids = list(query.order_by("created_at").values_list("pk", flat=True)[: rules["batch"]])
        if not ids:
            return {"deleted": deleted, "more": False}
        count, _ = NodeEvent.objects.filter(pk__in=ids).delete()
        deleted += count
        metrics.EVENTS_PRUNED.inc(count)
    return {"deleted": deleted, "more": True}
