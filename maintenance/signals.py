"""Maintenance's receivers of fleet's signals."""

from __future__ import annotations

from django.db.models import F
from django.dispatch import receiver

from fleet.clock import clock_gap_detected
from fleet.models import NodeHold

from .choices import DrainState
from .models import Drain


@receiver(clock_gap_detected, dispatch_uid="maintenance.pause_deadlines_across_a_clock_gap")
def pause_deadlines(sender, *, started_at, paused, **kwargs) -> dict:
    """A detected forward gap of the control plane's clock (fleet.clock): active drains' deadlines
    and expiring holds that had not passed when it began move later by the paused length. A drain's
    queued deadline task then fires early, finds the deadline not due, and changes nothing."""
    drains = Drain.objects.filter(state=DrainState.ACTIVE, deadline__gt=started_at).update(
        deadline=F("deadline") + paused
    )
    holds = NodeHold.objects.filter(removed_at__isnull=True, expires_at__gt=started_at).update(
        expires_at=F("expires_at") + paused
    )
    return {"drain_deadlines": drains, "holds": holds}
