"""Cordon holds: each actor's own cordon of a node, so one actor's uncordon never lifts another's.

A node has zero or more active holds (``fleet.models.NodeHold``: owner, reason, created_at,
optional expires_at). It is *cordoned* — no new placement, existing leases untouched — while any
hold exists. Holds are a dimension of their own beside the lifecycle, like taints: they feed
``schedulable`` (reason code ``cordoned``) and never move the lifecycle.

Owners (:func:`owner_for`): ``user:<username>`` for people, ``drain:<drain id>`` for a drain's
own hold, ``system:<name>`` for automation (``system:upgrade``, ``system:scale-down``…).

The small service API other apps call (all inside ``transaction.atomic()``, node row locked,
``Node.cordoned`` and ``Node.version`` kept in step, one ``hold`` event per change):

* :func:`place_hold` ``(node, owner, reason, expires_at=None)``;
* :func:`remove_hold` ``(node, owner, force=False)``;
* :func:`remove_holds_where` for a drain's own hold;
* :func:`expire_holds` (the sweep that ends holds past their ``expires_at``).

Interactions (docs/maintenance.md): a drain places ``drain:<id>`` and removes it when cancelled or
when the node returns to service; quarantine and retire leave holds alone; admission never
clears them.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from fleet.choices import ActorType, Lifecycle
from fleet.errors import NODE_NOT_FOUND
from fleet.events import Actor, record_event
from fleet.models import Node, NodeHold
from nodepool.api.errors import TRANSITION_NOT_ALLOWED
from nodepool.api.permissions import is_operator
from nodepool.api.problems import Conflict, Forbidden, NotFound, Unprocessable
from nodepool.api.versioning import check_version

from . import event_types
from .errors import FORCE_REQUIRES_OPERATOR, HOLD_NOT_FOUND, HOLD_OWNED_BY_OTHER, INVALID_HOLD

logger = logging.getLogger(__name__)

USER_PREFIX, DRAIN_PREFIX, SYSTEM_PREFIX = "user:", "drain:", "system:"
OWNER_MAX = 200


def owner_for(actor: Actor) -> str:
    """The hold owner an actor acts as: ``user:<username>`` or ``system:<name>`` (names as given)."""
    if actor.type == ActorType.USER:
        return f"{USER_PREFIX}{actor.name}"
    name = actor.name
    return name if name.startswith(SYSTEM_PREFIX) else f"{SYSTEM_PREFIX}{name}"


def drain_owner(drain_id) -> str:
    return f"{DRAIN_PREFIX}{drain_id}"


def active_holds(node) -> list[NodeHold]:
    """The node's active holds, oldest first (uses a prefetched ``active_holds`` list when present)."""
    prefetched = getattr(node, "prefetched_active_holds", None)
    if prefetched is not None:
        return prefetched
    node_id = node.pk if isinstance(node, Node) else node
    return list(NodeHold.objects.filter(node_id=node_id, removed_at__isnull=True).order_by("created_at", "pk"))


def _lock(node) -> Node:
    node_id = node.pk if isinstance(node, Node) else node
    try:
        return Node.objects.select_for_update(no_key=True).get(pk=node_id)
    except (Node.DoesNotExist, ValueError) as exc:
        raise NotFound(f"No node {node_id}.", NODE_NOT_FOUND) from exc


def _sync(node: Node, *, bump: bool = True) -> None:
    """Set ``Node.cordoned`` from the active holds and bump the version (node row locked).

    ``bump`` is False when the hold changes as part of another action that already bumped it
    (a drain starting or ending), so one operator action moves the version by one.
    """
    node.cordoned = NodeHold.objects.filter(node=node, removed_at__isnull=True).exists()
    if bump:
        node.version += 1
    node.save(update_fields=["cordoned", "version", "updated_at"])


def _user(actor: Actor):
    user = actor.user
    return user if user is not None and getattr(user, "is_authenticated", False) else None


