"""The optional signed payout webhook (docs/marketplace.md, "Payout webhook").

When ``NODEPOOL_PAYOUT_WEBHOOK_URL`` is set, every payout transition (requested, approved, paid,
failed, reversed, requested again) is POSTed there as JSON::

    {"delivery_id": "<uuid>", "type": "payout.paid", "occurred_at": "<ISO 8601>",
     "payout": {"id": "<payout uid>", "statement", "owner", "currency", "amount": "4.84",
                "state": "paid", "from_state": "approved", "external_reference", "version"}}

signed like the autoscaling webhook (operations.providers: HMAC-SHA256 of ``<timestamp>.<body>``
under ``NODEPOOL_PAYOUT_WEBHOOK_SECRET``, headers ``X-Nodepool-Timestamp``,
``X-Nodepool-Signature``, ``X-Nodepool-Delivery``; ``operations.providers.verify`` is the
receiver's check) and sent through :func:`nodepool.egress.post_json` (public destinations only,
unless ``NODEPOOL_EGRESS_ALLOW`` allows more; no redirects).

The transition never waits for the receiver: it writes a :class:`PayoutDelivery` row (the
outbox) in its own transaction and, after commit, hands the row to the Celery task
``marketplace.deliver_payout_webhook`` through :func:`nodepool.failsafe.publish` (one attempt; a
broker that is down is logged and swallowed). A failed send (refused destination, timeout,
non-2xx) sets ``next_attempt_at`` with exponential backoff (30 s doubling, at most 6 h); the beat
task ``marketplace.deliver_payout_webhooks`` sends every due row, so a lost broker message or a
receiver that was down is retried. After ``MAX_ATTEMPTS`` a row stays undelivered (its
``last_error`` says why) and is shown in the admin. A receiver may see one notice twice (a worker
that dies after the send): it drops the repeated ``delivery_id``.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from nodepool import egress, failsafe
from nodepool.celery import app as celery_app
from operations.providers import signed_headers

from . import conf
from .models import Payout, PayoutDelivery

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 12
FIRST_BACKOFF = timedelta(seconds=30)
MAX_BACKOFF = timedelta(hours=6)
TIMEOUT = 10.0  # seconds, connecting and each read/write
SWEEP_BATCH = 100


def url() -> str:
    return conf.get("PAYOUT_WEBHOOK_URL") or ""


def backoff(attempts: int) -> timedelta:
    """Wait after the ``attempts``-th failed send: 30 s, 1 min, 2 min … at most 6 h."""
    return min(FIRST_BACKOFF * (2 ** max(attempts - 1, 0)), MAX_BACKOFF)


def enqueue(payout: Payout, from_state: str, now: datetime) -> PayoutDelivery | None:
    """Record the notice of ``payout``'s transition (call it inside the transition's transaction)
    and send it after commit. None when no webhook is configured."""
    if not url():
        return None
    # The task sends it at once; the sweep only if that has not happened within the first backoff
    # (a lost broker message), so the two rarely race (and when they do, the row lock decides).
    delivery = PayoutDelivery(payout=payout, created_at=now, next_attempt_at=now + FIRST_BACKOFF, body={})
    delivery.body = {
        "delivery_id": str(delivery.delivery_id),
        "type": f"payout.{payout.state}",
        "occurred_at": now.isoformat(),
        "payout": {
            "id": str(payout.uid),
            "statement": payout.statement_id,
            "owner": payout.owner.get_username(),
            "currency": payout.currency,
            "amount": str(payout.amount),
            "state": payout.state,
            "from_state": from_state,
            "external_reference": payout.external_reference,
            "version": payout.version,
        },
    }
    delivery.save()
    transaction.on_commit(_publisher(delivery.pk))
    return delivery


def _publisher(delivery_pk: int):
    def publish():
        # By name (marketplace.tasks imports this module): no import cycle.
        failsafe.publish(celery_app.signature("marketplace.deliver_payout_webhook"), args=(delivery_pk,))

    return publish


def deliver(delivery_pk: int, *, now: datetime | None = None) -> str:
    """Send one pending delivery now; returns ``delivered``, ``failed`` (retried later),
    ``gave_up`` (the last attempt failed), or ``skipped`` (delivered already, being sent by
    another worker, or no webhook configured). Never raises for the receiver's failures."""
    target, secret = url(), conf.get("PAYOUT_WEBHOOK_SECRET") or ""
    if not target or not secret:
        return "skipped"
    with transaction.atomic():
        delivery = (
            PayoutDelivery.objects.select_for_update(skip_locked=True)
            .filter(pk=delivery_pk, delivered_at=None, attempts__lt=MAX_ATTEMPTS)
            .first()
        )
        if delivery is None:
            return "skipped"
        body = json.dumps(delivery.body, separators=(",", ":"), sort_keys=True).encode()
        delivery.attempts += 1
        try:
            egress.post_json(
                target, body, headers=signed_headers(secret, body, str(delivery.delivery_id)), timeout=TIMEOUT
            ).raise_for_status()
        except egress.EgressError as exc:
            # A fixed summary ("HTTP 503 Service Unavailable", "timed out"), never the remote body.
            now = now or timezone.now()
            delivery.last_error = exc.summary[:200]
            delivery.next_attempt_at = now + backoff(delivery.attempts)
            delivery.save(update_fields=["attempts", "last_error", "next_attempt_at"])
            outcome = "gave_up" if delivery.attempts >= MAX_ATTEMPTS else "failed"
            logger.warning("payout webhook %s: attempt %d %s (%s)", delivery.delivery_id, delivery.attempts,
                           outcome, exc.summary)  # fmt: skip
            return outcome
        delivery.delivered_at, delivery.last_error = now or timezone.now(), ""
        delivery.save(update_fields=["attempts", "delivered_at", "last_error"])
    return "delivered"


def deliver_due(*, now: datetime | None = None, limit: int = SWEEP_BATCH) -> dict:
    """Beat: send the pending deliveries whose ``next_attempt_at`` has come (oldest first)."""
    now = now or timezone.now()
    due = list(
        PayoutDelivery.objects.filter(delivered_at=None, attempts__lt=MAX_ATTEMPTS, next_attempt_at__lte=now)
        .order_by("next_attempt_at", "id")
        .values_list("pk", flat=True)[:limit]
    )
    outcomes: dict[str, int] = {}
    for pk in due:
        outcome = deliver(pk, now=now)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def retry(delivery_ids, *, now: datetime | None = None) -> int:
    """Give undelivered notices (those that gave up included) a fresh ``MAX_ATTEMPTS``, due now:
    the beat task sends them again with their original ``delivery_id`` (a receiver drops one it
    has). ``last_error`` stays until the next attempt. Delivered rows are left alone. Returns the
    number of rows re-armed."""
    now = now or timezone.now()
    return PayoutDelivery.objects.filter(pk__in=list(delivery_ids), delivered_at=None).update(
        attempts=0, next_attempt_at=now
    )
