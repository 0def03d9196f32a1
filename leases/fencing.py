"""Fenced writes on a lease: renew, release, job events, checkpoint requests, token validation.

Every write carries the lease's fencing token and node incarnation and is checked by
:func:`check_fence` before a compare-and-swap that repeats the same conditions, so a stale writer
is refused (409/410) and changes nothing even when it races a legitimate one.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from fleet import clock
from fleet.choices import Lifecycle
from fleet.errors import NODE_RETIRED
from fleet.events import Actor, record_event
from fleet.instructions import Instruction, post_instructions
from fleet.models import Node
from nodepool import fsm
from nodepool.api.errors import CONCURRENT_MODIFICATION
from nodepool.api.problems import Conflict, Gone, NotFound
from nodepool.api.strict import refuse_unknown_members

from . import event_types
from .choices import (
    LIVE_LEASE_STATES,
    TERMINAL_LEASE_STATES,
    CheckpointState,
    LeaseState,
    ReleaseOutcome,
    WorkloadState,
)
from .errors import LEASE_EXPIRED, LEASE_NOT_FOUND, LEASE_SUPERSEDED, STALE_FENCING_TOKEN, STALE_INCARNATION
from .lifecycle import end_lease
from .models import FencingSequence, Lease, LeaseCheckpoint
from .secrets import verify_lease_secret
from .selectors import fence_status, visible
from .spec import bad


# --- fencing checks ------------------------------------------------------------------------------
def _int_field(data: Any, name: str, *, required: bool = True) -> int | None:
    value = data.get(name) if isinstance(data, dict) else None
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad(name, "required: a non-negative integer")
    return value


def check_fence(lease: Lease, *, fencing_token: int, node_incarnation: int, now) -> None:
    """Refuse a write carrying a stale view of ``lease``. Order matters: the most specific answer.

    Raises:
        Gone 410 ``node_retired``; Conflict 409 ``lease_superseded`` (a newer lease exists for the
        workload); Gone 410 ``lease_ended`` / ``lease_expired``; Conflict 409 ``stale_fencing_token``
        or ``stale_incarnation``.
    """
    node = lease.node
    if node.lifecycle == Lifecycle.RETIRED:
        raise Gone("The lease's node is retired.", NODE_RETIRED)
    latest = FencingSequence.objects.filter(pk=lease.workload_id).values_list("last_token", flat=True).first() or 0
    newer = Lease.objects.filter(workload_id=lease.workload_id, fencing_token__gt=lease.fencing_token).exists()
    if newer:
        raise Conflict(
            f"Lease {lease.pk} was superseded by a newer lease of {lease.workload_id!r}.",
            LEASE_SUPERSEDED,
            current_token=latest,
        )
    if lease.state in TERMINAL_LEASE_STATES:
        code = "lease_expired" if lease.state == LeaseState.EXPIRED else "lease_ended"
        raise Gone(f"Lease {lease.pk} is {lease.state}; terminal leases never come back.", code)
    if lease.expires_at <= now and not clock.still_valid(lease.expires_at, now):
        # Judged at control-plane time: a forward clock jump the sweep has not noticed yet does
        # not expire a lease (fleet.clock).
        raise Gone(f"Lease {lease.pk} expired at {lease.expires_at.isoformat()}.", LEASE_EXPIRED)
    if fencing_token != lease.fencing_token:
        raise Conflict(
            f"Fencing token {fencing_token} is not this lease's ({lease.fencing_token}).",
            STALE_FENCING_TOKEN,
            current_token=lease.fencing_token,
        )
    if node_incarnation != lease.node_incarnation or node_incarnation < node.incarnation:
        raise Conflict(
            f"Node incarnation {node_incarnation} is stale (lease holds {lease.node_incarnation}, "
            f"node is at {node.incarnation}).",
            STALE_INCARNATION,
            current_incarnation=node.incarnation,
        )


def _lease_for_write(lease_id, *, user=None, node=None) -> Lease:
    queryset = Lease.objects.select_related("node")
    if node is not None:
        queryset = queryset.filter(node=node)
    elif user is not None:
        queryset = visible(queryset, user)
    lease = queryset.filter(pk=lease_id).first()
    if lease is None:
        raise NotFound("No such lease.", LEASE_NOT_FOUND)
    return lease


# The members each fenced write reads; anything else is 400 ``unknown_field`` (nodepool.api.strict).
FENCE_MEMBERS = frozenset({"fencing_token", "node_incarnation"})
RENEW_MEMBERS = FENCE_MEMBERS | {"ttl_seconds"}
RELEASE_MEMBERS = FENCE_MEMBERS | {"outcome", "reason"}
EVENT_MEMBERS = FENCE_MEMBERS | {"state", "message"}
VALIDATE_MEMBERS = frozenset({"workload_id", "fencing_token", "lease_secret"})


def _optional_text(data: dict, name: str, *, limit: int = 2000) -> str:
    """An optional string member: absent or null is ``""``; anything but a JSON string is a 400
    (``"reason": {}`` or ``"message": 0`` must not pass for "none given")."""
    value = data.get(name)
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > limit:
        raise bad(name, f"must be a string of at most {limit} characters")
    return value


def lease_renew(*, lease_id, data: Any, user, actor: Actor, now=None) -> Lease:
    """Extend a live lease by ``ttl_seconds`` (default: its own TTL) from now. Raises as :func:`check_fence`."""
    now = now or timezone.now()
    refuse_unknown_members(data, RENEW_MEMBERS)
    token, incarnation = _int_field(data, "fencing_token"), _int_field(data, "node_incarnation")
    ttl = _int_field(data, "ttl_seconds", required=False)
    if ttl is not None and not 1 <= ttl <= 7 * 24 * 3600:
        raise bad("ttl_seconds", "must be from 1 to 604800")
    lease = _lease_for_write(lease_id, user=user)
    check_fence(lease, fencing_token=token, node_incarnation=incarnation, now=now)
    ttl = ttl or lease.ttl_seconds
    valid_at = now if lease.expires_at > now else clock.control_plane_now(now)
    with transaction.atomic():
        renewed = Lease.objects.filter(
            pk=lease.pk,
            state__in=LIVE_LEASE_STATES,
            expires_at__gt=valid_at,
            fencing_token=token,
            node_incarnation=incarnation,
        ).update(expires_at=now + timedelta(seconds=ttl), ttl_seconds=ttl, version=F("version") + 1)
    if not renewed:  # it changed between the check and the swap: answer from the new state
        check_fence(
            Lease.objects.select_related("node").get(pk=lease.pk),
            fencing_token=token,
            node_incarnation=incarnation,
            now=now,
        )
        raise Conflict("The lease changed while renewing; read it again.", CONCURRENT_MODIFICATION)
    if lease.command:
        # The new expiry re-derives the lease's secret: the node fetches it with a status report.
        post_instructions([lease.node_id], Instruction.SECRET)
    return Lease.objects.select_related("pool", "shape", "client").get(pk=lease.pk)


def lease_release(*, lease_id, data: Any, user, actor: Actor, now=None) -> Lease:
    """End a live lease as ``released`` with an ``outcome`` (succeeded, failed, cancelled…)."""
    now = now or timezone.now()
    refuse_unknown_members(data, RELEASE_MEMBERS)
    token, incarnation = _int_field(data, "fencing_token"), _int_field(data, "node_incarnation")
    outcome = data.get("outcome")
    if outcome is None:
        outcome = ReleaseOutcome.UNKNOWN
    if not isinstance(outcome, str) or outcome not in ReleaseOutcome.values:
        raise bad("outcome", f"must be one of {', '.join(ReleaseOutcome.values)}")
    reason = _optional_text(data, "reason") or f"released by {actor.name}: {outcome}"
    lease = _lease_for_write(lease_id, user=user)
    check_fence(lease, fencing_token=token, node_incarnation=incarnation, now=now)
    fence = {"fencing_token": token, "node_incarnation": incarnation}
    ended = end_lease(
        lease.pk, to_state=LeaseState.RELEASED, actor=actor, reason=reason, now=now, outcome=outcome, fence=fence
    )
    if ended is None:
        check_fence(
            Lease.objects.select_related("node").get(pk=lease.pk),
            fencing_token=token,
            node_incarnation=incarnation,
            now=now,
        )
        raise Conflict("The lease changed while releasing; read it again.", CONCURRENT_MODIFICATION)
    return ended


# What a node may report; ``unknown`` is the control plane's word for a workload on an ended lease.
REPORTABLE_WORKLOAD_STATES = tuple(v for v in WorkloadState.values if v != WorkloadState.UNKNOWN)


def lease_report_event(*, lease_id, data: Any, node: Node, actor: Actor, now=None) -> Lease:
    """A node reports its job's state. ``running`` activates a granted lease; ``succeeded`` and
    ``failed`` end it as released with that outcome; ``checkpointed`` clears a checkpoint request."""
    now = now or timezone.now()
    refuse_unknown_members(data, EVENT_MEMBERS)
    token, incarnation = _int_field(data, "fencing_token"), _int_field(data, "node_incarnation")
    state = data.get("state")
    if not isinstance(state, str) or state not in REPORTABLE_WORKLOAD_STATES:
        raise bad("state", f"must be one of {', '.join(REPORTABLE_WORKLOAD_STATES)}")
    message = _optional_text(data, "message")
    lease = _lease_for_write(lease_id, node=node)
    check_fence(lease, fencing_token=token, node_incarnation=incarnation, now=now)
    fence = {"fencing_token": token, "node_incarnation": incarnation}
    if state in (WorkloadState.SUCCEEDED, WorkloadState.FAILED):
        ended = end_lease(
            lease.pk,
            to_state=LeaseState.RELEASED,
            actor=actor,
            now=now,
            outcome=state,
            workload_state=state,
            reason=message or f"the node reported {state}",
            fence=fence,
        )
        if ended is None:
            raise Conflict("The lease changed while reporting; read it again.", CONCURRENT_MODIFICATION)
        return ended
    with transaction.atomic():
        claim = Lease.objects.filter(pk=lease.pk, state__in=LIVE_LEASE_STATES, **fence)
        changes: dict[str, Any] = {"workload_state": state, "last_reported_at": now, "version": F("version") + 1}
        if state == WorkloadState.RUNNING:
            activated = fsm.move(claim, "activate", activated_at=now, missed_reports=0, **changes)
            if activated:
                record_event(
                    lease.node_id,
                    event_types.LEASE,
                    actor,
                    from_state=LeaseState.GRANTED,
                    to_state=LeaseState.ACTIVE,
                    reason=message or "the node reported running",
                    data={"lease_id": str(lease.pk), "fencing_token": token},
                )
            elif not claim.update(missed_reports=0, **changes):
                raise Conflict("The lease changed while reporting; read it again.", CONCURRENT_MODIFICATION)
        else:
            if not claim.update(checkpoint_requested_at=None, **changes):
                raise Conflict("The lease changed while reporting; read it again.", CONCURRENT_MODIFICATION)
            if state == WorkloadState.CHECKPOINTED:
                _checkpoint_taken(lease, actor=actor, message=message, now=now)
    return Lease.objects.select_related("pool", "shape", "client").get(pk=lease.pk)


# Per-lease secret verifiers: ``verifier(lease, secret) -> bool``. Issue 12 (per-lease secrets,
# an HMAC) registers one in its AppConfig.ready(); with none registered no secret ever matches.
LEASE_SECRET_VERIFIERS: list = []


def register_lease_secret_verifier(verifier) -> None:
    """Let callers that present a lease's own secret validate its fencing token.

    Args:
        verifier: ``callable(lease: Lease, secret: str) -> bool``; must compare in constant time.
    """
    if verifier not in LEASE_SECRET_VERIFIERS:
        LEASE_SECRET_VERIFIERS.append(verifier)


def lease_secret_matches(lease: Lease, secret: Any) -> bool:
    """True when a registered verifier accepts ``secret`` for ``lease``."""
    if not isinstance(secret, str) or not secret:
        return False
    return any(verifier(lease, secret) for verifier in LEASE_SECRET_VERIFIERS)


def fencing_validate(*, data: Any, may_see=None) -> dict:
    """Is ``(workload_id, fencing_token)`` the workload's current, live lease?

    Args:
        data: the request body ``{"workload_id": str, "fencing_token": int, "lease_secret"?: str}``.
        may_see: ``callable(lease) -> bool``, who may learn about the workload's latest lease (the
            view passes the caller's rights); ``None`` lets everyone see.

    Returns ``{"valid": bool, "current_token": int | None, "last_issued_token": int | None,
    "lease_id": str | None}``.

    Raises:
        Problem: 400 for a missing or malformed ``workload_id`` / ``fencing_token``.
        NotFound: 404 when the workload has no lease, or the caller may not see its latest one
            (the same answer, so the endpoint does not reveal which workloads exist).

    With only ``{"lease_secret": str}`` (no ``workload_id``), checks a per-lease secret on its own
    (:func:`leases.secrets.verify_lease_secret`): the secret names its lease and proves itself, so the
    answer is :meth:`leases.secrets.SecretCheck.as_dict` (``valid``, ``code``, the lease it names).
    """
    refuse_unknown_members(data, VALIDATE_MEMBERS)
    if data.get("lease_secret") is not None and not isinstance(data["lease_secret"], str):
        # Beside a workload id too: a secret that is not a string must not pass for "none sent".
        raise bad("lease_secret", "must be a string: the secret the lease's grant answer gave")
    if "lease_secret" in data and "workload_id" not in data:
        # The body's shape first (a 400, as for the other form): a secret is a string, and a
        # fencing token, when one is sent beside it, a token (schemathesis sent an object and -2681).
        if not isinstance(data.get("lease_secret"), str) or not data["lease_secret"]:
            raise bad("lease_secret", "must be a string: the secret the lease's grant answer gave")
        if "fencing_token" in data:
            _int_field(data, "fencing_token")
        return verify_lease_secret(data.get("lease_secret")).as_dict()
    workload_id = data.get("workload_id")
    if not isinstance(workload_id, str) or not workload_id:
        raise bad("workload_id", "required: the workload's id")
    token = _int_field(data, "fencing_token")
    return fence_status(workload_id, token, may_see=may_see)


def request_checkpoint(*, lease: Lease, actor: Actor, now=None) -> int:
    """Ask the node (in its next heartbeat) to checkpoint ``lease``. Returns 1 if newly asked."""
    now = now or timezone.now()
    with transaction.atomic():
        asked = Lease.objects.filter(
            pk=lease.pk, state__in=LIVE_LEASE_STATES, checkpoint_requested_at__isnull=True
        ).update(checkpoint_requested_at=now, version=F("version") + 1)
        if asked:
            # Checkpoint history (execution evidence): one row per checkpoint requested.
            LeaseCheckpoint.objects.create(
                lease_id=lease.pk,
                fencing_token=lease.fencing_token,
                node_incarnation=lease.node_incarnation,
                requested_at=now,
                requested_by=actor.name[:150],
            )
            record_event(
                lease.node_id,
                event_types.CHECKPOINT,
                actor,
                to_state=CheckpointState.REQUESTED,
                reason="checkpoint requested",
                lease_id=lease.pk,
                workload_id=lease.workload_id,
            )
    if asked:
        post_instructions([lease.node_id], Instruction.CHECKPOINT)
    return asked


def record_checkpoint_requests(leases, *, actor: Actor, now) -> None:
    """Checkpoint history for requests set in bulk (a drain's checkpoint policy): one row per lease.

    ``leases``: Lease objects whose ``checkpoint_requested_at`` was just set. A lease that already
    has a pending row keeps it (the partial unique constraint; conflicts are ignored)."""
    LeaseCheckpoint.objects.bulk_create(
        [
            LeaseCheckpoint(
                lease_id=lease.pk,
                fencing_token=lease.fencing_token,
                node_incarnation=lease.node_incarnation,
                requested_at=now,
                requested_by=actor.name[:150],
            )
            for lease in leases
        ],
        ignore_conflicts=True,
    )


def withdraw_checkpoint_requests(lease_ids) -> int:
    """Pending checkpoint rows of ``lease_ids`` become ``withdrawn`` (a cancelled drain)."""
    return fsm.move(LeaseCheckpoint.objects.filter(lease_id__in=list(lease_ids)), "withdraw")


def _checkpoint_taken(lease: Lease, *, actor: Actor, message: str, now) -> None:
    """The node reported ``checkpointed``: the pending request is taken (or an unasked one recorded)."""
    taken = fsm.move(LeaseCheckpoint.objects.filter(lease_id=lease.pk), "take", taken_at=now, message=message[:2000])
    if not taken:
        LeaseCheckpoint.objects.create(
            lease_id=lease.pk,
            state=CheckpointState.TAKEN,
            fencing_token=lease.fencing_token,
            node_incarnation=lease.node_incarnation,
            taken_at=now,
            message=message[:2000],
        )
    record_event(
        lease.node_id,
        event_types.CHECKPOINT,
        actor,
        to_state=CheckpointState.TAKEN,
        reason=message or "the node reported checkpointed",
        lease_id=lease.pk,
        workload_id=lease.workload_id,
    )
