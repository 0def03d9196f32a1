"""A marketplace owner in a real browser sees their payout, its state and reference, the hold on a
statement and their line appeal — and no operator action on those pages."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from playwright.sync_api import expect

from marketplace.models import LineAppeal, Payout, PayoutHold, Statement, StatementLine
from tests.browser.conftest import login

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
