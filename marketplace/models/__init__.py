"""Marketplace records: pool prices, usage records, statements and their lines, appeals, and the
per-owner and per-pool settings they follow (docs/marketplace.md).

Money is ``Decimal`` with an ISO 4217 currency code, never a float. Time quantities are seconds.
"""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.db.models import Q
from django_fsm import FSMField, transition

from leases.models import Lease
from maintenance.models import Quarantine
from nodepool.fsm import SerializedFSMRefresh

from ..choices import AppealState, LineKind, StatementPeriod, StatementState, UsageState

currency_code = RegexValidator(r"^[A-Z]{3}$", "An ISO 4217 currency code: three capital letters (EUR, USD).")


class PoolPrice(models.Model):
    """The price of one resource-hour in one pool from ``effective_from`` on (versioned).

    A change of price is a new row; a row is never edited, so every statement can be recomputed
    from the prices in force at the time. Units: ``cpu`` per core-hour, ``memory`` and
    ``ephemeral-storage`` per GiB-hour, any other resource per unit-hour (marketplace.pricing).
    """

    pool = models.ForeignKey("fleet.Pool", on_delete=models.PROTECT, related_name="prices")
    resource = models.CharField(max_length=63)
    unit_price = models.DecimalField(max_digits=18, decimal_places=6, validators=[MinValueValidator(Decimal(0))])
    currency = models.CharField(max_length=3, validators=[currency_code])
    effective_from = models.DateTimeField()
    note = models.CharField(max_length=200, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["pool", "resource", "effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["pool", "resource", "effective_from"], name="poolprice_unique_version"),
            models.CheckConstraint(condition=Q(unit_price__gte=0), name="poolprice_not_negative"),
        ]

    def __str__(self) -> str:
        since = f"{self.effective_from:%Y-%m-%d %H:%M}"
        return f"{self.pool_id}/{self.resource}: {self.unit_price} {self.currency} from {since}"


class PoolSettlement(models.Model):
    """A pool's settlement window: how long after a lease ends its usage is reconciled.

    Empty means the default: the larger of ``NODEPOOL["SETTLEMENT_WINDOW_MIN"]`` (15 minutes) and
    twice the pool's loss threshold as scaled at the time (marketplace.reconciliation).
    """

    pool = models.OneToOneField("fleet.Pool", on_delete=models.CASCADE, related_name="settlement")
    settlement_window = models.PositiveIntegerField(null=True, blank=True, help_text="Seconds; empty = default.")
    # Pool periods and payouts (marketplace.periods, marketplace.payouts).
    period = models.CharField(
        max_length=8, choices=StatementPeriod.choices, default=StatementPeriod.MONTH, help_text="Pool period (UTC)."
    )
    idle_paid = models.BooleanField(default=False, help_text="Pay owners for idle capacity at the price in force.")
    hold_multiple = models.DecimalField(
        max_digits=8,
        decimal_places=2,
        default=Decimal(10),
        validators=[MinValueValidator(Decimal(1))],
        help_text="A statement above this multiple of the comparable amount is held for review.",
    )
    appeal_alert_after = models.PositiveIntegerField(
        default=7 * 86400, help_text="Seconds an appeal of a line may stay open before the alert."
    )
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"settlement of {self.pool_id}: {self.settlement_window or 'default'}"


class OwnerSettings(models.Model):
    """How one owner's statements are cut (a calendar month in UTC unless set otherwise)."""

    owner = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="marketplace")
    statement_period = models.CharField(max_length=8, choices=StatementPeriod.choices, default=StatementPeriod.MONTH)

    class Meta:
        verbose_name_plural = "owner settings"

    def __str__(self) -> str:
        return f"{self.owner}: {self.statement_period}"


