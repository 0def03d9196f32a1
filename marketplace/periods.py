"""Pool settlement periods and their reconciliation (docs/marketplace.md, "Pool periods").

For each closed period ``[start, end)`` of a pool (its ``PoolSettlement.period``: day, ISO week or
calendar month, UTC) the pool's **offered** resource-seconds (availability evidence,
marketplace.availability) are split, per node and resource, into

* **usage**: the billable intervals of its reconciled or adjusted usage records, clipped to the
  period, times the lease's resources (per owner);
* **idle**: what the node offered and no lease held: ``max(0, offered − allocated)``, where
  allocated is every lease's resources over its life clipped to the period (per node's owner);
* **unallocated**: the remainder ``offered − usage − idle`` (allocated but not billable: evidence
  gaps, adjusted or unpaid time, leases still running).

Quantities are exact ``Decimal`` resource-seconds in priced units (core-seconds, GiB-seconds),
computed with 60 significant digits, so ``offered == Σ usage + Σ idle + unallocated`` holds
exactly. Money: the offered value (each interval at the price in force, piecewise, as
marketplace.pricing charges leases) is rounded once to cents, half up; each owner's usage and idle
amounts are rounded the same way, and ``unallocated`` is the rest, so the money identity holds to
the cent with the rounding residue (and unpaid idle) booked there. Idle is valued at the node's
own offered price (its offered value × idle ÷ offered) and paid only when the pool says so
(``idle_paid``): then each owner gets an ``idle`` line on their statement.

Mismatch items: evidence the usage reconciliation cut as outside any lease's history
(``evidence_without_lease``), usage above what the node offered (``usage_above_offered``), and
records with the ``impossible_usage`` finding. The period stays ``mismatched`` until an operator
resolves each item with a reason and reconciliation runs again. A period waits (``pending``) while
usage records overlapping it are inside their settlement window or held.

Two reconcilers at once: the period row is locked (``SELECT … FOR UPDATE``) and a reconciled
period is never evaluated again, so one outcome and one event.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal, localcontext

from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone
from django_fsm import can_proceed

from fleet.events import Actor, record_event
from fleet.models import Pool
from leases.models import Lease
from nodepool.api.errors import TRANSITION_NOT_ALLOWED
from nodepool.api.problems import Conflict, NotFound, Problem
from nodepool.api.versioning import check_version

from . import event_types, statements
from .choices import OPEN_STATES, PAYABLE_STATES, LineKind, MismatchKind, PoolPeriodState, StatementPeriod, UsageState
from .errors import INVALID_FIELD, MISMATCH_NOT_FOUND, MISMATCH_RESOLVED, PERIOD_NOT_OVER, POOL_PERIOD_NOT_FOUND
from .models import MismatchItem, NodeAvailability, PoolPeriod, PoolPrice, PoolSettlement, StatementLine, UsageRecord
from .pricing import CENT, HOUR, QUANTITY, intervals_of, unit_of

logger = logging.getLogger(__name__)
PRECISION = 60
MAX_TEXT = 4000


def _seconds(lo: datetime, hi: datetime) -> Decimal:
    """Exact seconds of ``hi − lo`` (microseconds included)."""
    delta = hi - lo
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds).scaleb(-6)


def _clip(lo: datetime, hi: datetime, start: datetime, end: datetime) -> tuple[datetime, datetime] | None:
    lo, hi = max(lo, start), min(hi, end)
    return (lo, hi) if hi > lo else None


def _text(value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise Problem("reason: required, a non-empty string.", INVALID_FIELD, field="reason")
    if len(value) > MAX_TEXT:
        raise Problem(f"reason: at most {MAX_TEXT} characters.", INVALID_FIELD, field="reason")
    return value.strip()


def _money(value: Decimal) -> Decimal:
    return value.quantize(CENT, rounding=ROUND_HALF_UP)


def _q(value: Decimal) -> str:
    """A quantity as an exact decimal string (never an exponent)."""
    return format(value, "f")


class _Prices:
    """A pool's price versions per resource, to value resource-seconds piecewise (unrounded)."""

    def __init__(self, pool_id):
        self.versions: dict[str, list[PoolPrice]] = {}
        for price in PoolPrice.objects.filter(pool_id=pool_id).order_by("effective_from"):
            self.versions.setdefault(price.resource, []).append(price)
        currencies = {p.currency for v in self.versions.values() for p in v}
        self.currency = currencies.pop() if len(currencies) == 1 else ""

    def value(self, resource: str, units: Decimal, lo: datetime, hi: datetime) -> Decimal:
        total = Decimal(0)
        versions = self.versions.get(resource, [])
        for index, price in enumerate(versions):
            until = versions[index + 1].effective_from if index + 1 < len(versions) else None
            part = _clip(lo, hi, price.effective_from, min(hi, until) if until else hi)
            if part:
                total += units * _seconds(*part) / HOUR * price.unit_price
        return total


