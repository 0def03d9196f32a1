"""Signals leases sends (for higher apps), the queue kick when a node may have become
schedulable (saved as ready + alive), and lease expiry paused across a detected gap of the
control plane's clock. The receivers that reconcile or end leases are leases.receivers (they sit
above leases.lifecycle, which sends ``lease_ended`` from here)."""

from django.db import transaction
from django.db.models import F
from django.db.models.signals import post_save
from django.dispatch import Signal, receiver

from fleet.choices import Lifecycle, Liveness
from fleet.clock import clock_gap_detected
from fleet.models import Node

from . import kick
from .choices import LIVE_LEASE_STATES
from .models import Lease

# Sent by leases.lifecycle.end_lease inside the transaction that ended the lease, exactly once per
# lease (the compare-and-swap winner), with ``lease`` (the ended Lease), ``actor`` and ``now``.
# The marketplace app opens the lease's usage record here (marketplace.apps).
lease_ended = Signal()


def _kick() -> None:
    """Place queued requests once the current transaction commits (kick_queue itself checks for
    pending requests and deduplicates kicks)."""
    transaction.on_commit(kick.kick_queue)


@receiver(post_save, sender=Node, dispatch_uid="leases.node_saved_kicks_queue")
def node_saved(sender, instance: Node, **kwargs):
    """A node saved as ready and alive (admission done, a hold lifted…) may take queued work."""
    # Cheap test first: only nodes that look schedulable can place anything.
    if (
        instance.lifecycle == Lifecycle.READY
        and instance.liveness == Liveness.ALIVE
        and instance.ready
        and not instance.cordoned
    ):
        _kick()


def status_report_kicks_queue(sender, node: Node, **kwargs):
    """A status-report handler (fleet.instructions): a status report is applied by one conditional UPDATE,
    not a save, and it is what turns a node ready (its Ready condition) or alive again: without
    this kick, a node admitted before its first ready report left queued requests to beat's next
    pass (seen in CI's autoscaling run). Returns no instructions.

    Reads only what the report itself set (the heartbeat's node has its other fields deferred:
    reading them would cost queries on the hot path); kick_queue is deduplicated and placement
    judges schedulability itself."""
    if node.ready and node.liveness == Liveness.ALIVE:
        _kick()


def revived_node_kicks_queue(sender, node_id, **kwargs):
    """fleet.signals.node_revived: a renewal brought a node back to ``alive``; it may take queued
    work again (placement judges the rest)."""
    _kick()


@receiver(clock_gap_detected, dispatch_uid="leases.pause_lease_expiry_across_a_clock_gap")
def pause_lease_expiry(sender, *, started_at, paused, **kwargs) -> dict:
    """A detected forward gap of the control plane's clock (fleet.clock): live leases that had not
    expired when it began expire that much later, as if the clock had stood still."""
    shifted = Lease.objects.filter(state__in=LIVE_LEASE_STATES, expires_at__gt=started_at).update(
        expires_at=F("expires_at") + paused
    )
    return {"leases": shifted}
