"""The money done-when scenario, hand-computed: two day periods, two owners, two currencies, idle
paid, one mismatch resolved, one outlier held and released, one line appealed and corrected, one
payout reversed. Runs on SQLite and PostgreSQL alike (CI runs both).

Every node offers 2 cores + 1 GiB and every lease holds 2 cores + 1 GiB, so a node is either busy
or idle. Pool "market" (EUR, idle paid): 2 × 0.60 + 1 × 0.01 = 1.21 EUR per node-hour. Pool
"dollar" (USD, idle not paid): 2 × 0.50 + 1 × 0.02 = 1.02 USD per node-hour.

Monday 2 November (day 1)

| node | owner | pool | offered | leases | usage | idle |
|---|---|---|---|---|---|---|
| A | oscar | market | 08–12 (4 h) | 09–11 | 2.42 | 2.42 |
| B | otto | market | 08–10 (2 h) | 08–09 | 1.21 | 1.21 |
| C | otto | market | nothing | 10:00–10:30 | 0.605 → 0.61 | — (mismatch: usage while offering nothing) |
| D | oscar | dollar | 10–14 (4 h) | 10–12 | 2.04 USD | 2.04 USD, not paid |

market day 1: offered 6 h = 7.26 = usage 2.42 + 1.82 (1.815, rounded) + idle 2.42 + 1.21 +
unallocated −0.61 (usage above offered). dollar day 1: offered 4.08 = usage 2.04 + idle 0 +
unallocated 2.04 (the unpaid idle).
Statements: oscar EUR 4.84 (2.42 + idle 2.42), USD 2.04; otto EUR 3.03 (1.21 + 0.61 + idle 1.21).
otto appeals the B line (1.21): his payout is 3.03 − 1.21 = 1.82. oscar is paid 4.84 EUR and 2.04
USD; the USD payout is then reversed (a chargeback): −2.04 USD on his next statement. The appeal is
corrected by +0.61: otto's next statement gets 1.21 (held back) + 0.61 = 1.82.

Tuesday 3 November (day 2)

| node | owner | offered | leases | usage | idle |
|---|---|---|---|---|---|
| A | oscar | 00–24 | 00–20 | 24.20 | 4.84 |
| E | oscar | 00–24 | 00–24 | 29.04 | 0 |
| B | otto | 00–06 | 00–03 | 3.63 | 3.63 |

market day 2: offered 65.34 = 53.24 + 3.63 + 4.84 + 3.63 + 0.00.
Statements: oscar EUR 58.08, USD −2.04 (the reversal); otto EUR 9.08 (3.63 + 3.63 + 1.82).
oscar's 58.08 is more than 10 × 4.84 (his day 1): held, released by an operator, then paid.
otto in all: 1.82 + 9.08 = 10.90 = 3.03 + 0.61 + 7.26.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from fleet.events import Actor
from marketplace import holds, line_appeals, payouts, periods, statements
from marketplace.choices import HoldReason, LineKind, PayoutState, PoolPeriodState
from marketplace.models import MismatchItem, PayoutHold, PoolPeriod, Statement, StatementLine
from nodepool.api.permissions import OPERATORS
from nodepool.api.problems import Conflict
from tests.marketplace_support import owned_node, priced_pool
from tests.money_support import daily, offered, settled_usage

pytestmark = pytest.mark.django_db
DAY1 = datetime(2026, 11, 2, tzinfo=UTC)
DAY2 = DAY1 + timedelta(days=1)
DAY3 = DAY1 + timedelta(days=2)
SMALL = {"cpu": 2000, "memory": 2**30}


def d1(hours, minutes=0):
    return DAY1 + timedelta(hours=hours, minutes=minutes)


def d2(hours):
    return DAY2 + timedelta(hours=hours)


def as_actor(user):
    return Actor("user", user.get_username(), user=user)


@pytest.fixture
def second_operator(db):
    from django.contrib.auth.models import Group, User

    user = User.objects.create_user(username="paula-operator", password="pw")
    user.groups.add(Group.objects.get_or_create(name=OPERATORS)[0])
    return user


def totals(owner, day):
    return Statement.objects.get(owner=owner, period_start=day).totals


def reconcile_all(day, now):
    for period in PoolPeriod.objects.filter(period_start=day):
        periods.reconcile_period(period_id=period.pk, actor=Actor.system("test"), now=now)
    return {p.pool.name: p for p in PoolPeriod.objects.filter(period_start=day).select_related("pool")}


def finalize(owner, day, now, operator):
    statement = Statement.objects.get(owner=owner, period_start=day)
    return statements.finalize_statement(
        statement_id=statement.pk, expected_version=statement.version, actor=as_actor(operator), now=now
    )


def pay(statement, currency, requester, approver, reference, now):
    payout = payouts.payout_request(statement_id=statement.pk, currency=currency, actor=as_actor(requester), now=now)
    payout = payouts.payout_approve(
        payout_id=payout.pk, expected_version=payout.version, actor=as_actor(approver), now=now
    )
    return payouts.payout_mark_paid(
        payout_id=payout.pk, external_reference=reference, expected_version=payout.version,
        actor=as_actor(requester), now=now,
    )  # fmt: skip


def test_two_periods_match_the_hand_computed_figures_to_the_cent(
    owner, other_owner, client_user, operator, second_operator
):
    oscar, otto = owner, other_owner
    market = priced_pool("market")
    dollar = priced_pool("dollar", cpu="0.50", memory="0.02", currency="USD")
    daily(market, oscar, otto, idle_paid=True)
    daily(dollar)
    node = {}
    for name, pool, who in (("a", market, oscar), ("b", market, otto), ("c", market, otto),
                            ("d", dollar, oscar), ("e", market, oscar)):  # fmt: skip
        node[name] = owned_node(pool, who, name, resources=SMALL)[0]

    # --- day 1 ------------------------------------------------------------------------------------
    offered(node["a"], d1(8), d1(12), SMALL)
    offered(node["b"], d1(8), d1(10), SMALL)
    offered(node["d"], d1(10), d1(14), SMALL)
    settled_usage(client_user, market, node["a"], d1(9), d1(11))
    line_b = settled_usage(client_user, market, node["b"], d1(8), d1(9)).statement_line
    settled_usage(client_user, market, node["c"], d1(10), d1(10, 30))
    settled_usage(client_user, dollar, node["d"], d1(10), d1(12))
    for pool in (market, dollar):
        periods.period_for(pool, d1(1))
    day1 = reconcile_all(DAY1, d2(1))
    assert day1["market"].state == PoolPeriodState.MISMATCHED
    assert day1["dollar"].state == PoolPeriodState.RECONCILED
    assert day1["dollar"].money == {
        "currency": "USD", "offered": "4.08", "usage": {str(oscar.pk): "2.04"}, "idle": {str(oscar.pk): "0.00"},
        "idle_value": {str(oscar.pk): "2.04"}, "unallocated": "2.04",
    }  # fmt: skip
    items = list(MismatchItem.objects.filter(period=day1["market"]).values_list("key", "message"))
    assert len(items) == 1, items
    [item] = MismatchItem.objects.filter(period=day1["market"])
    assert item.key == f"node:{node['c'].pk}:time"
    periods.resolve_mismatch(
        item_id=item.pk, reason="node C's agent lost its reports; the lease ran", expected_version=item.version,
        actor=as_actor(operator),
    )  # fmt: skip
    day1 = reconcile_all(DAY1, d2(1))
    assert day1["market"].state == PoolPeriodState.RECONCILED
    assert day1["market"].money == {
        "currency": "EUR", "offered": "7.26",
        "usage": {str(oscar.pk): "2.42", str(otto.pk): "1.82"},
        "idle": {str(oscar.pk): "2.42", str(otto.pk): "1.21"},
        "idle_value": {str(oscar.pk): "2.42", str(otto.pk): "1.21"},
        "unallocated": "-0.61",
    }  # fmt: skip
    for who in (oscar, otto):
        finalize(who, DAY1, d2(1), operator)
    assert totals(oscar, DAY1) == {"EUR": "4.84", "USD": "2.04"}
    assert totals(otto, DAY1) == {"EUR": "3.03"}
    assert not PayoutHold.objects.exists()

    appeal = line_appeals.line_appeal_create(
        owner=otto, line_id=line_b.pk, message="the job ran 30 more minutes", actor=as_actor(otto), now=d2(2)
    )
    oscar_day1 = Statement.objects.get(owner=oscar, period_start=DAY1)
    otto_day1 = Statement.objects.get(owner=otto, period_start=DAY1)
    eur = pay(oscar_day1, "EUR", operator, second_operator, "BANK-1", d2(3))
    usd = pay(oscar_day1, "USD", operator, second_operator, "BANK-2", d2(3))
    otto_paid = pay(otto_day1, "EUR", operator, second_operator, "BANK-3", d2(3))
    assert (eur.amount, usd.amount, otto_paid.amount) == (Decimal("4.84"), Decimal("2.04"), Decimal("1.82"))
    assert otto_paid.excluded_lines == [line_b.pk]
    with pytest.raises(Conflict) as again:
        payouts.payout_request(statement_id=oscar_day1.pk, currency="EUR", actor=as_actor(operator), now=d2(3))
    assert again.value.get_codes() == "payout_exists"

    payouts.payout_reverse(
        payout_id=usd.pk, reason="chargeback from the bank", expected_version=usd.version,
        actor=as_actor(operator), now=d2(4),
    )  # fmt: skip
    line_appeals.line_appeal_resolve(
        appeal_id=appeal.pk, outcome="corrected", resolution="evidence found in the agent's log",
        amount=Decimal("0.61"), expected_version=appeal.version, actor=as_actor(operator), now=d2(5),
    )  # fmt: skip
    line_b.refresh_from_db()
    assert line_b.amount == Decimal("1.21")  # the original line is never edited

    # --- day 2 ------------------------------------------------------------------------------------
    offered(node["a"], d2(0), d2(24), SMALL)
    offered(node["e"], d2(0), d2(24), SMALL)
    offered(node["b"], d2(0), d2(6), SMALL)
    settled_usage(client_user, market, node["a"], d2(0), d2(20))
    settled_usage(client_user, market, node["e"], d2(0), d2(24) - timedelta(microseconds=1))
    settled_usage(client_user, market, node["b"], d2(0), d2(3))
    for pool in (market, dollar):
        periods.period_for(pool, d2(1))
    day2 = reconcile_all(DAY2, DAY3 + timedelta(hours=1))
    assert day2["market"].state == PoolPeriodState.RECONCILED
    assert day2["market"].money["offered"] == "65.34"
    assert day2["market"].money["usage"] == {str(oscar.pk): "53.24", str(otto.pk): "3.63"}
    assert day2["market"].money["idle"] == {str(oscar.pk): "4.84", str(otto.pk): "3.63"}
    assert day2["market"].money["unallocated"] == "0.00"
    for who in (oscar, otto):
        finalize(who, DAY2, DAY3 + timedelta(hours=1), operator)
    assert totals(oscar, DAY2) == {"EUR": "58.08", "USD": "-2.04"}
    assert totals(otto, DAY2) == {"EUR": "9.08"}
    corrections = StatementLine.objects.filter(kind=LineKind.CORRECTION).order_by("id")
    assert [(c.statement.owner, c.amount, c.currency) for c in corrections] == [
        (oscar, Decimal("-2.04"), "USD"),
        (otto, Decimal("1.82"), "EUR"),
    ]

    oscar_day2 = Statement.objects.get(owner=oscar, period_start=DAY2)
    [hold] = PayoutHold.objects.filter(statement=oscar_day2)
    assert hold.reason == HoldReason.OUTLIER and hold.detail["comparable"] == "4.84"
    with pytest.raises(Conflict) as held:
        payouts.payout_request(statement_id=oscar_day2.pk, currency="EUR", actor=as_actor(operator))
    assert held.value.get_codes() == "statement_on_hold"
    holds.hold_release(
        hold_id=hold.pk, reason="two new nodes joined", expected_version=hold.version, actor=as_actor(operator)
    )
    with pytest.raises(Conflict) as owes:
        payouts.payout_request(statement_id=oscar_day2.pk, currency="USD", actor=as_actor(operator))
    assert owes.value.get_codes() == "nothing_to_pay"
    oscar_eur = pay(oscar_day2, "EUR", operator, second_operator, "BANK-4", DAY3 + timedelta(hours=2))
    otto_eur = pay(
        Statement.objects.get(owner=otto, period_start=DAY2), "EUR", operator, second_operator, "BANK-5", DAY3
    )
    assert (oscar_eur.amount, otto_eur.amount) == (Decimal("58.08"), Decimal("9.08"))
    paid_to_otto = sum(p.amount for p in otto.payouts.filter(state=PayoutState.PAID))
    assert paid_to_otto == Decimal("10.90")
