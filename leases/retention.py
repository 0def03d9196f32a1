"""Pruning ended leases in bounded batches (the rules and the keep hook: nodepool/retention.py)."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.db.models import ProtectedError
from django.utils import timezone

from nodepool import metrics, retention

from .choices import TERMINAL_LEASE_STATES
from .models import Lease


def prunable_leases(*, now: datetime, max_age):
    """Terminal leases that ended before ``now - max_age`` and no keep hook protects (a queryset)."""
    leases = Lease.objects.filter(state__in=TERMINAL_LEASE_STATES, ended_at__lt=now - max_age)
    kept = retention.protected_leases()
    return leases.exclude(kept) if kept is not None else leases


def prune_ended_leases(*, now: datetime | None = None) -> dict:
    """Delete prunable leases, at most ``batch × max_batches`` per run.

    Returns ``{"deleted", "skipped", "more"}``. A batch refused because some row is still
    referenced through a ``PROTECT`` foreign key is retried row by row, and the referenced leases
    are skipped (counted in ``skipped``), never forced.
    """
    now = now or timezone.now()
    rules = retention.policy()
    query = prunable_leases(now=now, max_age=rules["max_age"])
    deleted = skipped = 0
    skip: set = set()
    for _ in range(rules["max_batches"]):
        ids = list(query.exclude(pk__in=skip).order_by("ended_at").values_list("pk", flat=True)[: rules["batch"]])
        if not ids:
            metrics.LEASES_PRUNED.inc(deleted)
            return {"deleted": deleted, "skipped": skipped, "more": False}
        try:
            with transaction.atomic():
                Lease.objects.filter(pk__in=ids).delete()
            deleted += len(ids)
        except ProtectedError:
            for pk in ids:
                try:
                    with transaction.atomic():
                        Lease.objects.filter(pk=pk).delete()
                    deleted += 1
                except ProtectedError:
                    skip.add(pk)
                    skipped += 1
    metrics.LEASES_PRUNED.inc(deleted)
    return {"deleted": deleted, "skipped": skipped, "more": True}