class UsageRecord(SerializedFSMRefresh, models.Model):
    """The usage of one ended lease: where it ran, for whom, what it held, what evidence shows.

    ``billable_intervals`` is ``[[start ISO, end ISO], ...]`` (the evidence that survived
    reconciliation), ``gaps`` ``[{"start", "end", "seconds", "reason"}]`` (:class:`GapReason`),
    ``findings`` ``[{"code", "message"}]`` (why adjusted, disputed or held), ``adjustment``
    ``{"quantity_seconds", "evidenced_seconds", "why"}`` when adjusted or resolved by an operator.
    The lease is PROTECTed: neither it nor its evidence can be deleted while this record exists.
    """

    lease = models.OneToOneField("leases.Lease", on_delete=models.PROTECT, related_name="usage_record")
    node = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="usage_records")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="usage_records"
    )
    pool = models.ForeignKey("fleet.Pool", on_delete=models.PROTECT, related_name="usage_records")
    workload_id = models.CharField(max_length=200)
    fencing_token = models.PositiveBigIntegerField()
    resources = models.JSONField(default=dict)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField()
    lease_state = models.CharField(max_length=16)
    outcome = models.CharField(max_length=32, blank=True)
    settle_after = models.DateTimeField()
    state = FSMField(max_length=16, choices=UsageState.choices, default=UsageState.PENDING, protected=True)
    allocated_seconds = models.DecimalField(max_digits=14, decimal_places=3, default=Decimal(0))
    evidenced_seconds = models.DecimalField(max_digits=14, decimal_places=3, default=Decimal(0))
    billable_seconds = models.DecimalField(max_digits=14, decimal_places=3, default=Decimal(0))
    billable_intervals = models.JSONField(default=list, blank=True)
    gaps = models.JSONField(default=list, blank=True)
    findings = models.JSONField(default=list, blank=True)
    adjustment = models.JSONField(default=dict, blank=True)
    held_by = models.ForeignKey(
        "maintenance.Quarantine", null=True, blank=True, on_delete=models.PROTECT, related_name="held_usage"
    )
    reconciled_at = models.DateTimeField(null=True, blank=True)
    reconciled_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["-ended_at", "-id"]
        indexes = [
            # The reconciliation sweep: records whose settlement window has passed.
            models.Index(fields=["settle_after"], name="usage_due", condition=Q(state__in=["pending", "held"])),
            models.Index(fields=["owner", "-ended_at"], name="usage_owner_recent"),
        ]

    def __str__(self) -> str:
        return f"usage of {self.workload_id}#{self.fencing_token} ({self.state})"

    # --- transitions: the declared graph. marketplace.reconciliation moves the row with a claim built
    # from these declarations (nodepool.fsm.move: WHERE state IN the sources, SET state = the target),
    # in its transaction, and records the event. Reconciliation settles an open record once its
    # settlement window has passed; an operator decides a disputed (or held) one.
    @transition(field=state, source=[UsageState.PENDING, UsageState.HELD], target=UsageState.RECONCILED)
    def reconcile(self):
        pass

    @transition(field=state, source=[UsageState.PENDING, UsageState.HELD], target=UsageState.ADJUSTED)
    def adjust(self):
        pass

    @transition(field=state, source=[UsageState.PENDING, UsageState.HELD], target=UsageState.DISPUTED)
    def dispute(self):
        pass

    @transition(field=state, source=UsageState.PENDING, target=UsageState.HELD)
    def hold(self):
        pass

    @transition(field=state, source=[UsageState.DISPUTED, UsageState.HELD], target=UsageState.RECONCILED)
    def accept_dispute(self):
        pass

    @transition(field=state, source=[UsageState.DISPUTED, UsageState.HELD], target=UsageState.ADJUSTED)
    def adjust_dispute(self):
        pass

    @transition(field=state, source=[UsageState.DISPUTED, UsageState.HELD], target=UsageState.ADJUSTED)
    def reject_dispute(self):
        pass


