"""Payouts, payout holds and appeals of statement lines (docs/marketplace.md, "Payouts").

nodepool records payments; it does not move money. A payout says that one final statement's total
in one currency (minus the lines under open appeal) was requested, approved by a second operator,
and paid outside nodepool (the external reference), or failed, or was reversed later.
"""

from __future__ import annotations

import uuid
from decimal import Decimal

from django.conf import settings
from django.db import models
from django.db.models import Q
from django_fsm import FSMField, transition

from nodepool.fsm import SerializedFSMRefresh

from ..choices import HoldReason, LineAppealState, PayoutState


class Payout(SerializedFSMRefresh, models.Model):
    """One payout of one final statement in one currency: at most one per (statement, currency),
    enforced by the database. ``uid`` is the stable id of exports and webhooks (a re-import keyed
    on it is idempotent). ``excluded_lines`` lists the line ids under open appeal when the amount
    was computed (``amount = statement total − those lines``)."""

    uid = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    statement = models.ForeignKey("marketplace.Statement", on_delete=models.PROTECT, related_name="payouts")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="payouts")
    currency = models.CharField(max_length=3)
    amount = models.DecimalField(max_digits=18, decimal_places=2)
    excluded_lines = models.JSONField(default=list, blank=True)
    state = FSMField(max_length=12, choices=PayoutState.choices, default=PayoutState.REQUESTED, protected=True)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    requested_at = models.DateTimeField()
    approved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    approved_at = models.DateTimeField(null=True, blank=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    external_reference = models.CharField(max_length=200, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    failure_reason = models.TextField(blank=True)
    reversed_at = models.DateTimeField(null=True, blank=True)
    reversal_reason = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["-requested_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["statement", "currency"], name="payout_one_per_statement_currency"),
            models.CheckConstraint(condition=Q(amount__gte=Decimal(0)), name="payout_not_negative"),
        ]
        indexes = [models.Index(fields=["state", "requested_at"], name="payout_queue")]

    def __str__(self) -> str:
        return f"payout {self.uid} {self.amount} {self.currency} ({self.state})"

    # --- transitions: memory only (marketplace.payouts saves and logs) ------------------------------
    @transition(field=state, source=PayoutState.REQUESTED, target=PayoutState.APPROVED)
    def approve(self):
        pass

    @transition(field=state, source=PayoutState.APPROVED, target=PayoutState.PAID)
    def pay(self):
        pass

    @transition(field=state, source=PayoutState.APPROVED, target=PayoutState.FAILED)
    def fail(self):
        pass

    @transition(field=state, source=PayoutState.FAILED, target=PayoutState.REQUESTED)
    def request_again(self):
        pass

    @transition(field=state, source=PayoutState.PAID, target=PayoutState.REVERSED)
    def reverse(self):
        pass


class PayoutDelivery(models.Model):
    """One signed webhook notice of a payout transition: the outbox of ``marketplace.webhooks``.

    Written in the transition's transaction when ``NODEPOOL_PAYOUT_WEBHOOK_URL`` is set, sent after
    commit by a Celery task and, when that failed or the broker was down, again by the beat sweep
    at ``next_attempt_at`` (backoff) until ``delivered_at`` is set or ``attempts`` reaches the
    limit. ``delivery_id`` is in the signed body and the ``X-Nodepool-Delivery`` header: a receiver
    drops a repeat. ``body`` is the JSON object sent, fixed when the transition happened."""

    delivery_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    payout = models.ForeignKey(Payout, on_delete=models.PROTECT, related_name="deliveries")
    body = models.JSONField()
    created_at = models.DateTimeField()
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [
            models.Index(fields=["next_attempt_at"], condition=Q(delivered_at__isnull=True), name="payoutdelivery_due")
        ]

    def __str__(self) -> str:
        return f"delivery {self.delivery_id} of payout {self.payout_id} ({'sent' if self.delivered_at else 'pending'})"


class PayoutHold(models.Model):
    """A final statement that may not be paid until an operator releases it with a reason (apart
    from quarantine-held usage, ``UsageRecord.held_by``). One per (statement, reason)."""

    statement = models.ForeignKey("marketplace.Statement", on_delete=models.PROTECT, related_name="payout_holds")
    reason = models.CharField(max_length=16, choices=HoldReason.choices)
    message = models.TextField()
    detail = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField()
    released_at = models.DateTimeField(null=True, blank=True)
    released_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    release_reason = models.TextField(blank=True)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["statement", "reason"], name="payouthold_one_per_reason")]
        indexes = [models.Index(fields=["created_at"], condition=Q(released_at__isnull=True), name="payouthold_open")]

    def __str__(self) -> str:
        return f"hold {self.reason} on statement {self.statement_id} ({'released' if self.released_at else 'open'})"


class LineAppeal(SerializedFSMRefresh, models.Model):
    """An owner contesting one line of a final statement before it is paid (apart from quarantine
    appeals, ``marketplace.Appeal``). Resolving it ``corrected`` adds a correction line to the
    owner's next open statement (``correction_line``); the original line is never edited."""

    line = models.ForeignKey("marketplace.StatementLine", on_delete=models.PROTECT, related_name="appeals")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="line_appeals")
    message = models.TextField()
    state = FSMField(max_length=12, choices=LineAppealState.choices, default=LineAppealState.OPEN, protected=True)
    resolution = models.TextField(blank=True)
    correction_amount = models.DecimalField(max_digits=18, decimal_places=2, null=True, blank=True)
    correction_line = models.OneToOneField(
        "marketplace.StatementLine", null=True, blank=True, on_delete=models.PROTECT, related_name="correcting_appeal"
    )
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    resolved_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # One appeal per line (a withdrawn one does not count): a second is refused.
            models.UniqueConstraint(fields=["line"], condition=~Q(state="withdrawn"), name="lineappeal_one_per_line"),
        ]
        indexes = [models.Index(fields=["state", "created_at"], name="lineappeal_queue")]

    def __str__(self) -> str:
        return f"appeal of line {self.line_id} ({self.state})"

    @transition(field=state, source=LineAppealState.OPEN, target=LineAppealState.CORRECTED)
    def correct(self):
        pass

    @transition(field=state, source=LineAppealState.OPEN, target=LineAppealState.REJECTED)
    def reject(self):
        pass

    @transition(field=state, source=LineAppealState.OPEN, target=LineAppealState.WITHDRAWN)
    def withdraw(self):
        pass