@dataclass
class Figures:
    """What one reconciliation run found (quantities exact, money unrounded until :func:`money`)."""

    offered: dict = field(default_factory=dict)  # {resource: Decimal}
    usage: dict = field(default_factory=dict)  # {owner: {resource: Decimal}}
    idle: dict = field(default_factory=dict)  # {owner: {resource: Decimal}}
    unallocated: dict = field(default_factory=dict)  # {resource: Decimal}
    offered_value: Decimal = Decimal(0)
    usage_value: dict = field(default_factory=dict)  # {owner: Decimal}
    idle_value: dict = field(default_factory=dict)  # {owner: Decimal}
    currency: str = ""
    items: list = field(default_factory=list)  # [dict(kind, key, node_id, usage_record_id, message, detail)]
    waiting: str = ""


def _add(target: dict, key, amount: Decimal) -> None:
    target[key] = target.get(key, Decimal(0)) + amount


def compute(pool: Pool, start: datetime, end: datetime) -> Figures:
    """The split of what ``pool`` offered in ``[start, end)`` (pure reads; see the module docstring)."""
    figures = Figures()
    with localcontext() as context:
        context.prec = PRECISION
        prices = _Prices(pool.pk)
        figures.currency = prices.currency
        offered: dict = {}  # {(node, resource): Decimal}
        offered_value: dict = {}
        node_owner: dict = {}
        spans: dict = {}  # {node: [(lo, hi)]}: when each node offered, to check usage against
        for interval in NodeAvailability.objects.filter(pool=pool, started_at__lt=end, last_seen_at__gt=start):
            part = _clip(interval.started_at, interval.last_seen_at, start, end)
            if part is None:
                continue
            node_owner.setdefault(interval.node_id, interval.owner_id)
            spans.setdefault(interval.node_id, []).append(part)
            for resource, canonical in (interval.allocatable or {}).items():
                units = Decimal(int(canonical)) / unit_of(resource)
                _add(offered, (interval.node_id, resource), units * _seconds(*part))
                _add(offered_value, (interval.node_id, resource), prices.value(resource, units, *part))

        records = UsageRecord.objects.filter(pool=pool, started_at__lt=end, ended_at__gt=start)
        waiting = records.filter(state__in=OPEN_STATES).count()
        if waiting:
            figures.waiting = f"{waiting} usage record(s) overlapping the period are not reconciled yet"
            return figures
        used: dict = {}  # {(node, resource): Decimal}
        uncovered: dict = {}  # {node: Decimal seconds of usage while the node offered nothing}
        for record in records.order_by("pk"):
            codes = {f.get("code") for f in record.findings or []}
            if "impossible_usage" in codes:
                figures.items.append(_item(MismatchKind.IMPOSSIBLE_USAGE, record, "the node reported more than it has"))
            if "evidence_outside_history" in codes:
                why = (record.adjustment or {}).get("why", "evidence outside the lease's history")
                figures.items.append(_item(MismatchKind.EVIDENCE_WITHOUT_LEASE, record, why))
            if record.state not in PAYABLE_STATES:
                continue
            for lo, hi in intervals_of(record):
                part = _clip(lo, hi, start, end)
                if part is None:
                    continue
                covered = sum(
                    (_seconds(*o) for o in (_clip(*part, a, b) for a, b in spans.get(record.node_id, [])) if o),
                    Decimal(0),
                )
                if covered < _seconds(*part):
                    _add(uncovered, record.node_id, _seconds(*part) - covered)
                for resource, canonical in (record.resources or {}).items():
                    units = Decimal(int(canonical)) / unit_of(resource)
                    quantity = units * _seconds(*part)
                    _add(used, (record.node_id, resource), quantity)
                    _add(figures.usage.setdefault(record.owner_id, {}), resource, quantity)
                    _add(figures.usage_value, record.owner_id, prices.value(resource, units, *part))

        allocated: dict = {}
        leases = Lease.objects.filter(pool=pool, granted_at__lt=end).filter(
            Q(ended_at__isnull=True) | Q(ended_at__gt=start)
        )
        for node_id, resources, granted_at, ended_at in leases.values_list(
            "node_id", "resources", "granted_at", "ended_at"
        ):
            part = _clip(granted_at, ended_at or end, start, end)
            if part is None:
                continue
            for resource, canonical in (resources or {}).items():
                _add(allocated, (node_id, resource), Decimal(int(canonical)) / unit_of(resource) * _seconds(*part))

        for node_id, seconds in sorted(uncovered.items(), key=str):
            figures.items.append(
                {
                    "kind": MismatchKind.USAGE_ABOVE_OFFERED,
                    "key": f"node:{node_id}:time",
                    "node_id": node_id,
                    "usage_record_id": None,
                    "message": f"{_q(seconds)} s of lease usage while the node offered nothing",
                    "detail": {"seconds": _q(seconds)},
                }
            )
        for key in sorted(set(offered) | set(used), key=str):
            node_id, resource = key
            node_offered = offered.get(key, Decimal(0))
            node_used = used.get(key, Decimal(0))
            # Usage while the node offered nothing is listed once per node (above); beyond that, a
            # node whose leases used more than it offered (overcommitted) is listed per resource.
            if node_used > node_offered and node_id not in uncovered:
                figures.items.append(
                    {
                        "kind": MismatchKind.USAGE_ABOVE_OFFERED,
                        "key": f"node:{node_id}:{resource}",
                        "node_id": node_id,
                        "usage_record_id": None,
                        "message": f"lease usage of {resource} above what the node offered in the period",
                        "detail": {"resource": resource, "usage": _q(node_used), "offered": _q(node_offered)},
                    }
                )
            _add(figures.offered, resource, node_offered)
            idle = max(Decimal(0), node_offered - allocated.get(key, Decimal(0)))
            if idle and node_offered:
                owner = node_owner.get(node_id)
                _add(figures.idle.setdefault(owner, {}), resource, idle)
                _add(figures.idle_value, owner, offered_value[key] * idle / node_offered)
        figures.offered_value = sum(offered_value.values(), Decimal(0))
        for resource, total in figures.offered.items():
            figures.unallocated[resource] = (
                total
                - sum((u.get(resource, Decimal(0)) for u in figures.usage.values()), Decimal(0))
                - sum((i.get(resource, Decimal(0)) for i in figures.idle.values()), Decimal(0))
            )
    return figures