class Statement(SerializedFSMRefresh, models.Model):
    """One owner's statement for one period ``[period_start, period_end)`` (UTC).

    ``open`` while lines may change; ``final`` once every line is reconciled (held and disputed
    lines carried to the next period first). A final statement is immutable: the hand-off point to
    whatever pays owners. ``totals`` is ``{currency: "decimal string"}``, set when it is finalized;
    ``carried_out`` lists the lines moved on: ``[{"usage_record", "state", "reason", "to_statement"}]``.
    """

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="statements")
    period = models.CharField(max_length=8, choices=StatementPeriod.choices, default=StatementPeriod.MONTH)
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    state = FSMField(max_length=8, choices=StatementState.choices, default=StatementState.OPEN, protected=True)
    totals = models.JSONField(default=dict, blank=True)
    carried_out = models.JSONField(default=list, blank=True)
    finalized_at = models.DateTimeField(null=True, blank=True)
    finalized_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["-period_start", "owner_id"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "period_start"], name="statement_one_per_owner_period"),
        ]

    def __str__(self) -> str:
        return f"{self.owner} {self.period_start:%Y-%m-%d}–{self.period_end:%Y-%m-%d} ({self.state})"

    def save(self, *args, **kwargs):
        if self.pk and Statement.objects.filter(pk=self.pk, state=StatementState.FINAL).exists():
            raise ValidationError("A final statement is immutable.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        if self.state == StatementState.FINAL:
            raise ValidationError("A final statement is immutable.")
        return super().delete(*args, **kwargs)

    # --- transitions: marketplace.statements.finalize_statement moves the row (nodepool.fsm.move) ---
    @transition(field=state, source=StatementState.OPEN, target=StatementState.FINAL)
    def finalize(self):
        pass


class StatementLine(models.Model):
    """One usage record on one statement. ``quantities`` is ``{resource: "resource-hours"}`` of
    billable time; ``amount`` is counted only when ``state`` is reconciled or adjusted. A usage
    record is on exactly one line; a held or disputed line moves to the next period
    (``carried_from`` says from where) and keeps its ``reason``."""

    statement = models.ForeignKey(Statement, on_delete=models.PROTECT, related_name="lines")
    kind = models.CharField(max_length=12, choices=LineKind.choices, default=LineKind.USAGE)
    usage_record = models.OneToOneField(
        UsageRecord, null=True, blank=True, on_delete=models.PROTECT, related_name="statement_line"
    )
    # A correction names the line it corrects (an appeal) or the payout it reverses; an idle line
    # the pool period it pays. The original line is never edited.
    corrects = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT, related_name="corrections")
    reverses = models.ForeignKey(
        "marketplace.Payout", null=True, blank=True, on_delete=models.PROTECT, related_name="reversal_lines"
    )
    pool_period = models.ForeignKey(
        "marketplace.PoolPeriod", null=True, blank=True, on_delete=models.PROTECT, related_name="idle_lines"
    )
    # Not a state machine: the line reports its usage record's state (copied with the line's figures
    # by marketplace.statements, never moved on its own); a correction or idle line is reconciled.
    state = models.CharField(max_length=16, choices=UsageState.choices)
    node_id_text = models.CharField("node", max_length=64)
    pool_name = models.CharField(max_length=63)
    allocated_seconds = models.DecimalField(max_digits=14, decimal_places=3, default=Decimal(0))
    billable_seconds = models.DecimalField(max_digits=14, decimal_places=3, default=Decimal(0))
    coverage = models.DecimalField(max_digits=7, decimal_places=4, default=Decimal(0))
    quantities = models.JSONField(default=dict, blank=True)
    amount = models.DecimalField(max_digits=18, decimal_places=2, default=Decimal(0))
    currency = models.CharField(max_length=3, blank=True)
    reason = models.TextField(blank=True)
    carried_from = models.ForeignKey(
        Statement, null=True, blank=True, on_delete=models.PROTECT, related_name="carried_lines"
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(kind="usage", usage_record__isnull=False) | ~Q(kind="usage"), name="line_usage_has_record"
            ),
            # Idle capacity of one pool period is paid once per owner's statement line.
            models.UniqueConstraint(
                fields=["statement", "pool_period"], condition=Q(kind="idle"), name="line_one_idle_per_period"
            ),
        ]

    def __str__(self) -> str:
        subject = self.usage_record_id if self.kind == LineKind.USAGE else self.kind
        return f"line {subject}: {self.amount} {self.currency} ({self.state})"

    def save(self, *args, **kwargs):
        if Statement.objects.filter(pk=self.statement_id, state=StatementState.FINAL).exists():
            raise ValidationError("Lines of a final statement are immutable.")
        super().save(*args, **kwargs)


class QuarantineGuidance(models.Model):
    """What an owner can do next about a quarantine, per rule (``manual`` for operators' own),
    written by operators and shown on the owner's quarantined node."""

    rule = models.CharField(max_length=32, unique=True)
    next_steps = models.TextField()
    updated_by = models.CharField(max_length=150, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["rule"]
        verbose_name_plural = "quarantine guidance"

    def __str__(self) -> str:
        return self.rule


class Appeal(SerializedFSMRefresh, models.Model):
    """An owner contesting a quarantine of their node; operators resolve it from a queue."""

    quarantine = models.ForeignKey("maintenance.Quarantine", on_delete=models.PROTECT, related_name="appeals")
    node = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="appeals")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="appeals")
    statement = models.TextField(help_text="The owner's case.")
    state = FSMField(max_length=16, choices=AppealState.choices, default=AppealState.OPEN, protected=True)
    resolution = models.TextField(blank=True, help_text="The operator's answer, shown to the owner.")
    resolved_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["quarantine"], condition=Q(state="open"), name="appeal_one_open_per_quarantine"
            ),
        ]
        indexes = [models.Index(fields=["state", "created_at"], name="appeal_queue")]

    def __str__(self) -> str:
        return f"appeal of quarantine {self.quarantine_id} ({self.state})"

    # --- transitions: marketplace.appeals moves the row (nodepool.fsm.move) and records the event ----
    @transition(field=state, source=AppealState.OPEN, target=AppealState.UPHELD)
    def uphold(self):
        pass

    @transition(field=state, source=AppealState.OPEN, target=AppealState.OVERTURNED)
    def overturn(self):
        pass

    @transition(field=state, source=AppealState.OPEN, target=AppealState.WITHDRAWN)
    def withdraw(self):
        pass


class OwnedLease(Lease):
    """A lease as its node's owner sees it in the admin (no client-private fields)."""

    class Meta:
        proxy = True
        verbose_name = "lease on my nodes"
        verbose_name_plural = "leases on my nodes"


class OwnedQuarantine(Quarantine):
    """A quarantine as its node's owner sees it: reason, public evidence, next steps, appeals."""

    class Meta:
        proxy = True
        verbose_name = "quarantine of my node"
        verbose_name_plural = "quarantines of my nodes"


# The money models live in modules of this package (small files); Django finds them through here.
from .availability import AvailabilityClose, NodeAvailability  # noqa: E402, F401
from .payouts import LineAppeal, Payout, PayoutDelivery, PayoutHold  # noqa: E402, F401
from .periods import MismatchItem, PoolPeriod  # noqa: E402, F401
