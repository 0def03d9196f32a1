"""A marketplace owner in a real browser sees their payout, its state and reference, the hold on a
statement and their line appeal — and no operator action on those pages; and, for money that went
through the services, each payout's and appeal's history (its events) on its page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from playwright.sync_api import expect

from fleet.events import Actor
from marketplace import line_appeals, payouts
from marketplace.models import LineAppeal, Payout, PayoutHold, Statement, StatementLine
from tests.browser.conftest import _staff, login

DAY = datetime(2026, 11, 2, tzinfo=UTC)


def owners_money(owner, operator):
    statement = Statement.objects.create(
        owner=owner, period="day", period_start=DAY, period_end=DAY + timedelta(days=1)
    )
    line = StatementLine.objects.create(
        statement=statement, kind="correction", state="reconciled", pool_name="market", amount=Decimal("4.84"),
        currency="EUR", reason="idle capacity",
    )  # fmt: skip
    PayoutHold.objects.create(
        statement=statement, reason="outlier", message="58.08 EUR is more than 10x", created_at=DAY
    )
    LineAppeal.objects.create(line=line, owner=owner, message="the job ran longer", created_at=DAY)
    Statement.objects.filter(pk=statement.pk).update(state="final", totals={"EUR": "4.84"})
    Payout.objects.create(
        statement=statement, owner=owner, currency="EUR", amount=Decimal("4.84"), state="paid",
        requested_by=operator, requested_at=DAY, external_reference="SEPA-77",
    )  # fmt: skip


def test_the_owner_reads_payouts_holds_and_line_appeals(page, owner_user, operator_user):
    owners_money(owner_user, operator_user)
    login(page, owner_user)
    page.goto(f"{page.live_server_url}/admin/marketplace/payout/")
    expect(page.locator("#result_list")).to_contain_text("SEPA-77")
    expect(page.locator("#result_list")).to_contain_text("paid")
    expect(page.get_by_role("combobox", name="Action")).to_have_count(0)
    page.goto(f"{page.live_server_url}/admin/marketplace/payouthold/")
    expect(page.locator("#result_list")).to_contain_text("58.08 EUR is more than 10x")
    page.goto(f"{page.live_server_url}/admin/marketplace/lineappeal/")
    expect(page.locator("#result_list")).to_contain_text("open")


def test_the_owner_follows_a_payout_and_an_appeal_through_their_history(page, owner_user, operator_user):
    """Two lines (4.84 idle, 1.21 usage); the owner appeals the 1.21 one, so the payout, requested
    by one operator and approved by another, is 4.84; it is paid with an external reference."""
    statement = Statement.objects.create(
        owner=owner_user, period="day", period_start=DAY, period_end=DAY + timedelta(days=1)
    )
    for amount, reason in (("4.84", "idle capacity"), ("1.21", "lease on attic-box")):
        StatementLine.objects.create(
            statement=statement, kind="correction", state="reconciled", pool_name="market", amount=Decimal(amount),
            currency="EUR", reason=reason,
        )  # fmt: skip
    Statement.objects.filter(pk=statement.pk).update(state="final", totals={"EUR": "6.05"})
    appealed = StatementLine.objects.get(amount=Decimal("1.21"))
    owner = Actor("user", owner_user.username, user=owner_user)
    appeal = line_appeals.line_appeal_create(
        owner=owner_user, line_id=appealed.pk, message="it ran 30 min", actor=owner
    )
    requester = Actor("user", operator_user.username, user=operator_user)
    second = _staff("paula-operator", "operators")
    payout = payouts.payout_request(statement_id=statement.pk, currency="EUR", actor=requester)
    payout = payouts.payout_approve(payout_id=payout.pk, expected_version=1, actor=Actor("user", "paula", user=second))
    payout = payouts.payout_mark_paid(payout_id=payout.pk, external_reference="SEPA-88", expected_version=2,
                                      actor=requester)  # fmt: skip

    login(page, owner_user)
    page.goto(f"{page.live_server_url}/admin/marketplace/payout/")
    row = page.locator("#result_list tbody tr").first
    expect(row).to_contain_text("4.84")
    expect(row).to_contain_text("SEPA-88")
    row.locator("th a").click()
    history = page.locator("table.money-history")
    expect(history.locator("tbody tr")).to_have_count(3)
    expect(history).to_contain_text("requested: 4.84 EUR")
    expect(history).to_contain_text("approved")
    expect(history).to_contain_text("paid: SEPA-88")
    expect(page.get_by_role("button", name="Save")).to_have_count(0)
    page.goto(f"{page.live_server_url}/admin/marketplace/lineappeal/{appeal.pk}/change/")
    expect(page.locator("table.money-history")).to_contain_text("it ran 30 min")
    expect(page.locator("body")).to_contain_text("open")


def test_the_owner_appeals_a_line_and_withdraws_the_appeal_on_the_statement_page(page, owner_user):
    statement = Statement.objects.create(
        owner=owner_user, period="day", period_start=DAY, period_end=DAY + timedelta(days=1)
    )
    line = StatementLine.objects.create(
        statement=statement, kind="correction", state="reconciled", pool_name="market", amount=Decimal("1.21"),
        currency="EUR", reason="lease on attic-box",
    )  # fmt: skip
    Statement.objects.filter(pk=statement.pk).update(state="final", totals={"EUR": "1.21"})
    login(page, owner_user)
    page.goto(f"{page.live_server_url}/admin/marketplace/statement/{statement.pk}/change/")
    page.get_by_role("link", name="Appeal this line").click()
    page.get_by_label("Message").fill("the lease ended at 14:00")
    page.get_by_role("button", name="Appeal this line").click()
    expect(page.locator(".messagelist")).to_contain_text(f"Line {line.pk} appealed")
    expect(page.locator("table.money-history")).to_contain_text("the lease ended at 14:00")
    page.goto(f"{page.live_server_url}/admin/marketplace/statement/{statement.pk}/change/")
    expect(page.get_by_role("link", name="open")).to_be_visible()
    page.get_by_role("link", name="Withdraw the appeal").click()
    page.get_by_role("button", name="Withdraw this appeal").click()
    expect(page.locator(".messagelist")).to_contain_text("withdrawn")
    expect(page.get_by_role("link", name="Appeal this line")).to_be_visible()
    assert LineAppeal.objects.get().state == "withdrawn"
