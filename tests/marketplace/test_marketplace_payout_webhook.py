"""The optional signed payout webhook (marketplace.webhooks): every payout transition is sent,
signed as operations.providers signs, through nodepool.egress, from a Celery task after commit;
a receiver that fails or a broker that is down never blocks the transition, and the beat sweep
retries (docs/marketplace.md, "Payout webhook")."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from fleet.events import Actor
from fleet.models import NodeEvent
from marketplace import payouts, tasks, webhooks
from marketplace.models import Payout, PayoutDelivery
from nodepool import failsafe
from operations.providers import verify
from tests.egress_support import Receiver, allow_loopback
from tests.marketplace.test_marketplace_money_api import (  # noqa: F401  (fixtures)
    NEXT,
    final_statement,
    reconcile_and_finalize,
)

pytestmark = pytest.mark.django_db
SECRET = "payout-hook-secret"


def hooked(settings, url: str) -> None:
    settings.NODEPOOL = {**settings.NODEPOOL, "PAYOUT_WEBHOOK_URL": url, "PAYOUT_WEBHOOK_SECRET": SECRET}


@pytest.fixture
def receiver(settings):
    allow_loopback(settings)
    hook = Receiver()
    hooked(settings, hook.url)
    yield hook
    hook.close()


@pytest.fixture
def people(operator):
    from django.contrib.auth.models import Group, User

    from nodepool.api.permissions import OPERATORS

    second = User.objects.create_user(username="paula-operator", password="pw")
    second.groups.add(Group.objects.get_or_create(name=OPERATORS)[0])
    return Actor("user", operator.username, user=operator), Actor("user", second.username, user=second)


def request_and_approve(final_statement, people, capture):  # noqa: F811
    statement, period, _ = final_statement
    reconcile_and_finalize(statement, period)
    requester, approver = people
    with capture(execute=True):
        payout = payouts.payout_request(statement_id=statement.pk, currency="EUR", actor=requester, now=NEXT)
    with capture(execute=True):
        payout = payouts.payout_approve(payout_id=payout.pk, expected_version=1, actor=approver, now=NEXT)
    return payout


def test_every_transition_is_sent_signed_and_verifiable(
    final_statement,  # noqa: F811
    people,
    receiver,
    django_capture_on_commit_callbacks,
):
    payout = request_and_approve(final_statement, people, django_capture_on_commit_callbacks)
    with django_capture_on_commit_callbacks(execute=True):
        payouts.payout_mark_paid(
            payout_id=payout.pk, external_reference="SEPA-77", expected_version=2, actor=people[0], now=NEXT
        )
    assert len(receiver.requests) == 3
    seen = []
    for (method, path, body), headers in zip(receiver.requests, receiver.request_headers, strict=True):
        assert (method, path) == ("POST", "/hook")
        data = verify(SECRET, headers, body, remember=False)  # the provider webhook's receiver check
        seen.append((data["type"], data["payout"]["from_state"], data["payout"]["amount"]))
        assert data["payout"]["id"] == str(payout.uid)
    assert seen == [("payout.requested", "", "2.42"), ("payout.approved", "requested", "2.42"),
                    ("payout.paid", "approved", "2.42")]  # fmt: skip
    assert json.loads(receiver.requests[-1][2])["payout"]["external_reference"] == "SEPA-77"
    assert PayoutDelivery.objects.filter(delivered_at=None).count() == 0
    # A tampered body does not verify: the signature covers it.
    headers, body = receiver.request_headers[0], receiver.requests[0][2]
    from operations.providers import SignatureError

    with pytest.raises(SignatureError):
        verify(SECRET, headers, body.replace(b"2.42", b"9.99"), remember=False)


def test_a_failing_receiver_never_blocks_the_transition_and_the_sweep_retries(
    final_statement,  # noqa: F811
    people,
    receiver,
    django_capture_on_commit_callbacks,
):
    receiver.status = 503
    payout = request_and_approve(final_statement, people, django_capture_on_commit_callbacks)
    assert Payout.objects.get(pk=payout.pk).state == "approved"
    pending = list(PayoutDelivery.objects.filter(delivered_at=None).order_by("id"))
    assert [(d.attempts, d.last_error) for d in pending] == [(1, "HTTP 503 Service Unavailable")] * 2
    assert len(receiver.requests) == 2
    # Not due yet: the sweep sends nothing.
    assert webhooks.deliver_due(now=pending[0].next_attempt_at - timedelta(seconds=1)) == {}
    receiver.status = 200
    later = max(d.next_attempt_at for d in PayoutDelivery.objects.all()) + timedelta(seconds=1)
    assert webhooks.deliver_due(now=later) == {"delivered": 2}
    assert PayoutDelivery.objects.filter(delivered_at=None).count() == 0
    # Delivered once: the next sweep sends nothing again.
    before = len(receiver.requests)
    assert webhooks.deliver_due(now=later + timedelta(hours=1)) == {}
    assert len(receiver.requests) == before


def test_backoff_doubles_up_to_six_hours_then_gives_up(final_statement, people, receiver):  # noqa: F811
    assert [webhooks.backoff(n).total_seconds() for n in (1, 2, 3, 10, 11)] == [30, 60, 120, 15360, 6 * 3600]
    receiver.status = 500
    statement, period, _ = final_statement
    reconcile_and_finalize(statement, period)
    payouts.payout_request(statement_id=statement.pk, currency="EUR", actor=people[0], now=NEXT)
    delivery = PayoutDelivery.objects.get()
    outcomes = [webhooks.deliver(delivery.pk) for _ in range(webhooks.MAX_ATTEMPTS + 1)]
    assert outcomes[-3:] == ["failed", "gave_up", "skipped"]
    assert PayoutDelivery.objects.get().attempts == webhooks.MAX_ATTEMPTS


def test_a_broker_that_is_down_fails_open_and_the_sweep_sends(
    final_statement,  # noqa: F811
    people,
    receiver,
    monkeypatch,
    django_capture_on_commit_callbacks,
):
    def broker_down(*args, **kwargs):
        raise ConnectionRefusedError("broker down")

    monkeypatch.setattr(tasks.deliver_payout_webhook, "apply_async", broker_down)
    try:
        payout = request_and_approve(final_statement, people, django_capture_on_commit_callbacks)
    finally:
        failsafe.BROKER_CIRCUIT.reset()
    assert Payout.objects.get(pk=payout.pk).state == "approved"
    assert receiver.requests == []
    assert PayoutDelivery.objects.filter(delivered_at=None, attempts=0).count() == 2
    assert tasks.deliver_payout_webhooks() == {"delivered": 2}
    assert [json.loads(body)["type"] for _, _, body in receiver.requests] == ["payout.requested", "payout.approved"]


def test_a_destination_egress_refuses_is_recorded_not_raised(
    final_statement,  # noqa: F811
    people,
    settings,
    django_capture_on_commit_callbacks,
):
    hooked(settings, "http://169.254.169.254/latest/meta-data/")
    settings.NODEPOOL_EGRESS_ALLOW = []
    payout = request_and_approve(final_statement, people, django_capture_on_commit_callbacks)
    assert payout.state == "approved"
    errors = set(PayoutDelivery.objects.values_list("last_error", flat=True))
    assert len(errors) == 1 and errors.pop().startswith("destination not allowed")


def test_no_webhook_configured_writes_no_delivery(final_statement, people, settings):  # noqa: F811
    hooked(settings, "")
    statement, period, _ = final_statement
    reconcile_and_finalize(statement, period)
    payouts.payout_request(statement_id=statement.pk, currency="EUR", actor=people[0], now=NEXT)
    assert PayoutDelivery.objects.count() == 0
    assert NodeEvent.objects.filter(subject_type="payout").count() == 1
