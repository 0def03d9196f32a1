"""Liveness renewals: "I am alive", in a few bytes, applied by one conditional statement.

The split Kubernetes made with node Leases (KEP-589): a node renews often and cheaply, and sends
its full status (fleet.heartbeats, the *status report*) only on change, when a flag asks for it,
and at least every ``Pool.status_report_interval``. Liveness follows whichever arrived last;
readiness and health come from the last status report.

One renewal is one UPDATE on the node's row, with everything a renewal must check in its WHERE:

* **authentication**: an ``EXISTS`` on the credential (by its unique prefix and the SHA-256 of
  the secret, neither revoked nor expired, and belonging to this very node);
* **ordering**: the same incarnation, a higher sequence;
* **liveness**: the node is ``alive`` (a node coming back needs an event: the slower path below);
* **flood guard**: not sooner than half the interval last told (``renewal_not_before``), unless
  the interval changed since (``interval_given``);
* the node is not retired, and is in the pool whose timings this process used.

It sets the receipt time, the sequence, the next liveness deadline and the flood guard, and
returns the pending-instructions marker (fleet.instructions) plus the credential's lifetime (the
rotation hint). When it matches no row, :func:`renew` reads the credential and the node once to
say why (401, 403, 410, an ordering code, 429) or to take the slower path: a node that was not
``alive`` is revived with a liveness event in one transaction.

Timings are per pool, cached per process (fleet.pacing, shared with the status reports), and
each process remembers each node's pool (checked by the statement itself, so a moved node is never wrong).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from nodepool.api.errors import AUTHENTICATION_FAILED, FORBIDDEN
from nodepool.api.problems import Gone, Problem
from nodepool.db import prepared_cursor

from . import clock, event_types, liveness, pacing, signals, sql
from . import secrets as node_secrets
from .choices import ActorType, Lifecycle, Liveness
from .credentials import is_superseded, revoke_lineage_on_reuse
from .errors import CONCURRENT_RENEWAL, NODE_RETIRED
from .events import Actor, event_row
from .heartbeat_rules import (
    APPLIED,
    DUPLICATE_SEQUENCE,
    ROTATE_WHEN_REMAINING,
    STALE_INCARNATION,
    STALE_SEQUENCE,
    ordering_code,
)
from .instructions import Instruction
from .models import Node, NodeCredential, NodeEvent
from .pacing import TooManyRequests, min_spacing_fraction, pool_timings

MAX_BODY_BYTES = 256
STATUS_REPORT_REQUIRED = "status_report_required"
MAX_ATTEMPTS = 3
# Node id -> pool id, per process. Bounded: cleared when full (a miss costs one read).
_POOL_OF_NODE: dict = {}
_POOL_OF_NODE_MAX = 500_000
# A flooding node's refusal, per process: node id -> (secret digest, incarnation, interval told,
# not before). While it holds, the same credential renewing the same incarnation at the same
# interval is refused without a statement, so 50 requests in flight from one node cost this
# process a dictionary lookup each, not two database round trips.
_REFUSED_UNTIL: dict = {}


class CredentialRefused(Problem):
    """401 ``authentication_failed`` (``reason`` says which: malformed, invalid, revoked, expired)."""

    status_code = 401
    default_code = AUTHENTICATION_FAILED
    auth_header = "Node"

    def __init__(self, detail: str, reason: str):
        super().__init__(detail, AUTHENTICATION_FAILED, reason=reason)


class ForeignCredential(Problem):
    status_code = 403
    default_code = FORBIDDEN


@dataclass(frozen=True)
class RenewalOutcome:
    """``applied`` and ``code`` as for heartbeats; ``next_renewal_in`` seconds (aimed at the node's
    slot, :func:`fleet.liveness.next_heartbeat_in`); ``flags`` an :class:`fleet.instructions.Instruction`
    bit set; ``renewal_interval`` the interval told, in seconds, without the slot's offset."""

    applied: bool
    code: str
    next_renewal_in: float
    flags: int
    renewal_interval: float = 0.0


def deadline_slack(timings: liveness.Timings) -> float:
    """How much later than ``stale_after`` a renewal may set the stale deadline, in seconds.

    A renewal rewrites ``next_liveness_check_at`` (an indexed column) only when less than
    ``stale_after`` is left, and then sets it ``stale_after + slack`` ahead: one renewal in two
    writes the index instead of every one. The deadline is never earlier than ``stale_after``
    after the last renewal (no false ``stale``), and never later than the grace
    (``unreachable_after``), so ``unreachable`` and ``lost`` come exactly on time; ``stale`` may
    come up to one interval late for a node that stops renewing.
    """
    return max(0.0, min(timings.interval, timings.unreachable_after - timings.stale_after))


