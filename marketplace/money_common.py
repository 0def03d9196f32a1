"""What the money services (payouts, payout holds, line appeals) share: the check of a required
text field and the ``statement`` event they record (subject ``payout``, ``payout_hold`` or
``line_appeal``: read by the owner and operators only)."""

from __future__ import annotations

from fleet.events import Actor, record_event
from nodepool.api.problems import Problem

from . import event_types
from .errors import INVALID_FIELD

MAX_TEXT = 4000


def required_text(value, name: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_TEXT:
        raise Problem(
            f"{name}: required, a non-empty string of at most {MAX_TEXT} characters.", INVALID_FIELD, field=name
        )
    return value.strip()


def money_event(
    actor: Actor, subject_type: str, subject_id, *, from_state: str, to_state: str, reason: str, data: dict
):
    record_event(
        None,
        event_types.STATEMENT,
        actor,
        from_state=from_state,
        to_state=to_state,
        reason=reason[:2000],
        subject_type=subject_type,
        subject_id=subject_id,
        data=data,
    )
