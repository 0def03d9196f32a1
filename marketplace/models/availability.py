"""Node availability evidence: the intervals in which a node offered its allocatable capacity
(docs/marketplace.md, "Availability evidence").

Recorded from status reports (a status-report handler of ``fleet.instructions``, registered in
MarketplaceConfig.ready()): pool periods (marketplace.periods) split what nodes offered into
owners' lease usage, idle capacity and an unallocated remainder.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q


class AvailabilityClose(models.TextChoices):
    """Why an availability interval ended."""

    RESTART = "restart", "the node restarted (new incarnation)"
    CHANGED = "changed", "the node changed (lifecycle, capacity, pool: its version moved)"
    SILENCE = "silence", "nothing heard for longer than the pool's grace"
    CUT = "cut", "cut after its longest span (the capacity snapshot is taken again)"
    NOT_OFFERING = "not_offering", "the node stopped offering (not ready, cordoned or draining)"


class NodeAvailability(models.Model):
    """One span in which a node reported while offering capacity: ``[started_at, last_seen_at]``
    (only the time between two status reports counts, as for lease evidence), with the node's
    ``allocatable`` capacity at its start (``{resource: canonical int}``: millicores, bytes,
    units), its incarnation and the node ``version`` it was opened under (any change of the node
    that bumps its version — lifecycle, pool, capacity reservations through the admin — starts
    a new interval with a new snapshot).

    One open interval per node (``ended_at`` null), enforced by the database: two racing status
    reports cannot open two.
    """

    node = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="+")
    pool = models.ForeignKey("fleet.Pool", on_delete=models.PROTECT, related_name="+")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    incarnation = models.PositiveBigIntegerField()
    node_version = models.PositiveIntegerField()
    allocatable = models.JSONField(default=dict)
    started_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(max_length=16, choices=AvailabilityClose.choices, blank=True)

    class Meta:
        ordering = ["started_at", "id"]
        verbose_name_plural = "node availability"
        constraints = [
            models.UniqueConstraint(
                fields=["node"], condition=Q(ended_at__isnull=True), name="availability_one_open_per_node"
            ),
        ]
        indexes = [
            # A pool period's reconciliation: the intervals of a pool overlapping [start, end).
            models.Index(fields=["pool", "last_seen_at"], name="availability_pool_recent"),
        ]

    def __str__(self) -> str:
        return f"node {self.node_id} available {self.started_at:%Y-%m-%d %H:%M}–{self.last_seen_at:%H:%M}"
