from django.db import models


class UsageState(models.TextChoices):
    """Where a usage record is in reconciliation (docs/marketplace.md)."""

    PENDING = "pending", "pending (inside its settlement window)"
    RECONCILED = "reconciled", "reconciled"
    ADJUSTED = "adjusted", "adjusted (billable quantity changed, with why)"
    DISPUTED = "disputed", "disputed (an operator decides)"
    HELD = "held", "held (its node was quarantined during the lease)"


# Outcomes that may be paid: a statement line in one of these is "reconciled".
PAYABLE_STATES = (UsageState.RECONCILED, UsageState.ADJUSTED)
# Outcomes reconciliation may still change (a held record is re-run once its quarantine is released).
OPEN_STATES = (UsageState.PENDING, UsageState.HELD)


class GapReason(models.TextChoices):
    """Why part of a lease's life is not evidenced (and not billable)."""

    NOT_STARTED = "not_started", "before the node first listed the lease"
    NOT_REPORTED = "not_reported", "a status report omitted the lease"
    STALE_INCARNATION = "stale_incarnation", "the node restarted (new incarnation)"
    TOKEN_MISMATCH = "token_mismatch", "the node listed the lease with another fencing token"
    SILENCE = "silence", "nothing heard from the node for longer than the pool's grace"
    UNREACHABLE = "unreachable", "the node was unreachable"
    AFTER_LAST_REPORT = "after_last_report", "after the node last listed the lease"


class StatementState(models.TextChoices):
    OPEN = "open", "open"
    FINAL = "final", "final (immutable; the hand-off to payment)"


class StatementPeriod(models.TextChoices):
    """How an owner's statements are cut (UTC)."""

    MONTH = "month", "calendar month"
    WEEK = "week", "ISO week (Monday to Monday)"
    DAY = "day", "day"


class AppealState(models.TextChoices):
    OPEN = "open", "open (waiting for an operator)"
    UPHELD = "upheld", "upheld (the quarantine stands)"
    OVERTURNED = "overturned", "overturned (the quarantine was wrong; node released)"
    WITHDRAWN = "withdrawn", "withdrawn by the owner"


APPEAL_OUTCOMES = (AppealState.UPHELD, AppealState.OVERTURNED)


class DisputeDecision(models.TextChoices):
    """An operator's resolution of a disputed usage record."""

    ACCEPT = "accept", "pay the evidenced time"
    ADJUST = "adjust", "pay an adjusted quantity"
    REJECT = "reject", "pay nothing"
