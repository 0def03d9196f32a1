"""Payout holds (docs/marketplace.md, "Payout holds"): placed when a statement is finalized
(:func:`evaluate_holds`, called by ``marketplace.statements.finalize_statement``) and released by an
operator with a reason; a payout is refused while its statement has an open hold."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from statistics import median

from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from fleet.events import Actor
from fleet.models import Pool
from nodepool.api.problems import Conflict, NotFound
from nodepool.api.versioning import check_version

from .choices import PAYABLE_STATES, HoldReason, LineKind, StatementState
from .errors import HOLD_RELEASED, PAYOUT_HOLD_NOT_FOUND, STATEMENT_ON_HOLD
from .models import PayoutHold, PoolSettlement, Statement, StatementLine
from .money_common import money_event, required_text

DEFAULT_HOLD_MULTIPLE = Decimal(10)
# Findings of a usage record that flag its line for review: a device fault during the lease (the
# devices issue), usage after the node failed a re-verification (fleet.reverification), and a
# record that was disputed (an operator settled it).
REVIEW_FINDINGS = frozenset({"device_fault", "node_deverified", "impossible_usage", "absent_usage"})


def statement_pools(statement: Statement) -> list[int]:
    """The pools of the statement's lines (usage records' pools, idle lines' periods, names otherwise)."""
    pools = set(statement.lines.exclude(usage_record=None).values_list("usage_record__pool_id", flat=True))
    pools |= set(statement.lines.exclude(pool_period=None).values_list("pool_period__pool_id", flat=True))
    names = set(statement.lines.filter(usage_record=None, pool_period=None).values_list("pool_name", flat=True))
    pools |= set(Pool.objects.filter(name__in=names - {""}).values_list("pk", flat=True))
    return sorted(pools)


# --- holds ----------------------------------------------------------------------------------------
def _hold_multiple(pool_ids) -> Decimal:
    multiples = list(PoolSettlement.objects.filter(pool_id__in=pool_ids).values_list("hold_multiple", flat=True))
    return min(multiples) if multiples else DEFAULT_HOLD_MULTIPLE


def comparable_amount(statement: Statement, currency: str) -> tuple[Decimal | None, str]:
    """What an outlier is measured against (docs/marketplace.md, "Payout holds"):

    the owner's previous final statement of the same period kind, when it paid something in this
    currency; otherwise the median per-node amount of the statement's pools over the same period
    (usage lines of every owner whose lease ended in it) times the owner's node count. ``None``
    when neither exists (nothing to compare: no outlier hold).
    """
    previous = (
        Statement.objects.filter(
            owner_id=statement.owner_id,
            period=statement.period,
            state=StatementState.FINAL,
            period_end__lte=statement.period_start,
        )
        .order_by("-period_start")
        .first()
    )
    if previous is not None and Decimal(previous.totals.get(currency, "0")) > 0:
        return Decimal(previous.totals[currency]), f"previous statement {previous.pk}"
    pools = statement_pools(statement)
    per_node = (
        StatementLine.objects.filter(
            kind=LineKind.USAGE,
            currency=currency,
            state__in=PAYABLE_STATES,
            usage_record__pool_id__in=pools,
            usage_record__ended_at__gte=statement.period_start,
            usage_record__ended_at__lt=statement.period_end,
        )
        .values("usage_record__node_id")
        .annotate(total=Sum("amount"))
        .values_list("total", flat=True)
    )
    amounts = list(per_node)
    nodes = statement.lines.filter(kind=LineKind.USAGE).values("usage_record__node_id").distinct().count()
    if not amounts or median(amounts) <= 0:
        return None, "no comparable period and no usage in the pools"
    return median(amounts) * max(nodes, 1), f"pool median per node × {max(nodes, 1)} node(s)"


def evaluate_holds(statement: Statement, *, now: datetime) -> list[PayoutHold]:
    """Place the holds a just-final statement deserves (idempotent: one per reason)."""
    placed = []
    multiple = _hold_multiple(statement_pools(statement))
    for currency, total in statement.totals.items():
        basis, source = comparable_amount(statement, currency)
        if basis is not None and Decimal(total) > multiple * basis:
            placed.append(
                _hold(
                    statement,
                    HoldReason.OUTLIER,
                    f"{total} {currency} is more than {multiple}× the comparable {basis} ({source})",
                    {"currency": currency, "total": total, "comparable": str(basis), "multiple": str(multiple)},
                    now,
                )
            )
    flagged = []
    for line in statement.lines.exclude(usage_record=None).select_related("usage_record"):
        codes = {f.get("code") for f in line.usage_record.findings or []} & REVIEW_FINDINGS
        if codes:
            flagged.append({"line": line.pk, "findings": sorted(codes)})
    if flagged:
        placed.append(
            _hold(
                statement,
                HoldReason.FLAGGED_LINE,
                f"{len(flagged)} line(s) flagged for review",
                {"lines": flagged},
                now,
            )
        )
    return [hold for hold in placed if hold is not None]


def _hold(statement, reason, message, detail, now) -> PayoutHold | None:
    hold, created = PayoutHold.objects.get_or_create(
        statement=statement, reason=reason, defaults={"message": message, "detail": detail, "created_at": now}
    )
    if created:
        money_event(
            Actor.system("marketplace.holds"),
            "payout_hold",
            hold.pk,
            from_state="",
            to_state="held",
            reason=message,
            data={"statement": statement.pk, "owner": statement.owner_id, "reason": reason},
        )
    return hold if created else None


def hold_release(*, hold_id, reason, expected_version: int, actor: Actor, now=None) -> PayoutHold:
    """An operator releases a payout hold with a reason.

    Raises: NotFound 404 ``payout_hold_not_found``; PreconditionFailed 412; Conflict 409
    ``hold_released``; Problem 400 ``invalid_field``.
    """
    text = required_text(reason, "reason")
    now = now or timezone.now()
    with transaction.atomic():
        hold = PayoutHold.objects.select_for_update().filter(pk=hold_id).first()
        if hold is None:
            raise NotFound("No such payout hold.", PAYOUT_HOLD_NOT_FOUND)
        check_version(hold.version, expected_version)
        if hold.released_at is not None:
            raise Conflict("The hold is released already.", HOLD_RELEASED)
        hold.released_at, hold.released_by, hold.release_reason = now, actor.user, text
        hold.version += 1
        hold.save(update_fields=["released_at", "released_by", "release_reason", "version"])
        data = {"statement": hold.statement_id, "owner": hold.statement.owner_id, "reason": hold.reason}
        money_event(actor, "payout_hold", hold.pk, from_state="held", to_state="released", reason=text, data=data)
    return hold


def refuse_if_held(statement_id) -> None:
    open_holds = list(
        PayoutHold.objects.filter(statement_id=statement_id, released_at=None).values_list("reason", flat=True)
    )
    if open_holds:
        raise Conflict(
            "The statement has a payout hold; an operator must release it first.",
            STATEMENT_ON_HOLD,
            holds=open_holds,
        )
