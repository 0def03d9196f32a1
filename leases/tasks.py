"""Celery tasks: thin wrappers over :mod:`leases.sweeps` (each safe to run twice at once)."""

from __future__ import annotations

from celery import shared_task

from fleet.events import Actor

from . import sweeps
from .preview import refresh_request_class_fits
from .retention import prune_ended_leases


@shared_task(name="leases.expire_leases", bind=True, ignore_result=True)
def expire_leases(self) -> int:
    return sweeps.expire_leases(actor=Actor.system("leases.expire_leases", self.request.id or ""))


@shared_task(name="leases.place_pending_requests", bind=True, ignore_result=True)
def place_pending_requests(self) -> dict:
    return sweeps.place_pending_requests(actor=Actor.system("leases.place_pending_requests", self.request.id or ""))


@shared_task(name="leases.check_consistency", bind=True, ignore_result=True)
def check_consistency(self) -> int:
    report = sweeps.check_consistency(actor=Actor.system("leases.check_consistency", self.request.id or ""))
    return len(report.drift)


@shared_task(name="leases.evict_noexecute", bind=True, ignore_result=True)
def evict_noexecute(self) -> int:
    return sweeps.evict_noexecute(actor=Actor.system("leases.evict_noexecute", self.request.id or ""))


@shared_task(name="leases.prune_ended_leases", ignore_result=True)
def prune_ended_leases_task() -> dict:
    """Beat: delete long-ended leases in bounded batches (leases/retention.py)."""
    return prune_ended_leases()


@shared_task(name="leases.refresh_request_class_fits", ignore_result=True)
def refresh_request_class_fits_task() -> int:
    """Beat: recompute each pool's "can serve N now" per request class (leases/preview.py)."""
    return refresh_request_class_fits()
