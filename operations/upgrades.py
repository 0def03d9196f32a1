"""Rolling upgrades: create, start, pause, resume, roll back, abort; the dry run; the instruction.

Every operator action follows the house pattern: ``atomic()`` → lock the upgrade row → check the
expected version (412) → ``can_proceed`` (409 ``transition_not_allowed``) → transition → save →
``upgrade`` event (subject ``upgrade``/id) in the same transaction. The workflow itself moves in
:mod:`operations.rollout`, driven by Celery (:mod:`operations.tasks`).
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone
from django_fsm import can_proceed

from fleet.choices import Lifecycle
from fleet.events import Actor, record_event
from fleet.instructions import Instruction, post_instructions
from fleet.models import Node, NodeHold, Pool
from maintenance import drains as maintenance_drains
from maintenance import holds
from maintenance.choices import DrainState
from maintenance.models import Drain
from nodepool import fsm
from nodepool.api.errors import TRANSITION_NOT_ALLOWED
from nodepool.api.problems import Conflict, NotFound, Problem
from nodepool.api.versioning import check_version
from nodepool.celery import app as celery_app

from . import event_types
from .choices import (
    MOVING_UPGRADE_STATES,
    CanaryOverride,
    PauseCause,
    UpgradeNodeState,
    UpgradePhase,
    UpgradeState,
)
from .errors import (
    CANARY_OVERRIDE_REQUIRED,
    INVALID_OVERRIDE,
    NO_OTHER_CANARY_NODES,
    POOL_EMPTY,
    UPGRADE_IN_PROGRESS,
    UPGRADE_NOT_FOUND,
)
from .models import Upgrade, UpgradeNode
from .outofservice import UPGRADE
from .upgrade_plan import parse_upgrade, plan, pool_operations


def event(upgrade: Upgrade, actor: Actor, reason: str, *, node=None, from_state="", to_state="", **data) -> None:
    """Append one ``upgrade`` event for ``upgrade`` (and ``node`` when it is about one node)."""
    record_event(
        node,
        event_types.UPGRADE,
        actor,
        pool=upgrade.pool_id,
        subject_type="upgrade",
        subject_id=upgrade.pk,
        from_state=from_state,
        to_state=to_state,
        reason=reason,
        data={"upgrade_id": str(upgrade.pk), **data},
    )


def upgrade_create(*, data: Any, actor: Actor) -> Upgrade:
    """A pending upgrade (nothing moves until :func:`upgrade_start`).

    Raises: 400 (``invalid_upgrade``, ``invalid_target``, ``invalid_max_unavailable``,
    ``unknown_pool``), 409 ``upgrade_in_progress`` (the pool has an active upgrade).
    """
    values = parse_upgrade(data)
    user = actor.user if actor.user is not None and getattr(actor.user, "is_authenticated", False) else None
    try:
        with transaction.atomic():
            upgrade = Upgrade.objects.create(created_by=user, created_by_name=actor.name[:150], **values)
            event(
                upgrade,
                actor,
                values["reason"] or "upgrade created",
                to_state=UpgradeState.PENDING,
                target=values["target"],
            )
    except IntegrityError:
        raise Conflict("The pool already has an active upgrade.", UPGRADE_IN_PROGRESS) from None
    return upgrade


# --- operator actions ----------------------------------------------------------------------------
def lock_upgrade(upgrade_id) -> Upgrade:
    """The upgrade row ``FOR UPDATE``, its pool joined but not locked (``of=("self",)``).

    A tick holds this lock while it takes nodes out of service. Locking the joined pool row
    ``FOR UPDATE`` too (select_related's default) made every event written for a node of the pool
    (its foreign key takes ``FOR KEY SHARE`` on the pool row, checked at COMMIT) wait for the
    whole tick: a liveness sweep holding a node the tick wanted then waited for the tick, which
    waited for it (a deadlock; tests/operations/test_lock_order_cross_app.py).
    """
    try:
        return Upgrade.objects.select_for_update(of=("self",)).select_related("pool").get(pk=upgrade_id)
    except (Upgrade.DoesNotExist, ValueError, Exception) as exc:
        if isinstance(exc, Upgrade.DoesNotExist | ValueError) or "valid UUID" in str(exc):
            raise NotFound(f"No upgrade {upgrade_id}.", UPGRADE_NOT_FOUND) from exc
        raise


def _refused(upgrade: Upgrade, action: str) -> Conflict:
    return Conflict(
        f"Cannot {action} an upgrade that is {upgrade.state}.",
        TRANSITION_NOT_ALLOWED,
        state=upgrade.state,
        action=action,
    )


def _transition(upgrade: Upgrade, method: str, action: str, actor: Actor, reason: str, **data) -> str:
    bound = getattr(upgrade, method)
    if not can_proceed(bound):
        raise _refused(upgrade, action)
    before = upgrade.state
    bound()
    upgrade.version += 1
    upgrade.status_reason = reason or action
    event(upgrade, actor, reason or action, from_state=before, to_state=upgrade.state, action=action, **data)
    return before


def _set_targets(upgrade: Upgrade, target: dict) -> None:
    for pool_id in filter(None, (upgrade.pool_id, upgrade.canary_pool_id)):
        ops = pool_operations(Pool(pk=pool_id), lock=True)
        ops.target = target
        ops.version += 1
        ops.save(update_fields=["target", "version", "updated_at"])


def _act(upgrade_id, expected_version: int | None, actor: Actor, change) -> Upgrade:
    with transaction.atomic():
        upgrade = lock_upgrade(upgrade_id)
        if expected_version is not None:
            check_version(upgrade.version, expected_version)
        change(upgrade)
        upgrade.save()
    if upgrade.state in MOVING_UPGRADE_STATES:
        start_ticking(upgrade)
    return upgrade


def start_ticking(upgrade: Upgrade) -> None:
    """Start a new tick chain for ``upgrade`` after the current transaction commits.

    The task ``operations.advance_upgrade`` is sent by name: operations.tasks runs this app's
    domain modules, so they do not import it (no import cycle); operations.apps imports the tasks."""
    Upgrade.objects.filter(pk=upgrade.pk).update(tick_generation=F("tick_generation") + 1)
    generation = Upgrade.objects.filter(pk=upgrade.pk).values_list("tick_generation", flat=True).get()
    advance = celery_app.signature("operations.advance_upgrade", args=[str(upgrade.pk), generation])
    transaction.on_commit(lambda: advance.apply_async(), robust=True)


def upgrade_start(*, upgrade_id, expected_version: int | None, actor: Actor, reason: str = "") -> Upgrade:
    """pending → canary (or rolling without canary): plan the node order, set the pool's target.

    Raises: 404 ``upgrade_not_found``, 412, 409 ``transition_not_allowed``, 409 ``pool_empty``.
    """

    def change(upgrade: Upgrade) -> None:
        canary, roll = plan(upgrade)
        if not canary and not roll:
            raise Conflict("The pool has no nodes to upgrade.", POOL_EMPTY)
        upgrade.previous_target = pool_operations(upgrade.pool).target or {}
        rows = [
            UpgradeNode(upgrade=upgrade, node=n, phase=UpgradePhase.CANARY, position=i, from_version=n.agent_version)
            for i, n in enumerate(canary)
        ]
        rows += [
            UpgradeNode(upgrade=upgrade, node=n, phase=UpgradePhase.ROLL, position=i, from_version=n.agent_version)
            for i, n in enumerate(roll)
        ]
        UpgradeNode.objects.bulk_create(rows)
        _set_targets(upgrade, upgrade.target)
        upgrade.started_at = timezone.now()
        method = "start_canary" if canary else "roll"
        _transition(
            upgrade,
            method,
            "start",
            actor,
            reason or "upgrade started",
            canary=[str(n.pk) for n in canary],
            nodes=len(rows),
        )

    return _act(upgrade_id, expected_version, actor, change)


def upgrade_pause(*, upgrade_id, expected_version: int | None, actor: Actor, reason: str = "") -> Upgrade:
    """canary | rolling → paused: no further node starts; nodes in flight finish. Raises as start."""

    def change(upgrade: Upgrade) -> None:
        upgrade.paused_from = upgrade.state
        upgrade.pause_cause = PauseCause.OPERATOR
        _transition(upgrade, "pause", "pause", actor, reason or "paused by an operator")

    return _act(upgrade_id, expected_version, actor, change)


def upgrade_resume(
    *, upgrade_id, expected_version: int | None, actor: Actor, reason: str = "", override: str | None = None
) -> Upgrade:
    """paused → canary | rolling (where it paused). The failure count starts again.

    An upgrade its canary paused (``pause_cause`` ``canary_failed``) resumes only with an explicit
    ``override`` (:class:`~operations.choices.CanaryOverride`) and a ``reason``, and the override
    says what it does instead of re-pausing on the next tick:

    - ``retry_canary``: the failed canary nodes wait again (same nodes), the soak starts over;
    - ``retry_canary_on_other_nodes``: the failed canary nodes are left as they are (failed) and as
      many of the roll's next waiting nodes become the canary;
    - ``skip_canary``: the roll starts now; the failed canary nodes stay failed.

    Raises: as start; 409 ``canary_override_required`` (a canary-paused upgrade without an
    override), 409 ``no_other_canary_nodes``; 400 ``invalid_override`` (an unknown override, one
    on an upgrade its canary did not pause, or an override without a reason).
    """
    if override is not None and override not in CanaryOverride.values:
        raise Problem(f"override must be one of {', '.join(CanaryOverride.values)}.", INVALID_OVERRIDE)

    def change(upgrade: Upgrade) -> None:
        data = {"failures_before": upgrade.failures}
        text = reason or "resumed by an operator"
        canary_paused = upgrade.state == UpgradeState.PAUSED and upgrade.pause_cause == PauseCause.CANARY_FAILED
        if canary_paused:
            if override is None:
                raise Conflict(
                    "The canary failed: resuming needs an explicit override with a reason "
                    f"({', '.join(CanaryOverride.values)}).",
                    CANARY_OVERRIDE_REQUIRED,
                    overrides=list(CanaryOverride.values),
                    status_reason=upgrade.status_reason,
                )
            if not reason.strip():
                raise Problem("An override needs a reason.", INVALID_OVERRIDE, field="reason")
            text = f"{CanaryOverride(override).label} ({override}): {reason}"
            data.update(override=override, **_apply_canary_override(upgrade, override))
        elif override is not None:
            raise Problem("override applies only to an upgrade paused by its canary.", INVALID_OVERRIDE)
        _transition(upgrade, "resume", "resume", actor, text, **data)
        upgrade.failures = 0
        upgrade.pause_cause = ""

    return _act(upgrade_id, expected_version, actor, change)


def _apply_canary_override(upgrade: Upgrade, override: str) -> dict:
    """Prepare ``upgrade`` (locked, paused by its canary) for ``override``; returns what it did."""
    failed = UpgradeNode.objects.filter(upgrade=upgrade, phase=UpgradePhase.CANARY, state=UpgradeNodeState.FAILED)
    failed_ids = [str(n) for n in failed.values_list("node_id", flat=True)]
    upgrade.soak_until = None
    if override == CanaryOverride.SKIP:
        upgrade.paused_from = UpgradeState.ROLLING
        fsm.move(
            UpgradeNode.objects.filter(upgrade=upgrade, phase=UpgradePhase.CANARY),
            "skip",
            detail="canary skipped by an override",
        )
        return {"canary_skipped": True, "failed_canary_nodes": failed_ids}
    upgrade.paused_from = UpgradeState.CANARY
    if override == CanaryOverride.RETRY:
        fsm.move(failed, "retry", started_at=None, finished_at=None, detail="canary retried")
        return {"retried_nodes": failed_ids}
    # Other nodes: as many of the roll's next waiting nodes become the canary.
    wanted = len(failed_ids) or upgrade.canary_nodes or 1
    nexts = list(
        UpgradeNode.objects.filter(upgrade=upgrade, phase=UpgradePhase.ROLL, state=UpgradeNodeState.WAITING).order_by(
            "position"
        )[:wanted]
    )
    if not nexts:
        raise Conflict("No waiting node is left to be the canary.", NO_OTHER_CANARY_NODES)
    failed.update(detail="canary moved to other nodes by an override")
    start = (
        UpgradeNode.objects.filter(upgrade=upgrade, phase=UpgradePhase.CANARY).order_by("-position").first().position
        + 1
    )
    UpgradeNode.objects.bulk_create(
        [
            UpgradeNode(
                upgrade=upgrade,
                node_id=row.node_id,
                phase=UpgradePhase.CANARY,
                position=start + i,
                from_version=row.from_version,
            )
            for i, row in enumerate(nexts)
        ]
    )
    fsm.move(
        UpgradeNode.objects.filter(pk__in=[row.pk for row in nexts]),
        "skip",
        detail="moved to the canary by an override",
    )
    # The failed canary nodes no longer count as a canary failure: they stay failed, out of the canary.
    failed.update(phase=UpgradePhase.ROLL, position=10**6)
    return {"new_canary_nodes": [str(row.node_id) for row in nexts], "failed_canary_nodes": failed_ids}


def upgrade_rollback(*, upgrade_id, expected_version: int | None, actor: Actor, reason: str = "") -> Upgrade:
    """canary | rolling | paused → rolling_back: the pool's previous target again, and every node
    the upgrade touched goes back to it the same way. Raises as start."""

    def change(upgrade: Upgrade) -> None:
        begin_rollback(upgrade, actor, reason or "rollback requested by an operator")

    return _act(upgrade_id, expected_version, actor, change)


def upgrade_abort(*, upgrade_id, expected_version: int | None, actor: Actor, reason: str = "") -> Upgrade:
    """Any active state → aborted: nothing new starts (nodes waiting are skipped); the pool keeps
    the target it has. Every hold the upgrade and its drains added is removed
    (:func:`release_holds`): a node still draining is back to ready, a drained node stays in
    maintenance, uncordoned by the upgrade, for an operator to return to service. Raises as start."""

    def change(upgrade: Upgrade) -> None:
        _transition(upgrade, "abort", "abort", actor, reason or "aborted by an operator")
        upgrade.finished_at = timezone.now()
        fsm.move(UpgradeNode.objects.filter(upgrade=upgrade), "skip", detail="the upgrade was aborted")
        release_holds(upgrade, reason=f"upgrade {upgrade.state}")

    return _act(upgrade_id, expected_version, actor, change)


def release_holds(upgrade: Upgrade, *, reason: str) -> int:
    """Remove every hold ``upgrade`` and its drains added on its nodes, once it ended (aborted,
    failed, rolled back, completed): its drains still active are cancelled (the node back to
    ready), the ``system:upgrade`` hold and each of its drains' ``drain:<id>`` holds removed.
    Nodes in flight are marked skipped. Other actors' holds stay. Returns the nodes released.

    Runs under the upgrade's row lock (the tick's order: upgrade row, then node rows).
    """
    actor = Actor.system(UPGRADE)
    now = timezone.now()
    fsm.move(
        UpgradeNode.objects.filter(upgrade=upgrade), "abandon", finished_at=now, detail=f"in flight when the {reason}"
    )
    drains_by_node: dict = {}
    for node_id, drain_id in UpgradeNode.objects.filter(upgrade=upgrade).values_list("node_id", "drain_id"):
        drains_by_node.setdefault(node_id, set())
        if drain_id:
            drains_by_node[node_id].add(drain_id)
    released = 0
    for node_id, drain_ids in drains_by_node.items():
        owners = {UPGRADE, *(holds.drain_owner(d) for d in drain_ids)}
        if not NodeHold.objects.filter(node_id=node_id, owner__in=owners, removed_at__isnull=True).exists():
            continue
        with transaction.atomic():
            for drain in Drain.objects.filter(pk__in=drain_ids, state=DrainState.ACTIVE):
                maintenance_drains.cancel_drain(
                    drain_id=drain.pk, expected_version=drain.version, reason=reason, actor=actor, now=now
                )
            node = Node.objects.select_for_update(no_key=True).get(pk=node_id)
            for owner in sorted(owners):
                holds.remove_holds_where(node, owner=owner, actor=actor, reason=reason, now=now, bump_version=True)
        released += 1
    return released


def begin_rollback(upgrade: Upgrade, actor: Actor, reason: str) -> None:
    """Move ``upgrade`` (locked) to rolling_back: previous target back on the pool(s), forward rows
    not yet started skipped, a rollback row for every node the upgrade touched."""
    _transition(upgrade, "rollback", "rollback", actor, reason)
    _set_targets(upgrade, upgrade.previous_target)
    forward = UpgradeNode.objects.filter(upgrade=upgrade).exclude(phase=UpgradePhase.ROLLBACK)
    fsm.move(forward, "skip", detail="rollback started")
    touched = list(forward.exclude(state=UpgradeNodeState.SKIPPED).order_by("phase", "position"))
    UpgradeNode.objects.bulk_create(
        [
            UpgradeNode(
                upgrade=upgrade,
                node_id=row.node_id,
                phase=UpgradePhase.ROLLBACK,
                position=i,
                from_version=row.from_version,
            )
            for i, row in enumerate(touched)
        ],
        ignore_conflicts=True,
    )
    now = timezone.now()
    for row in touched:
        if row.state not in (UpgradeNodeState.DONE, UpgradeNodeState.FAILED):
            fsm.move(
                UpgradeNode.objects.filter(pk=row.pk),
                "abandon",
                finished_at=now,
                detail="rollback started while in flight",
            )


# --- the instruction (heartbeat) ---------------------------------------------------------------
def tell_node(node_id) -> None:
    """Raise the node's ``UPGRADE`` pending-instruction bit (after commit): its next renewal asks
    for a status report, whose answer carries :func:`upgrade_instruction`."""
    post_instructions([node_id], Instruction.UPGRADE)


def row_target(row: UpgradeNode) -> dict:
    """What ``row``'s node must reach: the upgrade's target, or for a rollback the previous target
    (or, when the pool had none, the version the node ran before, with the same upgrade action)."""
    upgrade = row.upgrade
    if row.phase != UpgradePhase.ROLLBACK:
        return upgrade.target
    if upgrade.previous_target:
        return upgrade.previous_target
    version = row.from_version
    return (
        {
            "version": version,
            "agent_versions": f"=={version}",
            "artifact": {},
            "action": upgrade.target.get("action", "agent"),
        }
        if version
        else {}
    )


# Only a node the workflow parked can be waiting for an upgrade: the ready node's status report
# (the common one) pays no query for it.
INSTRUCTED_LIFECYCLES = (Lifecycle.MAINTENANCE, Lifecycle.REJECTED, Lifecycle.PENDING)


def upgrade_instruction_for_report(sender, node, **kwargs) -> dict:
    """A status-report handler (fleet.instructions, order 300): the instruction for the report's answer."""
    return upgrade_instruction(node) if node.lifecycle in INSTRUCTED_LIFECYCLES else {}


def upgrade_instruction(node: Node) -> dict:
    """The ``upgrade`` instruction for a drained node whose upgrade (or rollback) waits for it.

    Shape: ``{"upgrade": {"upgrade_id", "version", "artifact": {"ref", "sha256"}, "action"}}``
    (one query). The workflow raises the node's ``UPGRADE`` instruction bit when it starts waiting
    (:func:`tell_node`), so a renewal asks the agent for the status report whose answer carries it.
    """
    row = (
        UpgradeNode.objects.filter(
            node_id=node.pk, state=UpgradeNodeState.UPGRADING, upgrade__state__in=MOVING_UPGRADE_STATES
        )
        .select_related("upgrade")
        .order_by("-upgrade__created_at", "-phase")
        .first()
    )
    if row is None:
        return {}
    target = row_target(row)
    if not target:
        return {}
    return {
        "upgrade": {
            "upgrade_id": str(row.upgrade_id),
            "version": target.get("version", ""),
            "artifact": target.get("artifact") or {},
            "action": target.get("action", "agent"),
        }
    }