def _item(kind: str, record: UsageRecord, message: str) -> dict:
    return {
        "kind": kind,
        "key": f"usage_record:{record.pk}",
        "node_id": record.node_id,
        "usage_record_id": record.pk,
        "message": message,
        "detail": {"usage_record": record.pk, "lease": str(record.lease_id), "state": record.state},
    }


def money(figures: Figures, *, idle_paid: bool) -> dict:
    """Cents, half up: ``offered == Σ usage + Σ idle + unallocated`` exactly (idle 0 when unpaid)."""
    offered = _money(figures.offered_value)
    usage = {str(owner): _money(v) for owner, v in figures.usage_value.items()}
    idle = {str(owner): (_money(v) if idle_paid else Decimal("0.00")) for owner, v in figures.idle_value.items()}
    unallocated = offered - sum(usage.values(), Decimal(0)) - sum(idle.values(), Decimal(0))
    return {
        "currency": figures.currency,
        "offered": str(offered),
        "usage": {k: str(v) for k, v in sorted(usage.items())},
        "idle": {k: str(v) for k, v in sorted(idle.items())},
        "idle_value": {str(owner): str(_money(v)) for owner, v in sorted(figures.idle_value.items(), key=str)},
        "unallocated": str(unallocated),
    }


# --- periods ------------------------------------------------------------------------------------
def pool_period_kind(pool_id) -> str:
    return (
        PoolSettlement.objects.filter(pool_id=pool_id).values_list("period", flat=True).first() or StatementPeriod.MONTH
    )


