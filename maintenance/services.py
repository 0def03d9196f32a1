"""Operator actions on a node's lifecycle: cordon, uncordon, quarantine, release, return to service, retire.

Every service follows one shape: ``transaction.atomic()`` → lock the node row
(``SELECT … FOR UPDATE`` on PostgreSQL; SQLite's IMMEDIATE transactions serialise writers) →
check the expected version (412) → ``can_proceed`` (409 listing the allowed actions) →
transition → ``save(update_fields=...)`` → ``record_event`` in the same transaction. Because the
version check happens under the row lock and every change bumps ``version``, two operators
acting on the same version cannot both win: the second sees the bumped version and gets 412.

Drains live in :mod:`maintenance.drains`; the automatic quarantine rules in :mod:`maintenance.rules`.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone
from django_fsm import can_proceed

from fleet import credentials as fleet_credentials
from fleet import event_types as fleet_events
from fleet.errors import NODE_NOT_FOUND
from fleet.events import Actor, record_event
from fleet.instructions import Instruction, post_instructions
from fleet.models import Node
from fleet.services import queue_admission
from leases import reconcile as lease_reconcile
from leases.choices import LIVE_LEASE_STATES
from leases.models import Lease
from nodepool import fsm
from nodepool.api.errors import TRANSITION_NOT_ALLOWED
from nodepool.api.problems import Conflict, NotFound
from nodepool.api.versioning import check_version

from . import event_types
from .choices import DrainState, QuarantineRule
from .errors import NODE_HAS_LIVE_LEASES
from .holds import DRAIN_PREFIX, owner_for, place_hold, remove_hold, remove_holds_where
from .models import Drain, Quarantine
from .selectors import allowed_actions, public_evidence

logger = logging.getLogger(__name__)

# Fields every lifecycle change writes (``updated_at`` is auto_now and must be listed to be saved).
LIFECYCLE_FIELDS = ["lifecycle", "lifecycle_reason", "lifecycle_changed_at", "version", "updated_at"]


def lock_node(node_id) -> Node:
    """The node row, locked for the rest of the transaction. Raises NotFound (404)."""
    try:
        return Node.objects.select_for_update(no_key=True).get(pk=node_id)
    except (Node.DoesNotExist, ValueError) as exc:
        raise NotFound(f"No node {node_id}.", NODE_NOT_FOUND) from exc


def transition_refused(node: Node, action: str) -> Conflict:
    """The 409 for an action the node's current lifecycle does not allow, naming what it does allow."""
    allowed = allowed_actions(node)
    return Conflict(
        f"Cannot {action} a node that is {node.lifecycle}; allowed from {node.lifecycle}: "
        f"{', '.join(allowed) or 'nothing (terminal)'}.",
        TRANSITION_NOT_ALLOWED,
        lifecycle=node.lifecycle,
        action=action,
        allowed_actions=allowed,
    )


def apply_transition(node: Node, transition: str, *, action: str, reason: str, now) -> str:
    """Run ``node.<transition>()`` in memory, stamp why and when, bump the version; return the old state.

    Raises:
        Conflict (409, ``transition_not_allowed``) when the FSM refuses it from the current state.
    """
    method = getattr(node, transition)
    if not can_proceed(method):
        raise transition_refused(node, action)
    from_state = node.lifecycle
    method()
    node.lifecycle_reason = reason
    node.lifecycle_changed_at = now
    node.version += 1
    return from_state


def save_transition(node: Node, *extra_fields: str) -> None:
    """Save a transition; once committed, the node's next renewal says its lifecycle changed."""
    node.save(update_fields=[*LIFECYCLE_FIELDS, *extra_fields])
    post_instructions([node.pk], Instruction.LIFECYCLE)


def record_transition(node: Node, actor: Actor, *, from_state: str, reason: str, data: dict):
    """Append (and return) the ``lifecycle`` event of a transition just saved (same transaction)."""
    return record_event(
        node, fleet_events.LIFECYCLE, actor, from_state=from_state, to_state=node.lifecycle, reason=reason, data=data
    )


def _check_expected(node: Node, expected_version: int | None) -> None:
    if expected_version is not None:
        check_version(node.version, expected_version)


def cordon_node(*, node_id, expected_version: int, reason: str, actor: Actor, expires_at=None, now=None) -> Node:
    """Place the caller's own cordon hold (``maintenance.holds``): no new placement; leases untouched.

    The lifecycle does not change. A node may carry holds from several actors at once; a repeated
    cordon by the same actor refreshes its hold. Raises: NotFound (404), PreconditionFailed (412),
    Conflict (409 ``transition_not_allowed`` for a retired node), Unprocessable (422).
    """
    place_hold(
        node_id,
        owner_for(actor),
        reason,
        expires_at,
        actor=actor,
        expected_version=expected_version,
        now=now,
    )
    return Node.objects.get(pk=node_id)


