"""The money's admin pages: operators read and act (release a hold with a reason, mark a payout paid
with its external reference, correct a line appeal with an amount); owners read their own payouts,
holds and line appeals, each with its history, and no one else's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.contrib.auth.models import User

from fleet.events import Actor
from fleet.models import NodeEvent
from marketplace import line_appeals, payouts
from marketplace.models import LineAppeal, Payout, PayoutHold, Statement, StatementLine
from tests.marketplace.test_marketplace_money_api import (  # noqa: F401  (fixtures)
    NEXT,
    final_statement,
    reconcile_and_finalize,
    second_operator_api,
)

pytestmark = pytest.mark.django_db
DAY = datetime(2026, 11, 2, tzinfo=UTC)
PAGES = ["poolperiod", "mismatchitem", "payout", "payouthold", "lineappeal", "nodeavailability", "payoutdelivery"]


@pytest.fixture
def hold(owner):
    statement = Statement.objects.create(
        owner=owner, period="day", period_start=DAY, period_end=DAY + timedelta(days=1)
    )
    return PayoutHold.objects.create(statement=statement, reason="outlier", message="10x", created_at=DAY)


def test_operators_open_every_money_page_and_release_a_hold_with_a_reason(client, operator, hold):
    operator.is_staff = True
    operator.save()
    client.force_login(operator)
    for page in PAGES:
        assert client.get(f"/admin/marketplace/{page}/").status_code == 200, page
    answer = client.post(
        "/admin/marketplace/payouthold/",
        {
            "action": "release_holds",
            "_selected_action": [hold.pk],
            "apply": "1",
            "reason": "checked the nodes",
            f"version_{hold.pk}": "1",
        },
    )
    assert answer.status_code == 302
    hold.refresh_from_db()
    assert hold.released_at is not None and hold.release_reason == "checked the nodes"


def test_owners_see_their_holds_only(client, owner, other_owner, hold):
    owner.is_staff = other_owner.is_staff = True
    owner.save()
    other_owner.save()
    client.force_login(owner)
    assert "10x" in client.get("/admin/marketplace/payouthold/").content.decode()
    assert client.get("/admin/marketplace/poolperiod/").status_code == 403
    client.force_login(other_owner)
    assert "10x" not in client.get("/admin/marketplace/payouthold/").content.decode()


def as_actor(user):
    return Actor("user", user.username, user=user)


def staff(*users):
    for user in users:
        user.is_staff = True
        user.save()


def test_operators_mark_a_payout_paid_and_correct_a_line_appeal_in_the_admin(
    client,
    owner,
    operator,
    final_statement,  # noqa: F811
    second_operator_api,  # noqa: F811
):
    statement, period, line = final_statement
    statement = reconcile_and_finalize(statement, period)
    appeal = line_appeals.line_appeal_create(owner=owner, line_id=line.pk, message="ran longer", actor=as_actor(owner))
    staff(operator, owner)
    client.force_login(operator)
    form = client.post("/admin/marketplace/lineappeal/", {"action": "correct_line_appeals",
                                                          "_selected_action": [appeal.pk]})  # fmt: skip
    assert form.status_code == 200 and 'name="amount"' in form.content.decode()
    answer = client.post("/admin/marketplace/lineappeal/", {
        "action": "correct_line_appeals", "_selected_action": [appeal.pk], "apply": "1",
        "reason": "the lease ran 6 minutes longer", "amount": "0.12", f"version_{appeal.pk}": "1",
    })  # fmt: skip
    assert answer.status_code == 302
    appeal = LineAppeal.objects.get(pk=appeal.pk)
    assert (appeal.state, appeal.correction_amount) == ("corrected", Decimal("0.12"))
    correction = StatementLine.objects.get(pk=appeal.correction_line_id)
    assert (correction.kind, correction.amount, correction.corrects_id) == ("correction", Decimal("0.12"), line.pk)
    assert correction.statement_id != statement.pk, "on the owner's next open statement; the original is untouched"
    payout = payouts.payout_request(statement_id=statement.pk, currency="EUR", actor=as_actor(operator), now=NEXT)
    second = User.objects.get(username="paula-operator")
    payouts.payout_approve(payout_id=payout.pk, expected_version=1, actor=as_actor(second), now=NEXT)
    answer = client.post("/admin/marketplace/payout/", {
        "action": "pay_payouts", "_selected_action": [payout.pk], "apply": "1",
        "external_reference": "SEPA-2026-0042", f"version_{payout.pk}": "2",
    })  # fmt: skip
    assert answer.status_code == 302
    payout = Payout.objects.get(pk=payout.pk)
    assert (payout.state, payout.external_reference) == ("paid", "SEPA-2026-0042")
    # The owner reads the payout's and the appeal's history on their pages, and no action.
    client.force_login(owner)
    page = client.get(f"/admin/marketplace/payout/{payout.pk}/change/").content.decode()
    assert "money-history" in page and "paid: SEPA-2026-0042" in page and "approved" in page
    page = client.get(f"/admin/marketplace/lineappeal/{appeal.pk}/change/").content.decode()
    assert "the lease ran 6 minutes longer" in page
    assert 'name="action"' not in client.get("/admin/marketplace/payout/").content.decode()


def test_a_zero_correction_is_refused_by_the_form(client, owner, operator, final_statement):  # noqa: F811
    statement, period, line = final_statement
    reconcile_and_finalize(statement, period)
    appeal = line_appeals.line_appeal_create(owner=owner, line_id=line.pk, message="m", actor=as_actor(owner))
    staff(operator)
    client.force_login(operator)
    answer = client.post("/admin/marketplace/lineappeal/", {
        "action": "correct_line_appeals", "_selected_action": [appeal.pk], "apply": "1",
        "reason": "r", "amount": "0.00", f"version_{appeal.pk}": "1",
    })  # fmt: skip
    assert answer.status_code == 200 and "not zero" in answer.content.decode()
    assert LineAppeal.objects.get(pk=appeal.pk).state == "open"


def test_owners_appeal_and_withdraw_a_line_on_their_statement_page(
    client,
    owner,
    other_owner,
    operator,
    final_statement,  # noqa: F811
):
    """The statement page offers each line of a final statement an appeal form that goes through
    line_appeals.line_appeal_create (same rules as the API) and an open appeal a withdrawal."""
    statement, period, line = final_statement
    staff(owner, other_owner, operator)
    client.force_login(owner)
    page = client.get(f"/admin/marketplace/statement/{statement.pk}/change/").content.decode()
    assert "Appeal this line" not in page, "an open statement may still change: no appeal"
    assert client.post(f"/admin/marketplace/lineappeal/{line.pk}/file/", {"message": "too early"}).status_code == 200
    assert not LineAppeal.objects.exists()
    statement = reconcile_and_finalize(statement, period)
    file_url = f"/admin/marketplace/lineappeal/{line.pk}/file/"
    assert f'href="{file_url}"' in client.get(f"/admin/marketplace/statement/{statement.pk}/change/").content.decode()
    assert 'name="message"' in client.get(file_url).content.decode()
    assert "This field is required" in client.post(file_url, {"message": ""}).content.decode()
    answer = client.post(file_url, {"message": "the lease ended an hour earlier"})
    appeal = LineAppeal.objects.get()
    assert answer.status_code == 302 and answer.url == f"/admin/marketplace/lineappeal/{appeal.pk}/change/"
    assert (appeal.line_id, appeal.owner, appeal.state, appeal.message) == (
        line.pk, owner, "open", "the lease ended an hour earlier"
    )  # fmt: skip
    assert NodeEvent.objects.filter(subject_type="line_appeal", subject_id=str(appeal.pk)).count() == 1
    # Once per line: the second form answers with the service's refusal, nothing stored.
    again = client.post(file_url, {"message": "again"})
    assert again.status_code == 200 and "appealed already" in again.content.decode()
    assert LineAppeal.objects.count() == 1
    # The statement page shows the open appeal with its withdrawal; another owner cannot reach either.
    withdraw_url = f"/admin/marketplace/lineappeal/{appeal.pk}/withdraw/"
    page = client.get(f"/admin/marketplace/statement/{statement.pk}/change/").content.decode()
    assert f'href="{withdraw_url}"' in page and "Appeal this line" not in page
    client.force_login(other_owner)
    assert client.get(file_url).status_code == 404
    assert client.post(file_url, {"message": "not mine"}).status_code == 404
    assert client.post(withdraw_url).status_code == 404
    client.force_login(operator)
    assert client.get(file_url).status_code == 403, "operators resolve appeals, they do not file them"
    assert (
        f"/admin/marketplace/lineappeal/{appeal.pk}/change/"
        in client.get(f"/admin/marketplace/statement/{statement.pk}/change/").content.decode()
    )
    assert (
        "Withdraw this appeal" not in client.get(f"/admin/marketplace/lineappeal/{appeal.pk}/change/").content.decode()
    )
    client.force_login(owner)
    assert f'href="{withdraw_url}"' in client.get(f"/admin/marketplace/lineappeal/{appeal.pk}/change/").content.decode()
    assert "Withdraw this appeal" in client.get(withdraw_url).content.decode()
    answer = client.post(withdraw_url)
    assert answer.status_code == 302 and answer.url == f"/admin/marketplace/statement/{statement.pk}/change/"
    assert LineAppeal.objects.get().state == "withdrawn"
    again = client.post(withdraw_url)
    assert again.status_code == 200 and "withdrawn already" in again.content.decode()
    # Withdrawn: the line can be appealed again (the API's rule).
    assert f'href="{file_url}"' in client.get(f"/admin/marketplace/statement/{statement.pk}/change/").content.decode()
    assert client.post(file_url, {"message": "after all"}).status_code == 302
    assert LineAppeal.objects.filter(state="open").count() == 1


def test_operators_retry_payout_webhook_notices_that_gave_up(client, owner, operator, hold):
    """The runbook of NodepoolPayoutWebhooksGaveUp: once the cause is fixed, the admin action gives
    the undelivered rows a fresh set of attempts, due now; a delivered row is left alone."""
    from marketplace import webhooks
    from marketplace.models import PayoutDelivery

    payout = Payout.objects.create(
        statement=hold.statement, owner=owner, currency="EUR", amount=1, requested_by=owner, requested_at=DAY
    )
    gave_up, delivered = (
        PayoutDelivery.objects.create(payout=payout, body={}, created_at=DAY, next_attempt_at=DAY + timedelta(hours=6),
                                      attempts=webhooks.MAX_ATTEMPTS, last_error="HTTP 503", delivered_at=at)
        for at in (None, DAY)
    )  # fmt: skip
    staff(operator)
    client.force_login(operator)
    answer = client.post("/admin/marketplace/payoutdelivery/", {
        "action": "retry_deliveries", "_selected_action": [gave_up.pk, delivered.pk],
    })  # fmt: skip
    assert answer.status_code == 302
    gave_up.refresh_from_db()
    delivered.refresh_from_db()
    assert gave_up.attempts == 0 and gave_up.next_attempt_at > DAY + timedelta(days=1)
    assert gave_up.last_error == "HTTP 503", "kept until the next attempt says otherwise"
    assert (delivered.attempts, delivered.next_attempt_at) == (webhooks.MAX_ATTEMPTS, DAY + timedelta(hours=6))
    from marketplace.collectors import collect_money

    families = {f.name: f for f in collect_money()}
    undelivered = {
        s.labels["state"]: s.value for s in families["nodepool_marketplace_payout_webhooks_undelivered"].samples
    }
    assert undelivered == {"pending": 1, "gave_up": 0}
