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


class PoolPeriodState(models.TextChoices):
    """Where a pool's settlement period is in reconciliation (docs/marketplace.md, "Pool periods")."""

    PENDING = "pending", "pending (not over, or usage still inside its settlement window)"
    MISMATCHED = "mismatched", "mismatched (items wait for an operator)"
    RECONCILED = "reconciled", "reconciled (figures frozen)"


class MismatchKind(models.TextChoices):
    """Why a pool period does not reconcile by itself."""

    EVIDENCE_WITHOUT_LEASE = "evidence_without_lease", "evidence that matches no lease's history"
    USAGE_ABOVE_OFFERED = "usage_above_offered", "lease usage above what the node offered"
    IMPOSSIBLE_USAGE = "impossible_usage", "the node reported more than it has (usage record finding)"


class LineKind(models.TextChoices):
    """What a statement line pays for."""

    USAGE = "usage", "usage of one lease"
    IDLE = "idle", "idle capacity offered in a pool period (pools that pay idle)"
    CORRECTION = "correction", "a correction of an earlier line (appeal, payout reversal)"


class PayoutState(models.TextChoices):
    """A payout's life: nodepool records payments, it does not move money."""

    REQUESTED = "requested", "requested (waits for a second operator)"
    APPROVED = "approved", "approved (to be paid outside nodepool)"
    PAID = "paid", "paid (external reference recorded)"
    FAILED = "failed", "failed (may be requested again)"
    REVERSED = "reversed", "reversed (chargeback; a negative correction on the next statement)"


class HoldReason(models.TextChoices):
    """Why a final statement may not be paid yet (apart from quarantine-held usage)."""

    OUTLIER = "outlier", "far above the owner's previous comparable period (or the pool's median)"
    FLAGGED_LINE = "flagged_line", "a line is flagged for review (device fault, disputed record)"


class LineAppealState(models.TextChoices):
    OPEN = "open", "open (the line is not paid until resolved)"
    CORRECTED = "corrected", "resolved with a correction line on the next statement"
    REJECTED = "rejected", "rejected (the line stands)"
    WITHDRAWN = "withdrawn", "withdrawn by the owner"