def uncordon_node(
    *,
    node_id,
    expected_version: int,
    reason: str,
    actor: Actor,
    owner: str | None = None,
    force: bool = False,
    now=None,
) -> Node:
    """Remove the caller's own hold; the node stays cordoned while other holds remain.

    ``owner`` names another actor's hold and needs ``force`` (operators only, recorded); ``force``
    without ``owner`` removes every hold. Raises: NotFound (404), PreconditionFailed (412),
    Forbidden (403 ``hold_owned_by_other`` / ``force_requires_operator``), Conflict (409
    ``hold_not_found``).
    """
    if owner is None and not force:
        owner = owner_for(actor)
    remove_hold(node_id, owner, force, actor=actor, reason=reason, expected_version=expected_version, now=now)
    return Node.objects.get(pk=node_id)


def revoke_live_leases(node: Node, *, actor: Actor, reason: str, now) -> list[Lease]:
    """Revoke (fence) every live lease on ``node`` at once; returns the leases this call revoked.

    Calls the leases app's ``revoke_node_leases`` first, then revokes any lease still live one by
    one with ``revoke_lease`` (each frees its capacity in ``NodeResource.allocated`` in the same
    transaction), so the result holds whichever of the two the leases app implements.
    """
    live_before = list(
        Lease.objects.select_for_update(no_key=True)
        .filter(node=node, state__in=LIVE_LEASE_STATES)
        .order_by("granted_at", "pk")
    )
    if not live_before:
        return []
    lease_reconcile.revoke_node_leases(node, actor=actor, reason=reason)
    still_live = {
        lease.pk: lease
        for lease in Lease.objects.select_for_update(no_key=True)
        .filter(node=node, state__in=LIVE_LEASE_STATES)
        .order_by("pk")
    }
    for lease in still_live.values():
        lease_reconcile.revoke_lease(lease, actor=actor, reason=reason, now=now)
    live_after = set(Lease.objects.filter(node=node, state__in=LIVE_LEASE_STATES).values_list("pk", flat=True))
    return [lease for lease in live_before if lease.pk not in live_after]


def abort_active_drain(node: Node, *, actor: Actor, reason: str, now) -> Drain | None:
    """End the node's active drain as ``aborted`` (the node is being quarantined or retired)."""
    drain = Drain.objects.select_for_update().filter(node=node, state=DrainState.ACTIVE).first()
    if drain is None:
        return None
    fsm.move(
        Drain.objects.filter(pk=drain.pk), "abort", finished_at=now, finish_reason=reason, version=F("version") + 1
    )
    record_event(
        node,
        event_types.DRAIN,
        actor,
        from_state=DrainState.ACTIVE,
        to_state=DrainState.ABORTED,
        reason=reason,
        data={"drain_id": str(drain.pk)},
    )
    drain.refresh_from_db()
    return drain


def quarantine_node(
    *,
    node_id,
    reason: str,
    evidence: dict[str, Any] | None,
    actor: Actor,
    expected_version: int | None = None,
    rule: str = QuarantineRule.MANUAL,
    now=None,
) -> Quarantine:
    """Cut a node off at once (an incident response, from any state but retired or quarantined).

    In one transaction: lifecycle → ``quarantined`` with the reason; every credential revoked (its
    later messages get 401); every live lease revoked (fencing tokens stale, workloads free to be
    placed elsewhere at once); ``artifacts_blocked`` set; an active drain aborted; a
    :class:`Quarantine` row with the rule and evidence that its owner can read.

    Args:
        expected_version: required for operators (the view enforces it); None for automatic rules.
        rule: a :class:`QuarantineRule` value (``manual`` for operators).
        evidence: a JSON object describing what was observed.

    Raises: NotFound (404), PreconditionFailed (412), Conflict (409 ``transition_not_allowed``).
    """
    now = now or timezone.now()
    evidence = evidence or {}
    with transaction.atomic():
        node = lock_node(node_id)
        _check_expected(node, expected_version)
        from_state = apply_transition(node, "quarantine", action="quarantine", reason=reason, now=now)
        node.artifacts_blocked = True
        save_transition(node, "artifacts_blocked")
        credentials = fleet_credentials.revoke_all_credentials(node=node, now=now)
        revoked = revoke_live_leases(node, actor=actor, reason=f"node quarantined: {reason}", now=now)
        abort_active_drain(node, actor=actor, reason="node quarantined", now=now)
        quarantine = Quarantine.objects.create(
            node=node,
            rule=rule,
            reason=reason,
            evidence=evidence,
            from_state=from_state,
            actor_type=actor.type,
            actor_user=actor.user if actor.user is not None and actor.user.is_authenticated else None,
            actor_name=actor.name[:150],
            created_at=now,
            credentials_revoked=credentials,
            leases_revoked=len(revoked),
        )
        data = {"action": "quarantine", "rule": rule, "quarantine_id": quarantine.pk}
        record_transition(node, actor, from_state=from_state, reason=reason, data=data)
        record_event(
            node,
            event_types.QUARANTINE,
            actor,
            reason=reason,
            # The event stream is read by the node's owner (and node events by lease clients): it
            # carries the evidence without what operators marked private, which stays on the
            # Quarantine row (docs/marketplace.md, "The owner's view").
            data={
                **data,
                "evidence": public_evidence(evidence),
                "leases_revoked": len(revoked),
                "credentials_revoked": credentials,
            },
        )
        if credentials:
            record_event(node, fleet_events.CREDENTIAL, actor, reason="node quarantined", data={"revoked": credentials})
    return quarantine