def forget_cached_timings() -> None:
    """Drop this process's cached timings and node pools (tests; after editing a pool)."""
    pacing.forget_timings()
    _POOL_OF_NODE.clear()
    _REFUSED_UNTIL.clear()
    _BULK_LOADED_AT.clear()


_BULK_LOADED_AT: list[float] = []


def _pool_of(node_id):
    """The pool of ``node_id`` as this process knows it. On a miss, load every node's pool in one
    query (at most once a minute): a process that just started, or a fleet that just grew, then
    pays one read for all its nodes instead of an extra statement on each node's first renewal.
    The statement checks the pool anyway, so a stale entry costs a retry, never a wrong write."""
    pool_id = _POOL_OF_NODE.get(node_id)
    if pool_id is not None:
        return pool_id
    clock = time.monotonic()
    if _BULK_LOADED_AT and clock - _BULK_LOADED_AT[0] < 60:
        return None
    _BULK_LOADED_AT[:] = [clock]
    rows = Node.objects.exclude(lifecycle=Lifecycle.RETIRED).values_list("pk", "pool_id")[:_POOL_OF_NODE_MAX]
    _POOL_OF_NODE.clear()
    _POOL_OF_NODE.update(rows)
    return _POOL_OF_NODE.get(node_id)


def _remember_pool(node_id, pool_id) -> None:
    if len(_POOL_OF_NODE) >= _POOL_OF_NODE_MAX:
        _POOL_OF_NODE.clear()
    _POOL_OF_NODE[node_id] = pool_id


def _as_datetime(value) -> datetime:
    if isinstance(value, str):  # SQLite returns the stored text
        value = parse_datetime(value)
    if timezone.is_naive(value):
        value = value.replace(tzinfo=UTC)
    return value


def _rotate(issued_at, expires_at, now: datetime) -> bool:
    issued, expires = _as_datetime(issued_at), _as_datetime(expires_at)
    lifetime = (expires - issued).total_seconds()
    return (expires - now).total_seconds() <= ROTATE_WHEN_REMAINING * max(lifetime, 0.0)


def _try_statement(
    *, node_id, pool_id: int, prefix: str, digest: str, incarnation: int, sequence: int, now: datetime,
    liveness_read: str, valid_at: datetime | None = None,
) -> tuple | None:  # fmt: skip
    """Run the conditional UPDATE once; the RETURNING row, or None when no row matched.

    ``valid_at``: the time the credential must outlive (default ``now``); the control plane's
    time after a forward clock jump (:func:`fleet.clock.control_plane_now`)."""
    timings = pool_timings(pool_id)
    revive = liveness_read != Liveness.ALIVE
    spacing = timings.interval * min_spacing_fraction()
    db_time = connection.ops.adapt_datetimefield_value
    params = {
        "sequence": sequence,
        "now": db_time(now),
        "valid_at": db_time(valid_at or now),
        "keep_after": db_time(now + timedelta(seconds=timings.stale_after)),
        "deadline": db_time(now + timedelta(seconds=timings.stale_after + deadline_slack(timings))),
        "interval": timings.interval,
        "not_before": db_time(now + timedelta(seconds=spacing)),
        "id": Node._meta.pk.get_db_prep_value(node_id, connection),
        "pool": pool_id,
        "incarnation": incarnation,
        "liveness": str(liveness_read),
        "prefix": prefix,
        "digest": digest,
    }
    if revive:
        params["alive"] = str(Liveness.ALIVE)
    with prepared_cursor() as cursor:  # planned once per connection on PostgreSQL (nodepool.db)
        cursor.execute(sql.renewal(revive), params)
        return cursor.fetchone()