def _event(node: Node, hold: NodeHold, actor: Actor, *, to_state: str, reason: str, data: dict | None = None):
    record_event(
        node,
        event_types.HOLD,
        actor,
        from_state="held" if to_state == "removed" else "",
        to_state=to_state,
        reason=reason,
        subject_type="hold",
        subject_id=hold.pk,
        data={
            "hold_id": hold.pk,
            "owner": hold.owner,
            "expires_at": hold.expires_at.isoformat() if hold.expires_at else None,
            "cordoned": node.cordoned,
            **(data or {}),
        },
    )


def place_hold(
    node,
    owner: str,
    reason: str,
    expires_at: datetime | None = None,
    *,
    actor: Actor | None = None,
    expected_version: int | None = None,
    bump_version: bool = True,
    now: datetime | None = None,
) -> NodeHold:
    """Cordon ``node`` on behalf of ``owner``; returns the active hold.

    Args:
        node: a Node or its id.
        owner: ``user:<name>``, ``drain:<id>`` or ``system:<name>`` (≤ 200 characters).
        reason: why (stored on the hold and in its event).
        expires_at: aware datetime after which the hold ends by itself (None: until removed).
        actor: who acts (default: the system actor named by ``owner``).
        expected_version: the node's version the caller read (operators); None skips the check.
        bump_version: False inside another action on the same node that bumps the version itself.

    A second hold by the same owner refreshes the reason and expiry of the first (an automation
    that re-cordons is not refused). Any lifecycle but ``retired`` may be held.

    Raises: NotFound (404), PreconditionFailed (412), Conflict (409 ``transition_not_allowed``
    for a retired node), Unprocessable (422 ``invalid_hold``).
    """

    now = now or timezone.now()
    actor = actor or Actor.system(owner)
    if not owner or len(owner) > OWNER_MAX:
        raise Unprocessable(f"A hold owner is 1-{OWNER_MAX} characters.", INVALID_HOLD)
    if expires_at is not None and expires_at <= now:
        raise Unprocessable("A hold's expires_at must be in the future.", INVALID_HOLD)
    with transaction.atomic():
        locked = _lock(node)
        if expected_version is not None:
            check_version(locked.version, expected_version)
        if locked.lifecycle == Lifecycle.RETIRED:
            raise Conflict(
                "A retired node cannot be cordoned.",
                TRANSITION_NOT_ALLOWED,
                lifecycle=locked.lifecycle,
                action="cordon",
                allowed_actions=[],
            )
        hold = NodeHold.objects.select_for_update().filter(node=locked, owner=owner, removed_at__isnull=True).first()
        if hold is not None:
            hold.reason, hold.expires_at = reason, expires_at
            hold.save(update_fields=["reason", "expires_at"])
            _sync(locked, bump=bump_version)
            _event(locked, hold, actor, to_state="held", reason=reason, data={"refreshed": True})
        else:
            hold = NodeHold.objects.create(
                node=locked,
                owner=owner,
                reason=reason,
                created_at=now,
                expires_at=expires_at,
                created_by=_user(actor),
                created_by_name=actor.name[:150],
            )
            _sync(locked, bump=bump_version)
            _event(locked, hold, actor, to_state="held", reason=reason)
    _refresh(node, locked)
    return hold