def release_node(
    *, node_id, expected_version: int, reason: str, actor: Actor, issue_credential: bool = False, now=None
) -> tuple[Node, str | None]:
    """quarantined | rejected → pending: the node must pass a fresh admission (never straight to ready).

    Closes the open quarantine record and clears ``artifacts_blocked`` (the operator who holds
    ``fleet.release_node`` has judged the incident; the quarantine row keeps its window). The
    node gets a new credential through re-enrollment, or here when ``issue_credential`` is true:
    the secret is returned once and never stored.

    Returns: ``(node, secret or None)``. Raises as :func:`cordon_node`.
    """
    now = now or timezone.now()
    secret = None
    with transaction.atomic():
        node = lock_node(node_id)
        _check_expected(node, expected_version)
        from_state = apply_transition(node, "release", action="release", reason=reason, now=now)
        node.artifacts_blocked = False
        save_transition(node, "artifacts_blocked")
        Quarantine.objects.filter(node=node, released_at__isnull=True).update(
            released_at=now,
            released_by=actor.user if actor.user is not None and actor.user.is_authenticated else None,
            released_by_name=actor.name[:150],
            release_reason=reason,
        )
        record_transition(
            node,
            actor,
            from_state=from_state,
            reason=reason,
            data={"action": "release", "credential_issued": issue_credential},
        )
        if issue_credential:
            credential, secret = fleet_credentials.issue_credential(node=node, issuer=f"operator:{actor.name}", now=now)
            record_event(
                node,
                fleet_events.CREDENTIAL,
                actor,
                reason="issued by an operator at release",
                data={"prefix": credential.prefix, "expires_at": credential.expires_at.isoformat()},
            )
    return node, secret


def return_node_to_service(*, node_id, expected_version: int, reason: str, actor: Actor, now=None) -> Node:
    """maintenance → admitting, and queue admission again (and the benchmark where the pool needs one).

    A node never goes from maintenance to ready by itself: it is admitted like a new one.
    Raises as :func:`cordon_node`.
    """
    now = now or timezone.now()
    with transaction.atomic():
        node = lock_node(node_id)
        _check_expected(node, expected_version)
        from_state = apply_transition(node, "return_to_service", action="return-to-service", reason=reason, now=now)
        save_transition(node)
        # The node leaves maintenance through re-admission: the holds its drains placed end here.
        # Every other actor's hold stays (admission never clears holds).
        for owner in (
            node.holds.filter(removed_at__isnull=True, owner__startswith=DRAIN_PREFIX)
            .values_list("owner", flat=True)
            .distinct()
        ):
            remove_holds_where(node, owner=owner, actor=actor, reason="node returned to service", now=now)
        event = record_transition(
            node, actor, from_state=from_state, reason=reason, data={"action": "return-to-service"}
        )
        # Fleet's one entry point for a node already admitting: a new attempt (the previous
        # attempt's checks are never reused), dispatched on commit. Imported: the name-lookup it
        # replaces fell back to a fleet.services.start_admission that never existed and then left
        # the node admitting with nothing queued.
        queue_admission(node=node)
        event.data["admission_queued"] = True  # always, now; kept for the event's readers
        event.save(update_fields=["data"])
    return Node.objects.get(pk=node.pk)


def retire_node(*, node_id, expected_version: int, reason: str, actor: Actor, force: bool = False, now=None) -> Node:
    """Any state but retired → retired (terminal). Identity and history stay.

    A node that still holds live leases is refused (409 ``node_has_live_leases``) unless
    ``force``, which revokes them (fenced). Credentials are left alone on purpose: the node's
    later heartbeats and lease calls get 410 ``node_retired`` (the contract), not 401.
    Raises as :func:`cordon_node`, plus that 409.
    """
    now = now or timezone.now()
    with transaction.atomic():
        node = lock_node(node_id)
        _check_expected(node, expected_version)
        if not can_proceed(node.retire):
            raise transition_refused(node, "retire")
        live = Lease.objects.filter(node=node, state__in=LIVE_LEASE_STATES).count()
        if live and not force:
            raise Conflict(
                f"The node still holds {live} live lease(s); drain it first, or retire with force to revoke them.",
                NODE_HAS_LIVE_LEASES,
                live_leases=live,
            )
        from_state = apply_transition(node, "retire", action="retire", reason=reason, now=now)
        save_transition(node)
        revoked = revoke_live_leases(node, actor=actor, reason=f"node retired: {reason}", now=now) if live else []
        abort_active_drain(node, actor=actor, reason="node retired", now=now)
        record_transition(
            node, actor, from_state=from_state, reason=reason, data={"action": "retire", "leases_revoked": len(revoked)}
        )
    return node
