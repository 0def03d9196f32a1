"""Pool settlement periods and their mismatch items (docs/marketplace.md, "Pool periods").

Quantities are resource-seconds in priced units (core-seconds, GiB-seconds, unit-seconds) as
decimal strings: exact (a month of 1 TiB is 2.8e9 GiB-seconds; no column limits the digits).
Money is decimal strings in the pool's currency, rounded to cents, half up.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django_fsm import FSMField, transition

from nodepool.fsm import SerializedFSMRefresh

from ..choices import MismatchKind, PoolPeriodState, StatementPeriod


class PoolPeriod(SerializedFSMRefresh, models.Model):
    """One settlement period ``[period_start, period_end)`` (UTC) of one pool and its reconciliation.

    ``offered`` ``{resource: quantity}``: what the pool's nodes offered (availability evidence);
    ``usage`` and ``idle`` ``{owner id: {resource: quantity}}``; ``unallocated`` ``{resource:
    quantity}`` the remainder, so that per resource ``offered == Σ usage + Σ idle + unallocated``
    exactly. ``money`` ``{"currency", "offered", "usage": {owner: amount}, "idle": {owner: amount},
    "unallocated"}`` with the same identity in cents (rounding residue and unpaid idle are booked
    to ``unallocated``). Frozen once ``reconciled``.
    """

    pool = models.ForeignKey("fleet.Pool", on_delete=models.PROTECT, related_name="settlement_periods")
    period = models.CharField(max_length=8, choices=StatementPeriod.choices)
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    state = FSMField(max_length=12, choices=PoolPeriodState.choices, default=PoolPeriodState.PENDING, protected=True)
    offered = models.JSONField(default=dict, blank=True)
    usage = models.JSONField(default=dict, blank=True)
    idle = models.JSONField(default=dict, blank=True)
    unallocated = models.JSONField(default=dict, blank=True)
    money = models.JSONField(default=dict, blank=True)
    idle_paid = models.BooleanField(default=False)
    waiting_for = models.TextField(blank=True, help_text="Why it is still pending.")
    runs = models.PositiveIntegerField(default=0)
    reconciled_at = models.DateTimeField(null=True, blank=True)
    reconciled_by = models.CharField(max_length=150, blank=True)
    mismatched_since = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["-period_start", "pool_id"]
        constraints = [
            models.UniqueConstraint(fields=["pool", "period_start"], name="poolperiod_one_per_start"),
        ]
        indexes = [models.Index(fields=["state", "period_end"], name="poolperiod_state")]

    def __str__(self) -> str:
        return f"{self.pool_id} {self.period_start:%Y-%m-%d}–{self.period_end:%Y-%m-%d} ({self.state})"

    # --- transitions: memory only (marketplace.periods saves and logs) ------------------------------
    @transition(
        field=state, source=[PoolPeriodState.PENDING, PoolPeriodState.MISMATCHED], target=PoolPeriodState.RECONCILED
    )
    def reconcile(self):
        pass

    @transition(
        field=state, source=[PoolPeriodState.PENDING, PoolPeriodState.MISMATCHED], target=PoolPeriodState.MISMATCHED
    )
    def mismatch(self):
        pass


class MismatchItem(models.Model):
    """One reason a pool period does not reconcile by itself; an operator resolves it with a reason.

    ``key`` identifies the item within its period and kind (``usage_record:<id>``,
    ``node:<id>:<resource>``), so a re-run finds the items it listed before instead of adding them
    again. ``detail`` carries the figures (quantities as decimal strings).
    """

    period = models.ForeignKey(PoolPeriod, on_delete=models.PROTECT, related_name="mismatch_items")
    kind = models.CharField(max_length=24, choices=MismatchKind.choices)
    key = models.CharField(max_length=120)
    node = models.ForeignKey("fleet.Node", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    usage_record = models.ForeignKey(
        "marketplace.UsageRecord", null=True, blank=True, on_delete=models.PROTECT, related_name="mismatch_items"
    )
    message = models.TextField()
    detail = models.JSONField(default=dict, blank=True)
    resolution = models.TextField(blank=True)
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    resolved_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["period_id", "id"]
        constraints = [
            models.UniqueConstraint(fields=["period", "kind", "key"], name="mismatch_one_per_key"),
        ]
        indexes = [
            models.Index(fields=["period"], condition=Q(resolved_at__isnull=True), name="mismatch_unresolved"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.key} ({'resolved' if self.resolved_at else 'open'})"
