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


def a_requested_payout(owner, client_user, operator):
    """A final statement of a day of usage and its EUR payout, requested by ``operator``:
    ``(statement, requester, approver, payout, line)``, ``approver`` a second operator and ``line``
    the statement's first paid EUR line."""
    from django.contrib.auth.models import Group, User

    from marketplace.models import StatementLine
    from nodepool.api.permissions import OPERATORS

    period = a_day_of_usage(owner, client_user)
    periods.reconcile_period(period_id=period.pk, actor=Actor.system("r"), now=NEXT)
    statement = Statement.objects.get(owner=owner)
    statements.finalize_statement(statement_id=statement.pk, expected_version=1, actor=Actor.system("o"), now=NEXT)
    requester = Actor("user", operator.username, user=operator)
    approver_user = User.objects.create_user(username="paula-operator", password="pw")
    approver_user.groups.add(Group.objects.get_or_create(name=OPERATORS)[0])
    approver = Actor("user", approver_user.username, user=approver_user)
    payout = payouts.payout_request(statement_id=statement.pk, currency="EUR", actor=requester, now=NEXT)
    line = StatementLine.objects.filter(statement=statement, currency="EUR", amount__gt=0).order_by("pk").first()
    return statement, requester, approver, payout, line


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


def test_a_line_appeal_resolved_while_its_payout_is_approved_is_paid_once(owner, client_user, operator):
    """The approval leaves out the lines under open appeal (payouts.payable_amount, read under the
    payout's row lock); the resolution books what a payout held back (line_appeals._held_back_by_payout).
    Each must see the other's outcome: without the resolution reading the payouts under their row
    locks, both read before either wrote, the approval held the line back as still appealed and the
    resolution found no approved payout, and the line's 2.42 was paid by neither."""
    from decimal import Decimal
    from unittest import mock

    from marketplace import line_appeals
    from marketplace.models import StatementLine

    statement, requester, approver, payout, line = a_requested_payout(owner, client_user, operator)
    appeal = line_appeals.line_appeal_create(owner=owner, line_id=line.pk, message="too low", actor=Actor.system("o"))
    total = Decimal(statements.totals(Statement.objects.get(pk=statement.pk))["EUR"])

    def act(i):
        if i == 0:
            return payouts.payout_approve(
                payout_id=payout.pk, expected_version=payout.version, actor=approver, now=NEXT
            )
        return line_appeals.line_appeal_resolve(appeal_id=appeal.pk, outcome="corrected", resolution="found",
                                                amount=Decimal("0.61"), expected_version=appeal.version,
                                                actor=requester, now=NEXT)  # fmt: skip

    # Each racer is held after its read (the approval's amount, the resolution's held-back check).
    with Hold("marketplace.payouts.payable_amount", parties=2, timeout=1.0) as hold:
        original = line_appeals._held_back_by_payout

        def held_back(found_line):
            value = original(found_line)
            hold.wait_here()
            return value

        with mock.patch.object(line_appeals, "_held_back_by_payout", held_back):
            outcome = race(act, 2)
    assert not outcome.errors, outcome.errors
    assert hold.max_inside == 1
    approved = Payout.objects.get(pk=payout.pk)
    correction = StatementLine.objects.get(corrects=line)
    assert approved.amount + correction.amount == total + Decimal("0.61")


def test_a_line_appealed_while_its_payout_is_approved_is_either_held_back_or_refused(owner, client_user, operator):
    """The approval computes the amount (leaving out lines under open appeal) and a line appeal is
    refused once the payout is approved. Both take the statement's row lock: without it in the
    approval, both read before either wrote, the appeal was filed and its line paid in full."""
    from unittest import mock

    from marketplace import line_appeals
    from marketplace.models import LineAppeal

    statement, requester, approver, payout, line = a_requested_payout(owner, client_user, operator)

    def act(i):
        if i == 0:
            return code_or_state(
                lambda: payouts.payout_approve(
                    payout_id=payout.pk, expected_version=payout.version, actor=approver, now=NEXT
                )
            )
        try:
            return line_appeals.line_appeal_create(
                owner=owner, line_id=line.pk, message="too low", actor=Actor.system("o")
            ).state
        except Conflict as exc:
            return exc.get_codes()

    # The approval is held after computing its amount, the appeal after it was written.
    with Hold("marketplace.payouts.payable_amount", parties=2, timeout=1.0) as hold:
        original = line_appeals._appeal_event

        def appeal_event(*args, **kwargs):
            original(*args, **kwargs)
            hold.wait_here()

        with mock.patch.object(line_appeals, "_appeal_event", appeal_event):
            outcome = race(act, 2)
    assert not outcome.errors, outcome.errors
    assert hold.max_inside == 1
    approved = Payout.objects.get(pk=payout.pk)
    assert approved.state == "approved"
    if LineAppeal.objects.filter(line=line).exists():
        assert line.pk in approved.excluded_lines  # filed first: held back from the payout
    else:
        assert "line_paid" in str(outcome.results)  # approved first: the appeal is refused