def period_for(pool: Pool, at: datetime) -> PoolPeriod:
    """The pool's period containing ``at``, created (``pending``) if missing."""
    kind = pool_period_kind(pool.pk)
    start, end = statements.period_bounds(kind, at)
    period = PoolPeriod.objects.filter(pool=pool, period_start=start).first()
    if period is None:
        try:
            with transaction.atomic():
                period = PoolPeriod.objects.create(pool=pool, period=kind, period_start=start, period_end=end)
        except IntegrityError:  # created meanwhile by a racing reconciler
            period = PoolPeriod.objects.get(pool=pool, period_start=start)
    return period


def _nested(values: dict) -> dict:
    return {
        str(k): {r: _q(q) for r, q in sorted(v.items())} for k, v in sorted(values.items(), key=lambda kv: str(kv[0]))
    }


def reconcile_period(*, period_id, actor: Actor, now: datetime | None = None) -> PoolPeriod:
    """Reconcile one pool period: ``pending | mismatched → reconciled | mismatched``.

    Raises: NotFound 404 ``pool_period_not_found``; Conflict 409 ``period_not_over``. A reconciled
    period is returned unchanged (never evaluated again); one still waiting for usage records stays
    ``pending`` with ``waiting_for`` set.
    """
    now = now or timezone.now()
    with transaction.atomic():
        # The guard against two reconcilers: the row lock makes the second wait, then find the
        # period reconciled (or re-run a mismatched one to the same outcome, with no new items).
        # Of self: the pool is joined to be read, not locked (FOR UPDATE on it would make every
        # insert naming the pool, an event or a lease, wait for the reconciliation).
        period = PoolPeriod.objects.select_for_update(of=("self",)).select_related("pool").filter(pk=period_id).first()
        if period is None:
            raise NotFound("No such pool period.", POOL_PERIOD_NOT_FOUND)
        if period.state == PoolPeriodState.RECONCILED:
            return period
        if period.period_end > now:
            raise Conflict(
                f"The period ends at {period.period_end.isoformat()}; it cannot be reconciled before.",
                PERIOD_NOT_OVER,
            )
        figures = compute(period.pool, period.period_start, period.period_end)
        if figures.waiting:
            PoolPeriod.objects.filter(pk=period.pk).update(waiting_for=figures.waiting, runs=F("runs") + 1)
            period.refresh_from_db(fields=["waiting_for", "runs"])
            return period
        for item in figures.items:
            MismatchItem.objects.get_or_create(
                period=period,
                kind=item["kind"],
                key=item["key"],
                defaults={
                    "node_id": item["node_id"],
                    "usage_record_id": item["usage_record_id"],
                    "message": item["message"],
                    "detail": item["detail"],
                },
            )
        unresolved = period.mismatch_items.filter(resolved_at__isnull=True).count()
        idle_paid = PoolSettlement.objects.filter(pool_id=period.pool_id, idle_paid=True).exists()
        from_state = period.state
        transition = period.mismatch if unresolved else period.reconcile
        if not can_proceed(transition):
            raise Conflict(f"A {period.state} period cannot be reconciled.", TRANSITION_NOT_ALLOWED)
        transition()
        period.offered = {r: _q(q) for r, q in sorted(figures.offered.items())}
        period.usage = _nested(figures.usage)
        period.idle = _nested(figures.idle)
        period.unallocated = {r: _q(q) for r, q in sorted(figures.unallocated.items())}
        period.money = money(figures, idle_paid=idle_paid)
        period.idle_paid = idle_paid
        period.waiting_for = ""
        period.runs += 1
        period.version += 1
        if unresolved:
            period.mismatched_since = period.mismatched_since or now
        else:
            period.reconciled_at, period.reconciled_by = now, actor.name[:150]
        period.save(
            update_fields=[
                "state", "offered", "usage", "idle", "unallocated", "money", "idle_paid", "waiting_for", "runs",
                "version", "mismatched_since", "reconciled_at", "reconciled_by",
            ]
        )  # fmt: skip
        if not unresolved and idle_paid:
            _idle_lines(period)
        if from_state != period.state or not unresolved:
            record_event(
                None,
                event_types.STATEMENT,
                actor,
                from_state=from_state,
                to_state=period.state,
                pool=period.pool_id,
                reason=f"pool period {period.period_start:%Y-%m-%d}: {period.state}"
                + (f", {unresolved} mismatch item(s) open" if unresolved else ""),
                subject_type="pool_period",
                subject_id=period.pk,
                data={"money": period.money, "unresolved": unresolved},
            )
    return period


