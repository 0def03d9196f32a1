"""The pure rules of a status report (fleet.heartbeats applies them; fleet.renewals orders by them
too): which report is newer, when to hint a credential rotation, the server-owned ``ClockSkew``
condition and how reported conditions merge with the stored ones.
"""

from __future__ import annotations

from datetime import datetime

from . import conf, health
from .models import NodeCredential

# Stable codes of the response.
APPLIED = "applied"
DUPLICATE_SEQUENCE = "duplicate_sequence"
STALE_SEQUENCE = "stale_sequence"
STALE_INCARNATION = "stale_incarnation"

# Rotate the credential once less than this fraction of its lifetime is left.
ROTATE_WHEN_REMAINING = 0.25
# ClockSkew clears only below this fraction of the threshold, so a skew near it does not flap.
SKEW_CLEAR_RATIO = 0.8


def ordering_code(*, stored_incarnation: int, stored_sequence: int, incarnation: int, sequence: int) -> str:
    """``applied`` when ``(incarnation, sequence)`` is newer than the stored pair, else why not."""
    if incarnation < stored_incarnation:
        return STALE_INCARNATION
    if incarnation > stored_incarnation:
        return APPLIED
    if sequence == stored_sequence:
        return DUPLICATE_SEQUENCE
    return APPLIED if sequence > stored_sequence else STALE_SEQUENCE


def rotate_hint(credential: NodeCredential | None, now: datetime) -> bool:
    """True when less than a quarter of the credential's lifetime is left (rotate before it expires)."""
    if credential is None:
        return False
    lifetime = (credential.expires_at - credential.issued_at).total_seconds()
    return (credential.expires_at - now).total_seconds() <= ROTATE_WHEN_REMAINING * max(lifetime, 0.0)


def skew_condition(previous: dict | None, skew: float, received_at: datetime) -> dict | None:
    """The server-owned ``ClockSkew`` condition for a measured skew (node clock minus server clock).

    Absent until a skew first crosses the threshold; then kept, ``False`` once it falls back below
    80 % of the threshold (hysteresis). Returns None while it has never been needed.
    """
    threshold = conf.get("CLOCK_SKEW_THRESHOLD")
    was_true = bool(previous and previous.get("status") == health.TRUE)
    limit = threshold * SKEW_CLEAR_RATIO if was_true else threshold
    if abs(skew) > limit:
        status = health.TRUE
        reason = "NodeClockAhead" if skew > 0 else "NodeClockBehind"
        message = f"the node's clock differs from the control plane's by more than {threshold:g}s"
    elif previous is None:
        return None
    else:
        status, reason, message = health.FALSE, "ClockInSync", ""
    return {"type": health.CLOCK_SKEW, "status": status, "reason": reason, "message": message}


def merge_conditions(stored: list[dict], reported: list[dict], skew: dict | None, now: datetime) -> list[dict]:
    """The node's new condition list: what it reported (its own ``ClockSkew`` ignored) plus the
    server's ``ClockSkew``, and the stored ``Unverified`` (fleet.trust) and other kept conditions
    (``health.KEPT_CONDITIONS``) as they are. ``last_transition_time``
    is kept while a condition's status holds."""
    previous = {c.get("type"): c for c in stored or []}
    stamp = now.isoformat()
    merged = []
    server_owned = (health.CLOCK_SKEW, health.STATUS_REPORT_OVERDUE, *health.KEPT_CONDITIONS)
    # Unverified (fleet.trust) and the kept conditions of higher apps (operations' Drifted): carried
    # over as stored, whatever the node says.
    kept = [previous[kind] for kind in health.KEPT_CONDITIONS if kind in previous]
    for condition in [*(c for c in reported if c["type"] not in server_owned), *([skew] if skew else []), *kept]:
        before = previous.get(condition["type"])
        same = before is not None and before.get("status") == condition["status"]
        merged.append({**condition, "last_transition_time": before.get("last_transition_time") if same else stamp})
    return merged


def condition_changes(stored: list[dict], merged: list[dict]) -> list[tuple[str, str, str, dict | None]]:
    """``[(type, old status, new status, new condition)]`` for every condition whose status or
    reason changed, appeared or disappeared (message-only changes are not events)."""
    before = {c.get("type"): c for c in stored or []}
    after = {c["type"]: c for c in merged}
    changes = []
    for kind in [*after, *(k for k in before if k not in after)]:
        old, new = before.get(kind), after.get(kind)
        old_key = (old.get("status"), old.get("reason", "")) if old else None
        new_key = (new["status"], new.get("reason", "")) if new else None
        if old_key != new_key:
            changes.append((kind, old["status"] if old else "", new["status"] if new else "", new))
    return changes
