"""Owners read the events of their own payouts, payout holds, line appeals and statements (events of
no node: ``data.owner`` names them, fleet.event_types' owner_key) in GET /events, data whole;
another owner and lease clients read none of them. Every payout transition writes one event, and
retention keeps them all."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User

from fleet.events import Actor, record_event
from fleet.models import NodeEvent
from fleet.retention import prune_events
from marketplace import holds, line_appeals, payouts
from marketplace.choices import HoldReason
from marketplace.models import Statement
from tests.marketplace.test_marketplace_money_api import (  # noqa: F401  (fixtures)
    API,
    NEXT,
    final_statement,
    reconcile_and_finalize,
    second_operator_api,
)

pytestmark = pytest.mark.django_db


def as_actor(user):
    return Actor("user", user.username, user=user)


@pytest.fixture
def money_story(final_statement, owner, operator, second_operator_api):  # noqa: F811
    """oscar's statement: held and released, a line appealed and rejected, paid, then reversed."""
    statement, period, line = final_statement
    statement = reconcile_and_finalize(statement, period)
    second = User.objects.get(username="paula-operator")
    hold = holds._hold(statement, HoldReason.OUTLIER, "10x his last day", {}, NEXT)
    holds.hold_release(hold_id=hold.pk, reason="a new node", expected_version=1, actor=as_actor(operator), now=NEXT)
    appeal = line_appeals.line_appeal_create(owner=owner, line_id=line.pk, message="ran longer", actor=as_actor(owner))
    line_appeals.line_appeal_resolve(appeal_id=appeal.pk, outcome="rejected", resolution="as metered", amount=None,
                                expected_version=1, actor=as_actor(operator), now=NEXT)  # fmt: skip
    payout = payouts.payout_request(statement_id=statement.pk, currency="EUR", actor=as_actor(operator), now=NEXT)
    payout = payouts.payout_approve(payout_id=payout.pk, expected_version=1, actor=as_actor(second), now=NEXT)
    payout = payouts.payout_mark_paid(payout_id=payout.pk, external_reference="SEPA-9", expected_version=2,
                                      actor=as_actor(operator), now=NEXT)  # fmt: skip
    payouts.payout_reverse(payout_id=payout.pk, reason="chargeback", expected_version=3, actor=as_actor(operator),
                           now=NEXT)  # fmt: skip
    return statement


def money_events(api):
    answer = api.get(f"{API}/events", {"type": "statement", "page_size": 100})
    assert answer.status_code == 200, answer.content
    return [(e["subject_type"], e["from_state"], e["to_state"]) for e in answer.json()["results"]]


def test_the_owner_reads_the_events_of_their_money_with_data(money_story, owner_api, operator_api):
    seen = money_events(owner_api)
    assert seen == [s for s in money_events(operator_api) if s[0] != "pool_period"]  # a pool's, not his
    assert [s for s in reversed(seen) if s[0] == "payout"] == [
        ("payout", "", "requested"), ("payout", "requested", "approved"), ("payout", "approved", "paid"),
        ("payout", "paid", "reversed"),
    ]  # fmt: skip
    assert ("payout_hold", "held", "released") in seen and ("payout_hold", "", "held") in seen
    assert ("line_appeal", "open", "rejected") in seen and ("line_appeal", "", "open") in seen
    assert ("statement", "open", "final") in seen
    paid = owner_api.get(f"{API}/events", {"type": "statement"}).json()["results"]
    paid = next(e for e in paid if e["to_state"] == "paid")
    assert paid["data"]["amount"] == "2.42" and paid["reason"] == "paid: SEPA-9"


def test_another_owner_and_clients_read_none_of_them(money_story, other_owner, client_api):
    from tests.conftest import _api

    assert money_events(_api(other_owner)) == []
    assert money_events(client_api) == []
    # Not by another type filter either: nothing of the money in the unfiltered list.
    answer = _api(other_owner).get(f"{API}/events", {"page_size": 100}).json()["results"]
    assert not [e for e in answer if e["subject_type"] in ("payout", "payout_hold", "line_appeal", "statement")]


def test_retention_keeps_the_money_events(money_story, settings):
    before = NodeEvent.objects.filter(subject_type__in=("payout", "payout_hold", "line_appeal")).count()
    assert before == 8
    control = record_event(None, "lifecycle", Actor.system("t"), subject_type="other", subject_id="1")
    NodeEvent.objects.update(created_at=NEXT - timedelta(days=3650))
    settings.NODEPOOL = {**settings.NODEPOOL, "RETENTION_DAYS": 1, "RETENTION_KEEP_EVENT_TYPES": []}
    prune_events()
    assert NodeEvent.objects.filter(subject_type__in=("payout", "payout_hold", "line_appeal")).count() == before
    assert Statement.objects.filter(pk=money_story.pk).exists()
    assert not NodeEvent.objects.filter(pk=control.pk).exists(), "an old event that is not money is pruned"