def _idle_lines(period: PoolPeriod) -> None:
    """An ``idle`` line per owner paid for idle capacity, on the statement holding the period's end."""
    idle = period.money.get("idle", {})
    for owner, amount in idle.items():
        if owner == "None" or Decimal(amount) <= 0:
            continue
        statement = statements.statement_for(int(owner), period.period_end - timedelta(microseconds=1))
        hours = {
            r: str((Decimal(q) / HOUR).quantize(QUANTITY, rounding=ROUND_HALF_UP))
            for r, q in period.idle[owner].items()
        }
        StatementLine.objects.get_or_create(
            statement=statement,
            pool_period=period,
            kind=LineKind.IDLE,
            defaults={
                "state": UsageState.RECONCILED,
                "node_id_text": "",
                "pool_name": period.pool.name,
                "quantities": hours,
                "amount": Decimal(amount),
                "currency": period.money.get("currency", ""),
                "reason": f"idle capacity offered in {period.pool.name}, "
                f"{period.period_start:%Y-%m-%d} to {period.period_end:%Y-%m-%d}",
            },
        )


def resolve_mismatch(
    *, item_id, reason, expected_version: int, actor: Actor, now: datetime | None = None
) -> MismatchItem:
    """An operator resolves one mismatch item with a reason (then reconciliation is run again).

    Raises: NotFound 404 ``mismatch_not_found``; PreconditionFailed 412; Conflict 409
    ``mismatch_resolved``; Problem 400 ``invalid_field``.
    """
    text = _text(reason)
    now = now or timezone.now()
    with transaction.atomic():
        item = MismatchItem.objects.select_for_update().filter(pk=item_id).first()
        if item is None:
            raise NotFound("No such mismatch item.", MISMATCH_NOT_FOUND)
        check_version(item.version, expected_version)
        if item.resolved_at is not None:
            raise Conflict("The item is resolved already.", MISMATCH_RESOLVED)
        MismatchItem.objects.filter(pk=item.pk, version=item.version).update(
            resolution=text, resolved_by=actor.user, resolved_at=now, version=F("version") + 1
        )
        item.refresh_from_db()
        record_event(
            None,
            event_types.STATEMENT,
            actor,
            from_state="open",
            to_state="resolved",
            reason=text[:2000],
            subject_type="mismatch_item",
            subject_id=item.pk,
            data={"period": item.period_id, "kind": item.kind, "key": item.key},
        )
    return item


def reconcile_due_periods(*, actor: Actor, now: datetime | None = None) -> dict:
    """Beat: for every pool, make the period that just ended exist and reconcile every period that
    is over and not reconciled (waiting ones are tried again next time)."""
    now = now or timezone.now()
    outcomes: dict[str, int] = {}
    for pool in Pool.objects.all():
        kind = pool_period_kind(pool.pk)
        start, _ = statements.period_bounds(kind, now)
        period_for(pool, start - timedelta(microseconds=1))
    due = PoolPeriod.objects.filter(period_end__lte=now).exclude(state=PoolPeriodState.RECONCILED)
    for period_id in due.values_list("pk", flat=True)[:200]:
        try:
            state = reconcile_period(period_id=period_id, actor=actor, now=now).state
        except Exception:  # one bad period never stops the others; it is tried again next pass
            logger.exception("pool period reconciliation failed", extra={"period_id": period_id})
            state = "failed"
        outcomes[state] = outcomes.get(state, 0) + 1
    return outcomes