def remove_hold(
    node,
    owner: str | None,
    force: bool = False,
    *,
    actor: Actor | None = None,
    reason: str = "",
    expected_version: int | None = None,
    now: datetime | None = None,
) -> list[NodeHold]:
    """Remove ``owner``'s hold on ``node`` (uncordon); returns the holds removed.

    Args:
        owner: whose hold; None with ``force`` removes every hold of the node.
        force: needed to remove a hold the acting user does not own; operators only. Every forced
            removal is recorded (``NodeHold.forced`` and ``data.forced`` on its event).
        actor: who acts. A user may remove only ``user:<own name>`` without ``force``; system code
            (actor type ``system``) is trusted to name its own owner.

    The node stays cordoned while any other hold remains.

    Raises: NotFound (404 ``node_not_found``), PreconditionFailed (412), Forbidden (403
    ``hold_owned_by_other`` / ``force_requires_operator``), Conflict (409 ``hold_not_found``).
    """

    now = now or timezone.now()
    actor = actor or Actor.system(owner or "maintenance")
    if actor.type == ActorType.USER:
        mine = owner_for(actor)
        if owner is None and not force:
            owner = mine
        if (owner != mine or owner is None) and not force:
            raise Forbidden(
                f"The hold of {owner} is not yours ({mine}); an operator may remove it with force.",
                HOLD_OWNED_BY_OTHER,
            )
        if force and not is_operator(actor.user):
            raise Forbidden("Only operators may remove another actor's hold (force).", FORCE_REQUIRES_OPERATOR)
    elif owner is None and not force:
        raise Unprocessable("Name the hold owner to remove.", INVALID_HOLD)
    with transaction.atomic():
        locked = _lock(node)
        if expected_version is not None:
            check_version(locked.version, expected_version)
        holds = NodeHold.objects.select_for_update().filter(node=locked, removed_at__isnull=True)
        if owner is not None:
            holds = holds.filter(owner=owner)
        holds = list(holds.order_by("created_at", "pk"))
        if not holds:
            present = list(
                NodeHold.objects.filter(node=locked, removed_at__isnull=True).values_list("owner", flat=True)
            )
            raise Conflict(
                f"{owner or 'Nobody'} holds no cordon on this node"
                + (f"; held by {', '.join(present)}." if present else "; it is not cordoned."),
                HOLD_NOT_FOUND,
                owner=owner,
                holds=present,
            )
        removed = _remove(locked, holds, actor=actor, reason=reason, now=now, force=force)
    _refresh(node, locked)
    return removed


def _remove(
    node: Node, holds: list[NodeHold], *, actor: Actor, reason: str, now, force: bool, bump: bool = True
) -> list[NodeHold]:
    mine = owner_for(actor)
    for hold in holds:
        hold.removed_at = now
        hold.removed_by_name = actor.name[:150]
        hold.removal_reason = reason
        hold.forced = bool(force and hold.owner != mine)
        hold.save(update_fields=["removed_at", "removed_by_name", "removal_reason", "forced"])
    _sync(node, bump=bump)
    for hold in holds:
        _event(node, hold, actor, to_state="removed", reason=reason, data={"forced": hold.forced})
    return holds


def remove_holds_where(
    node: Node, *, owner: str, actor: Actor, reason: str, now=None, bump_version: bool = False
) -> list[NodeHold]:
    """Remove ``owner``'s active hold if there is one; no error when none.

    For other maintenance services inside their own transaction, with ``node`` already locked and
    its version already bumped by their action (hence ``bump_version`` False by default).
    """
    now = now or timezone.now()
    holds = list(NodeHold.objects.select_for_update().filter(node=node, owner=owner, removed_at__isnull=True))
    if not holds:
        return []
    return _remove(node, holds, actor=actor, reason=reason, now=now, force=False, bump=bump_version)


def expire_holds(*, now=None, actor: Actor | None = None, limit: int = 500) -> int:
    """End every active hold whose ``expires_at`` has passed; returns how many. Safe to run twice at once.

    Each node is handled in its own transaction under its row lock; a hold already removed by a
    concurrent run is skipped (the filter re-reads it under the lock). A node that fails is logged
    and left for the next run; the others' holds still end.
    """
    now = now or timezone.now()
    actor = actor or Actor.system("maintenance.expire_holds")
    node_ids = list(
        NodeHold.objects.filter(removed_at__isnull=True, expires_at__isnull=False, expires_at__lte=now)
        .order_by("expires_at")
        .values_list("node_id", flat=True)
        .distinct()[:limit]
    )
    count = 0
    for node_id in node_ids:
        try:
            with transaction.atomic():
                locked = _lock(node_id)
                due = list(
                    NodeHold.objects.select_for_update().filter(
                        Q(expires_at__lte=now), node=locked, removed_at__isnull=True, expires_at__isnull=False
                    )
                )
                if due:
                    count += len(_remove(locked, due, actor=actor, reason="hold expired", now=now, force=False))
        except Exception:  # one node's failure must not keep every other node's holds in place
            logger.exception("the expired holds of node %s could not be removed; the next sweep tries again", node_id)
    return count


def _refresh(node, locked: Node) -> None:
    """Bring a caller's Node instance up to date with what the service saved (cordoned, version)."""
    if isinstance(node, Node) and node is not locked:
        node.cordoned, node.version = locked.cordoned, locked.version
