"""Pool periods: what the pool's nodes offered, split into usage, idle and unallocated, conserved
exactly; mismatch items keep a period open until an operator resolves them (docs/marketplace.md).

The worked example of docs/marketplace.md, in pool "market" (EUR; cpu 0.60 per core-hour, memory
0.01 per GiB-hour), day periods, idle paid, on Monday 2 November 2026:

* node A (oscar): 8 cores, 32 GiB, available all day (86,400 s): offered 691,200 core-s and
  2,764,800 GiB-s, worth 8 × 24 × 0.60 + 32 × 24 × 0.01 = 122.88 EUR.
  One lease, 2 cores + 1 GiB, 10:00 to 12:00 (7,200 s allocated), evidenced from 10:00:05
  (7,195 s billable): usage 14,390 core-s + 7,195 GiB-s, worth 7,195 / 3,600 × 1.21 = 2.4183… → 2.42;
  idle 691,200 − 14,400 = 676,800 core-s and 2,764,800 − 7,200 = 2,757,600 GiB-s, worth
  115.20 × 676,800 / 691,200 + 7.68 × 2,757,600 / 2,764,800 = 112.80 + 7.66 = 120.46;
  unallocated 10 core-s and 5 GiB-s (the 5 unevidenced seconds).
* node B (otto): 4 cores, 16 GiB, available 12:00 to 18:00: 86,400 core-s and 345,600 GiB-s,
  all idle, worth 14.40 + 0.96 = 15.36.

Offered 122.88 + 15.36 = 138.24 EUR = usage 2.42 + idle 120.46 + 15.36 + unallocated 0.00 (the
unrounded remainder, 0.0016…, is the rounding residue).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction

import pytest

from fleet.events import Actor
from fleet.models import NodeEvent
from marketplace import periods
from marketplace.choices import LineKind, MismatchKind, PoolPeriodState
from marketplace.models import MismatchItem, StatementLine
from nodepool.api.problems import Conflict
from tests.marketplace_support import owned_node, priced_pool
from tests.money_support import daily, offered, settled_usage

pytestmark = pytest.mark.django_db
DAY = datetime(2026, 11, 2, tzinfo=UTC)
OPERATOR = Actor.system("operator-test")


def h(hours: float, minutes: float = 0, seconds: float = 0) -> datetime:
    return DAY + timedelta(hours=hours, minutes=minutes, seconds=seconds)


@pytest.fixture
def example(owner, other_owner, client_user):
    pool = priced_pool()
    daily(pool, owner, other_owner, idle_paid=True)
    node_a = owned_node(pool, owner, "a")[0]
    node_b = owned_node(pool, other_owner, "b", resources={"cpu": 4000, "memory": 16 * 2**30})[0]
    offered(node_a, h(0), h(24))
    offered(node_b, h(12), h(18), {"cpu": 4000, "memory": 16 * 2**30})
    settled_usage(client_user, pool, node_a, h(10), h(12), billable=[(h(10, 0, 5), h(12))])
    return pool


def reconcile(pool, at=None):
    period = periods.period_for(pool, h(1))
    return periods.reconcile_period(period_id=period.pk, actor=OPERATOR, now=at or h(25))


def test_the_worked_example_conserves_quantities_exactly_and_money_to_the_cent(example, owner, other_owner):
    period = reconcile(example)
    assert period.state == PoolPeriodState.RECONCILED
    assert {r: Decimal(q) for r, q in period.offered.items()} == {"cpu": Decimal(777600), "memory": Decimal(3110400)}
    assert {r: Decimal(q) for r, q in period.usage[str(owner.pk)].items()} == {"cpu": 14390, "memory": 7195}
    assert {r: Decimal(q) for r, q in period.idle[str(owner.pk)].items()} == {"cpu": 676800, "memory": 2757600}
    assert {r: Decimal(q) for r, q in period.idle[str(other_owner.pk)].items()} == {"cpu": 86400, "memory": 345600}
    assert {r: Decimal(q) for r, q in period.unallocated.items()} == {"cpu": 10, "memory": 5}
    assert period.money == {
        "currency": "EUR",
        "offered": "138.24",
        "usage": {str(owner.pk): "2.42"},
        "idle": {str(owner.pk): "120.46", str(other_owner.pk): "15.36"},
        "idle_value": {str(owner.pk): "120.46", str(other_owner.pk): "15.36"},
        "unallocated": "0.00",
    }
    idle_lines = StatementLine.objects.filter(kind=LineKind.IDLE).order_by("amount")
    assert [(line.statement.owner, line.amount) for line in idle_lines] == [
        (other_owner, Decimal("15.36")),
        (owner, Decimal("120.46")),
    ]
    assert NodeEvent.objects.filter(subject_type="pool_period", subject_id=str(period.pk)).count() == 1


def test_unpaid_idle_is_booked_to_unallocated(example, owner):
    from marketplace.models import PoolSettlement

    PoolSettlement.objects.filter(pool=example).update(idle_paid=False)
    period = reconcile(example)
    assert period.money["idle"] == {str(owner.pk): "0.00", str(period.idle and list(period.idle)[1]): "0.00"}
    assert period.money["unallocated"] == "135.82"
    assert not StatementLine.objects.filter(kind=LineKind.IDLE).exists()


def test_a_month_of_a_tebibyte_fits_exactly(owner):
    pool = priced_pool()
    node = owned_node(pool, owner, "big")[0]
    start, end = datetime(2026, 10, 1, tzinfo=UTC), datetime(2026, 11, 1, tzinfo=UTC)
    offered(node, start, end, {"memory": 2**40 + 1})
    figures = periods.compute(pool, start, end)
    # (2**40 + 1) bytes / 2**30 for 31 days, not rounded: 1024.000000000931322574615478515625 GiB.
    assert Fraction(figures.offered["memory"]) == Fraction(2**40 + 1, 2**30) * 31 * 86400


def test_a_period_is_not_reconciled_before_it_ends(example):
    with pytest.raises(Conflict) as refused:
        reconcile(example, at=h(23))
    assert refused.value.get_codes() == "period_not_over"


def test_usage_above_offered_keeps_the_period_mismatched_until_resolved_and_run_again(owner, client_user, operator):
    pool = priced_pool()
    daily(pool, owner)
    node = owned_node(pool, owner, "c")[0]
    offered(node, h(10), h(11))
    settled_usage(client_user, pool, node, h(10), h(12))
    period = reconcile(pool)
    assert period.state == PoolPeriodState.MISMATCHED
    [item] = MismatchItem.objects.filter(period=period)
    assert (item.kind, item.key, item.detail) == (
        MismatchKind.USAGE_ABOVE_OFFERED,
        f"node:{node.pk}:time",
        {"seconds": "3600.000000"},
    )
    assert reconcile(pool).state == PoolPeriodState.MISMATCHED  # nothing resolved yet
    operator_actor = Actor("user", operator.username, user=operator)
    periods.resolve_mismatch(item_id=item.pk, reason="agent clock fixed", expected_version=1, actor=operator_actor)
    period = reconcile(pool)
    assert period.state == PoolPeriodState.RECONCILED
    assert MismatchItem.objects.filter(period=period).count() == 1  # the re-run adds no duplicate


def test_impossible_usage_and_cut_evidence_are_mismatch_items(owner, client_user):
    pool = priced_pool()
    daily(pool, owner)
    node = owned_node(pool, owner, "d")[0]
    offered(node, h(0), h(24))
    settled_usage(
        client_user, pool, node, h(1), h(2), state="adjusted",
        findings=[{"code": "impossible_usage", "message": "x"}, {"code": "evidence_outside_history", "message": "y"}],
    )  # fmt: skip
    period = reconcile(pool)
    assert period.state == PoolPeriodState.MISMATCHED
    assert set(MismatchItem.objects.values_list("kind", flat=True)) == {
        MismatchKind.IMPOSSIBLE_USAGE,
        MismatchKind.EVIDENCE_WITHOUT_LEASE,
    }


def test_a_reconciled_period_is_never_evaluated_again(example):
    first = reconcile(example)
    again = reconcile(example)
    assert again.version == first.version and again.runs == 1


def test_the_beat_sweep_reconciles_the_periods_that_are_over(example):
    assert periods.reconcile_due_periods(actor=OPERATOR, now=h(25)) == {PoolPeriodState.RECONCILED: 1}
    assert periods.reconcile_due_periods(actor=OPERATOR, now=h(25)) == {}


def test_reconciling_a_period_locks_the_period_row_only_not_its_pool(example):
    """The period is locked to keep two reconcilers apart; its pool, joined by select_related, is
    only read. Without ``of=("self",)`` PostgreSQL locked the pool row FOR UPDATE too, which every
    insert naming the pool (a node's event, a lease) waits for (FOR KEY SHARE) while it lasts."""
    import re

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite serialises every writing transaction")
    with CaptureQueriesContext(connection) as queries:
        reconcile(example)
    locks = [q["sql"] for q in queries.captured_queries if re.search(r"FOR (NO KEY )?UPDATE", q["sql"])]
    period_locks = [sql for sql in locks if 'FROM "marketplace_poolperiod"' in sql]
    assert period_locks and all(sql.endswith('FOR UPDATE OF "marketplace_poolperiod"') for sql in period_locks)