def renew(*, node_id: uuid.UUID, secret: str, incarnation: int, sequence: int, request_id: str = "") -> RenewalOutcome:
    """Apply one renewal of node ``node_id`` authenticated by credential ``secret``.

    Args:
        node_id: the node in the URL.
        secret: the full node credential (``npn_<prefix>.<random>``).
        incarnation, sequence: the agent session's counters (as in status reports).
        request_id: for the liveness event of a revival.

    Returns:
        RenewalOutcome: ``applied`` (code ``applied``), or not applied with ``duplicate_sequence``,
        ``stale_sequence``, ``stale_incarnation`` or ``status_report_required`` (a newer
        incarnation: a restart is recorded only by a status report, which reconciles leases).

    Raises:
        CredentialRefused (401), ForeignCredential (403), Gone (410 ``node_retired``),
        TooManyRequests (429 with ``retry_after``). None of them writes anything.
    """
    prefix = node_secrets.split_prefix(secret, "npn")
    if prefix is None:
        raise CredentialRefused("Malformed node credential.", "credential_malformed")
    digest = node_secrets.hash_secret(secret)
    now = timezone.now()
    pool_id = _pool_of(node_id)
    refusal = remembered_refusal(node_id, digest, incarnation, now)
    if refusal is not None:
        raise refusal
    liveness_read, valid_at = Liveness.ALIVE, now
    for _attempt in range(MAX_ATTEMPTS):
        if pool_id is not None:
            if liveness_read == Liveness.ALIVE:
                row = _try_statement(
                    node_id=node_id, pool_id=pool_id, prefix=prefix, digest=digest, incarnation=incarnation,
                    sequence=sequence, now=now, liveness_read=liveness_read, valid_at=valid_at,
                )  # fmt: skip
            else:
                row = _revive(
                    node_id=node_id, pool_id=pool_id, prefix=prefix, digest=digest, incarnation=incarnation,
                    sequence=sequence, now=now, liveness_read=liveness_read, request_id=request_id,
                    valid_at=valid_at,
                )  # fmt: skip
            if row is not None:
                flags = int(row[0]) | (Instruction.ROTATE_CREDENTIAL if _rotate(row[1], row[2], now) else 0)
                timings = pool_timings(pool_id)
                next_in = liveness.next_heartbeat_in(timings, node_id=node_id, now=now)
                return RenewalOutcome(True, APPLIED, next_in, flags, timings.interval)
        # The statement matched nothing (or this process did not know the node's pool): find out why.
        pool_id, liveness_read, refusal, valid_at = _diagnose(
            node_id=node_id, prefix=prefix, secret=secret, incarnation=incarnation, sequence=sequence, now=now,
            request_id=request_id,
        )  # fmt: skip
        if refusal is not None:
            return refusal
    raise Problem("The node changed during this renewal; send it again.", CONCURRENT_RENEWAL, status_code=409)


def _diagnose(
    *, node_id, prefix, secret, incarnation, sequence, now, request_id=""
) -> tuple[int | None, str, RenewalOutcome | None, datetime]:
    """Why the statement matched nothing: raises the refusal, returns a not-applied outcome, or
    returns ``(pool_id, liveness, None, valid_at)`` for another attempt (pool learnt, node to
    revive, or a credential that looks expired but holds at the control plane's time: a forward
    clock jump the sweep has not noticed yet, judged as fleet.authentication judges it)."""
    credential = (
        NodeCredential.objects.select_related("node")
        .only(
            "secret_hash",
            "revoked_at",
            "expires_at",
            "rotated_at",
            "superseded_by_id",
            "node_id",
            *(f"node__{f}" for f in _NODE_FIELDS),
        )  # fmt: skip
        .filter(prefix=prefix)
        .order_by()
        .first()
    )
    if credential is None or not node_secrets.matches(secret, credential.secret_hash):
        raise CredentialRefused("Unknown node credential.", "credential_invalid")
    if credential.revoked_at is not None and credential.revoked_at <= now:
        raise CredentialRefused("This node credential was revoked.", "credential_revoked")
    if credential.expires_at <= now and is_superseded(credential):
        # As for every node endpoint (fleet.authentication): reuse after the overlap revokes the lineage.
        revoke_lineage_on_reuse(credential=credential, request_id=request_id, now=now)
        raise CredentialRefused(
            "This node credential was replaced by a rotation and its overlap is over; every credential of "
            "this node is now revoked. Enroll again with a bootstrap token.",
            "credential_superseded",
        )
    valid_at = now
    if credential.expires_at <= now:
        valid_at = clock.control_plane_now(now)
        if credential.expires_at <= valid_at:
            raise CredentialRefused("This node credential expired; re-enroll or rotate sooner.", "credential_expired")
    node = credential.node
    if str(node.pk) != str(node_id):
        raise ForeignCredential("A node credential may act only on its own node.")
    if node.lifecycle == Lifecycle.RETIRED:
        raise Gone("This node is retired; it can no longer send renewals.", NODE_RETIRED)
    _remember_pool(node.pk, node.pool_id)
    timings = pool_timings(node.pool_id)
    code = ordering_code(
        stored_incarnation=node.incarnation, stored_sequence=node.sequence, incarnation=incarnation, sequence=sequence
    )
    next_in = liveness.next_heartbeat_in(timings, node_id=node.pk, now=now)
    if code in (DUPLICATE_SEQUENCE, STALE_SEQUENCE, STALE_INCARNATION):
        outcome = RenewalOutcome(False, code, next_in, int(node.instructions), timings.interval)
        return node.pool_id, node.liveness, outcome, valid_at
    if incarnation > node.incarnation:
        flags = int(node.instructions) | Instruction.STATUS_REPORT
        outcome = RenewalOutcome(False, STATUS_REPORT_REQUIRED, next_in, flags, timings.interval)
        return node.pool_id, node.liveness, outcome, valid_at
    if (
        node.renewal_not_before is not None
        and node.renewal_not_before > now
        and node.interval_given is not None
        and node.interval_given == timings.interval
    ):
        if len(_REFUSED_UNTIL) >= _POOL_OF_NODE_MAX:
            _REFUSED_UNTIL.clear()
        _REFUSED_UNTIL[node.pk] = (node_secrets.hash_secret(secret), incarnation, timings.interval,
                                   node.renewal_not_before)  # fmt: skip
        raise _too_many((node.renewal_not_before - now).total_seconds(), timings.interval)
    return node.pool_id, node.liveness, None, valid_at


