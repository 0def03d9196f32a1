"""Appeals: an owner contests a quarantine of their node; operators resolve them from a queue.

An appeal is open until an operator upholds it (the quarantine stands) or overturns it (the
quarantine was wrong: the node is released in the same transaction, and must pass admission again,
as any release). The owner may withdraw an open appeal. Every step is an ``appeal`` event on the
node, so the owner sees the outcome in their node's events as well as on the appeal.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from fleet.choices import Lifecycle
from fleet.errors import NODE_NOT_FOUND
from fleet.events import Actor, record_event
from fleet.models import Node
from maintenance import services as maintenance_services
from maintenance.models import Quarantine
from nodepool import fsm
from nodepool.api.problems import Conflict, NotFound, Problem
from nodepool.api.versioning import check_version

from . import event_types
from .choices import APPEAL_OUTCOMES, AppealState
from .errors import (
    APPEAL_ALREADY_OPEN,
    APPEAL_NOT_FOUND,
    APPEAL_NOT_OPEN,
    INVALID_OUTCOME,
    NODE_NOT_QUARANTINED,
)
from .models import Appeal
from .money_common import required_text

# The declared transition (Appeal) of each operator outcome.
RESOLVE = {AppealState.UPHELD: "uphold", AppealState.OVERTURNED: "overturn"}


def appeal_create(*, owner, node_id, statement, actor: Actor) -> Appeal:
    """Open an appeal against the open quarantine of ``node_id`` (the owner's own node).

    Raises: NotFound 404 ``node_not_found`` (not their node: no leak), Conflict 409
    ``node_not_quarantined`` or ``appeal_already_open``; Problem 400 ``invalid_field``.
    """
    text = required_text(statement, "statement")
    with transaction.atomic():
        quarantine = (
            Quarantine.objects.select_related("node")
            .filter(node_id=node_id, node__owner=owner, released_at__isnull=True)
            .first()
        )
        if quarantine is None:
            if not Node.objects.filter(pk=node_id, owner=owner).exists():
                raise NotFound("No such node.", NODE_NOT_FOUND)
            raise Conflict("The node is not quarantined; there is nothing to appeal.", NODE_NOT_QUARANTINED)
        try:
            with transaction.atomic():
                appeal = Appeal.objects.create(quarantine=quarantine, node=quarantine.node, owner=owner, statement=text)
        except IntegrityError as exc:
            raise Conflict("An appeal of this quarantine is open already.", APPEAL_ALREADY_OPEN) from exc
        _event(appeal, actor, from_state="", reason=text)
    return appeal


def appeal_resolve(*, appeal_id, outcome: str, resolution, expected_version: int, actor: Actor, now=None) -> Appeal:
    """An operator answers an open appeal: ``upheld`` or ``overturned`` (which releases the node).

    Raises: NotFound 404; PreconditionFailed 412; Conflict 409 ``appeal_not_open``; Problem 400
    ``invalid_outcome`` / ``invalid_field``; and as maintenance.services.release_node for an overturn.
    """
    if outcome not in APPEAL_OUTCOMES:
        raise Problem(f"outcome must be one of {', '.join(APPEAL_OUTCOMES)}.", INVALID_OUTCOME)
    text = required_text(resolution, "resolution")
    now = now or timezone.now()
    with transaction.atomic():
        # The appeal row alone (of=self): joined, the quarantine and node rows were locked FOR
        # UPDATE in the same statement, the quarantine before the node, while release_node locks
        # the node and then closes the quarantine (a deadlock), and every event of the node waited.
        appeal = (
            Appeal.objects.select_for_update(of=("self",))
            .select_related("quarantine", "node")
            .filter(pk=appeal_id)
            .first()
        )
        if appeal is None:
            raise NotFound("No such appeal.", APPEAL_NOT_FOUND)
        check_version(appeal.version, expected_version)
        if appeal.state != AppealState.OPEN:
            raise Conflict(f"The appeal is {appeal.state} already.", APPEAL_NOT_OPEN)
        # WHERE state IN (…) and the new state from the declared transition (Appeal.uphold, overturn).
        fsm.move(
            Appeal.objects.filter(pk=appeal.pk, version=appeal.version),
            RESOLVE[outcome],
            resolution=text,
            resolved_by=actor.name[:150],
            resolved_at=now,
            version=F("version") + 1,
        )
        if outcome == AppealState.OVERTURNED and appeal.quarantine.released_at is None:
            # The node's row, then its quarantine read again: every release of a quarantine holds
            # its node's row, so neither changes before this transaction ends.
            node = maintenance_services.lock_node(appeal.node_id)
            quarantine_open = Quarantine.objects.filter(pk=appeal.quarantine_id, released_at__isnull=True).exists()
            if quarantine_open and node.lifecycle == Lifecycle.QUARANTINED:
                maintenance_services.release_node(
                    node_id=node.pk,
                    expected_version=node.version,
                    actor=actor,
                    reason=f"appeal {appeal.pk} overturned: {text}",
                    now=now,
                )
        appeal.refresh_from_db()
        _event(appeal, actor, from_state=AppealState.OPEN, reason=text)
    return appeal


def appeal_withdraw(*, appeal_id, owner, actor: Actor, now=None) -> Appeal:
    """The owner withdraws their open appeal. Raises NotFound 404, Conflict 409 ``appeal_not_open``."""
    now = now or timezone.now()
    with transaction.atomic():
        appeal = Appeal.objects.select_for_update().filter(pk=appeal_id, owner=owner).first()
        if appeal is None:
            raise NotFound("No such appeal.", APPEAL_NOT_FOUND)
        if not fsm.move(  # the claim: WHERE state IN the sources of Appeal.withdraw
            Appeal.objects.filter(pk=appeal.pk),
            "withdraw",
            resolved_at=now,
            resolved_by=actor.name[:150],
            version=F("version") + 1,
        ):
            raise Conflict(f"The appeal is {appeal.state} already.", APPEAL_NOT_OPEN)
        appeal.refresh_from_db()
        _event(appeal, actor, from_state=AppealState.OPEN, reason="withdrawn by the owner")
    return appeal


def _event(appeal: Appeal, actor: Actor, *, from_state: str, reason: str) -> None:
    record_event(
        appeal.node_id,
        event_types.APPEAL,
        actor,
        from_state=from_state,
        to_state=appeal.state,
        reason=reason[:2000],
        subject_type="appeal",
        subject_id=appeal.pk,
        data={"appeal_id": appeal.pk, "quarantine_id": appeal.quarantine_id},
    )
