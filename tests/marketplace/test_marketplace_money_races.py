"""Races of the money: two period reconcilers, two payout requests at once give one outcome
(PostgreSQL in CI; each fails with its row lock removed: ``hold.max_inside`` would be 2+)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fleet.events import Actor
from fleet.models import NodeEvent
from marketplace import payouts, periods, statements
from marketplace.choices import PoolPeriodState
from marketplace.models import Payout, PoolPeriod, Statement
from nodepool.api.problems import Conflict
from tests.marketplace_support import owned_node, priced_pool
from tests.money_support import daily, offered, settled_usage
from tests.races import Hold, race

pytestmark = [pytest.mark.race, pytest.mark.django_db(transaction=True)]
THREADS = 3
DAY = datetime(2026, 11, 2, tzinfo=UTC)
NEXT = DAY + timedelta(days=1, hours=1)


def a_day_of_usage(owner, client_user):
    pool = priced_pool()
    daily(pool, owner)
    node = owned_node(pool, owner, "r")[0]
    offered(node, DAY, DAY + timedelta(hours=12))
    settled_usage(client_user, pool, node, DAY + timedelta(hours=1), DAY + timedelta(hours=3))
    return periods.period_for(pool, DAY + timedelta(hours=1))


def code_or_state(call):
    try:
        return call().state
    except Conflict as exc:
        return exc.get_codes()


def test_two_reconcilers_of_one_pool_period_give_one_outcome_and_one_event(owner, client_user):
    period = a_day_of_usage(owner, client_user)
    # Every racer is held inside the section, after the row lock, before the write it decides.
    with Hold("marketplace.periods.compute", parties=THREADS) as hold:
        outcome = race(
            lambda i: periods.reconcile_period(period_id=period.pk, actor=Actor.system(f"r{i}"), now=NEXT).state,
            THREADS,
        )
    assert not outcome.errors, outcome.errors
    assert set(outcome.results) == {PoolPeriodState.RECONCILED}
    assert hold.max_inside == 1
    period = PoolPeriod.objects.get(pk=period.pk)  # not refresh_from_db: the state field is protected
    assert (period.runs, period.version) == (1, 2)
    assert NodeEvent.objects.filter(subject_type="pool_period", subject_id=str(period.pk)).count() == 1


def test_two_payout_requests_at_once_make_one_payout(owner, client_user, operator):
    period = a_day_of_usage(owner, client_user)
    periods.reconcile_period(period_id=period.pk, actor=Actor.system("r"), now=NEXT)
    statement = Statement.objects.get(owner=owner)
    statements.finalize_statement(statement_id=statement.pk, expected_version=1, actor=Actor.system("o"), now=NEXT)
    actor = Actor("user", operator.username, user=operator)
    with Hold("marketplace.payouts.payable_amount", parties=THREADS) as hold:
        outcome = race(
            lambda i: code_or_state(
                lambda: payouts.payout_request(statement_id=statement.pk, currency="EUR", actor=actor, now=NEXT)
            ),
            THREADS,
        )
    assert not outcome.errors, outcome.errors
    assert sorted(outcome.results) == ["payout_exists"] * (THREADS - 1) + ["requested"]
    assert hold.max_inside == 1
    assert Payout.objects.count() == 1
    assert NodeEvent.objects.filter(subject_type="payout").count() == 1
