"""The money's admin pages: operators read and act (release a hold with a reason); owners read
their own payouts, holds and line appeals and no one else's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from marketplace.models import PayoutHold, Statement

pytestmark = pytest.mark.django_db
DAY = datetime(2026, 11, 2, tzinfo=UTC)
PAGES = ["poolperiod", "mismatchitem", "payout", "payouthold", "lineappeal", "nodeavailability"]


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