def has_refusals() -> bool:
    """Whether this process remembers any 429 (:func:`remembered_refusal`): a dict's truth, free."""
    return bool(_REFUSED_UNTIL)


def remembered_refusal(node_id, digest: str, incarnation: int, now: datetime) -> TooManyRequests | None:
    """The 429 this process already gave ``node_id`` for the same credential (``digest``, its
    SHA-256), incarnation and interval, while it still holds; else None (and the memo is dropped).

    No database round trip: a flood of one node costs a dictionary lookup per request, and the
    early gate (``fleet.api.renewal_views.RenewalFloodGate``) answers it before the rest of the
    request handling. The statement itself stays the authority: the memo only repeats its answer.
    """
    refused = _REFUSED_UNTIL.get(node_id)
    if refused is None:
        return None
    pool_id = _POOL_OF_NODE.get(node_id)
    still = refused[3] > now and refused[:2] == (digest, incarnation) and pool_id is not None
    if still and pool_timings(pool_id).interval == refused[2]:
        return _too_many((refused[3] - now).total_seconds(), refused[2])
    _REFUSED_UNTIL.pop(node_id, None)
    return None


def _too_many(wait: float, interval: float) -> TooManyRequests:
    return TooManyRequests(
        f"Renewals may come at most every {interval * min_spacing_fraction():g}s "
        f"(half the {interval:g}s interval told); retry in {wait:.1f}s.",
        wait,
    )


_NODE_FIELDS = (
    "pool_id", "lifecycle", "liveness", "incarnation", "sequence", "instructions", "interval_given",
    "renewal_not_before",
)  # fmt: skip


def _revive(
    *, node_id, pool_id, prefix, digest, incarnation, sequence, now, liveness_read, request_id, valid_at=None
) -> tuple | None:
    """The renewal of a node that was not ``alive``: the same statement (compare-and-swap on the
    liveness read) plus its liveness event, in one transaction."""
    with transaction.atomic():
        row = _try_statement(
            node_id=node_id, pool_id=pool_id, prefix=prefix, digest=digest, incarnation=incarnation,
            sequence=sequence, now=now, liveness_read=liveness_read, valid_at=valid_at,
        )  # fmt: skip
        if row is not None:
            actor = Actor(ActorType.NODE, f"node:{node_id}", request_id=request_id)
            NodeEvent.objects.bulk_create(
                [
                    event_row(
                        node_id,
                        event_types.LIVENESS,
                        actor,
                        from_state=liveness_read,
                        to_state=Liveness.ALIVE,
                        reason="renewal received",
                        pool=pool_id,
                    )  # fmt: skip
                ]
            )
            signals.node_revived.send(sender=Node, node_id=node_id)
    return row
