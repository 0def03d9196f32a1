"""The upgrade workflow's tick: move every node of an upgrade one step, then decide the phase.

:func:`advance` is the whole workflow. It is durable and resumable because everything it needs
is in the database (the upgrade's state, each :class:`UpgradeNode`'s state, the nodes' own
lifecycle and incarnation): a Celery tick chain calls it every ``UPGRADE_TICK`` seconds, a beat
sweep restarts a chain that died, and a run that crashes midway is simply run again. The upgrade
row is locked for the tick, so two ticks never interleave.

One node's way (``UpgradeNodeState``): **waiting** → (cordoned by ``system:upgrade``, drained
with the pool's drain policy and deadline) **draining** → (node in maintenance: the heartbeat
now carries the ``upgrade`` instruction) **upgrading** → (the agent restarted: a new
incarnation) return to service through admission → **admitting** → **done** when admission
verified the target (check ``upgrade_target``), **failed** when it refused it or a step took
longer than ``node_timeout``.

Disruption: a ready node starts only when the one gate allows it
(:func:`operations.disruption.disrupt`): the most restrictive of the pool's active disruption
budgets for ``upgrade``, the upgrade's ``max_unavailable_nodes`` (plus its ready surge nodes),
and the disruption budgets of its leases' groups. The Ready gate (a pause when the pool's Ready
SLI falls below its objective) uses the exported SLI's rule, so cordons do not pause it.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import DatabaseError, transaction
from django.utils import timezone

from fleet.choices import Lifecycle
from fleet.events import Actor
from fleet.models import Node
from maintenance import drains
from nodepool.api.problems import Problem
from nodepool.celery import app as celery_app

from . import capacity, disruption, outofservice
from .choices import NODE_IN_PROGRESS, DisruptionReason, PauseCause, UpgradeNodeState, UpgradePhase, UpgradeState
from .launches import surge_ready
from .models import ScaleDecision, Upgrade, UpgradeNode
from .targets import target_mismatches
from .upgrade_plan import pool_operations, unavailable_limit
from .upgrades import (
    _transition,
    begin_rollback,
    event,
    lock_upgrade,
    release_holds,
    row_target,
    tell_node,
)

logger = logging.getLogger(__name__)
TICKING_STATES = (UpgradeState.CANARY, UpgradeState.ROLLING, UpgradeState.ROLLING_BACK, UpgradeState.PAUSED)
PHASE_OF = {
    UpgradeState.CANARY: UpgradePhase.CANARY,
    UpgradeState.ROLLING: UpgradePhase.ROLL,
    UpgradeState.ROLLING_BACK: UpgradePhase.ROLLBACK,
}


def advance(*, upgrade_id, actor: Actor | None = None, now=None) -> bool:
    """Run one tick of ``upgrade_id``. Returns True while the workflow wants more ticks.

    Raises: NotFound (404) for an unknown upgrade.
    """
    now = now or timezone.now()
    actor = actor or Actor.system(outofservice.UPGRADE)
    with transaction.atomic():
        upgrade = lock_upgrade(upgrade_id)
        Upgrade.objects.filter(pk=upgrade.pk).update(last_tick_at=now)
        if upgrade.state not in TICKING_STATES:
            return False
        for row in UpgradeNode.objects.filter(upgrade=upgrade, state__in=NODE_IN_PROGRESS).select_related("upgrade"):
            _guarded(_step, row, upgrade, actor, now)
        state_before, version_before = upgrade.state, upgrade.version
        if upgrade.state in (UpgradeState.CANARY, UpgradeState.ROLLING):
            _request_surge(upgrade)
        if upgrade.state == UpgradeState.CANARY:
            _canary(upgrade, actor, now)
        elif upgrade.state == UpgradeState.ROLLING:
            _rolling(upgrade, actor, now)
        elif upgrade.state == UpgradeState.ROLLING_BACK:
            _rolling_back(upgrade, actor, now)
        if upgrade.state != state_before or upgrade.version != version_before:
            upgrade.save()
        else:
            Upgrade.objects.filter(pk=upgrade.pk).update(
                failures=upgrade.failures, soak_until=upgrade.soak_until, status_reason=upgrade.status_reason
            )
        in_flight = UpgradeNode.objects.filter(upgrade=upgrade, state__in=NODE_IN_PROGRESS).exists()
    return upgrade.state in TICKING_STATES and (upgrade.state != UpgradeState.PAUSED or in_flight)


def _guarded(function, row, upgrade, actor, now, *extra):
    """Run one node's step in a savepoint: a refusal (a racing operator action, 409/412) or a
    database error (a deadlock victim, a lock timeout: the savepoint is rolled back, so the tick's
    transaction goes on) is logged and retried next tick, and never undoes the other nodes' steps."""
    try:
        with transaction.atomic():
            return function(row, upgrade, actor, now, *extra)
    except Problem as exc:
        logger.info("upgrade %s: node %s not moved this tick: %s", upgrade.pk, row.node_id, exc.detail)
        return False
    except DatabaseError:
        logger.exception("upgrade %s: node %s not moved this tick", upgrade.pk, row.node_id)
        return False


def _set(row: UpgradeNode, verb: str, *, now, detail: str = "", **fields) -> None:
    """Move ``row`` by its declared transition ``verb`` (TransitionNotAllowed from a state the
    declaration does not list) and save it: the caller holds the upgrade's row lock."""
    getattr(row, verb)()
    if row.state == UpgradeNodeState.UPGRADING:
        tell_node(row.node_id)  # the instruction now waits for the node: its next renewal says so
    row.detail = detail or row.detail
    if row.state in (UpgradeNodeState.DONE, UpgradeNodeState.FAILED, UpgradeNodeState.SKIPPED):
        row.finished_at = now
    for name, value in fields.items():
        setattr(row, name, value)
    row.save()


def _fail(row, upgrade, actor, now, detail: str, node=None) -> None:
    before = row.state
    _set(row, "fail", now=now, detail=detail)
    if row.phase != UpgradePhase.ROLLBACK:
        upgrade.failures += 1
    event(
        upgrade,
        actor,
        f"node failed: {detail}",
        node=row.node_id,
        from_state=before,
        to_state=UpgradeNodeState.FAILED,
        phase=row.phase,
    )


def _step(row: UpgradeNode, upgrade: Upgrade, actor: Actor, now) -> None:
    """Move one in-progress node forward if what it waits for happened."""
    node = Node.objects.get(pk=row.node_id)
    if row.started_at and now - row.started_at > timedelta(seconds=upgrade.node_timeout):
        _fail(row, upgrade, actor, now, f"timed out after {upgrade.node_timeout}s while {row.state}")
        return
    if row.state == UpgradeNodeState.DRAINING:
        if node.lifecycle == Lifecycle.DRAINING and row.drain_id:
            # Evaluate the drain now rather than at the maintenance sweep's next run: leases that
            # checkpointed end (and are requeued) within one tick.
            drains.evaluate_drain(drain_id=row.drain_id, actor=actor, now=now)
            node = Node.objects.get(pk=row.node_id)
        if node.lifecycle == Lifecycle.MAINTENANCE:
            _set(
                row,
                "start_upgrade",
                now=now,
                incarnation_at_drain=node.incarnation,
                detail="drained; told to upgrade",
            )
            event(
                upgrade,
                actor,
                "drained; upgrade instruction sent",
                node=node,
                from_state=UpgradeNodeState.DRAINING,
                to_state=UpgradeNodeState.UPGRADING,
                phase=row.phase,
                target=row_target(row).get("version"),
            )
        elif node.lifecycle not in (Lifecycle.DRAINING,):
            _fail(row, upgrade, actor, now, f"the drain ended with the node {node.lifecycle}")
    elif row.state == UpgradeNodeState.UPGRADING:
        if node.incarnation > (row.incarnation_at_drain or 0):
            outofservice.return_to_service(
                node=node,
                owner=outofservice.UPGRADE,
                reason=f"restarted at {node.agent_version}; admission verifies the target",
            )
            _set(row, "admit", now=now, detail=f"restarted as incarnation {node.incarnation}")
            event(
                upgrade,
                actor,
                f"restarted with agent {node.agent_version}; admission runs",
                node=node,
                from_state=UpgradeNodeState.UPGRADING,
                to_state=UpgradeNodeState.ADMITTING,
                phase=row.phase,
                incarnation=node.incarnation,
                agent_version=node.agent_version,
            )
    elif row.state == UpgradeNodeState.ADMITTING:
        if node.lifecycle == Lifecycle.READY:
            problems = target_mismatches(node, row_target(row))
            if problems:
                _fail(row, upgrade, actor, now, "admitted but not at the target: " + "; ".join(problems))
                return
            _set(row, "finish", now=now, detail=f"admitted at {node.agent_version}")
            event(
                upgrade,
                actor,
                f"admitted at {node.agent_version}",
                node=node,
                from_state=UpgradeNodeState.ADMITTING,
                to_state=UpgradeNodeState.DONE,
                phase=row.phase,
            )
        elif node.lifecycle == Lifecycle.REJECTED:
            _fail(row, upgrade, actor, now, f"admission refused: {node.lifecycle_reason}")


def _start(row: UpgradeNode, upgrade: Upgrade, actor: Actor, now, limit: int | None = None):
    """Start one waiting node. True: it started and took a ready node out; False: it started (or
    finished) without taking a ready node out; None: not now (try another node); a
    :class:`~operations.disruption.Verdict`: the gate refused it (``limit``: the nodes
    ``max_unavailable_nodes`` allows, surge included)."""
    node = Node.objects.get(pk=row.node_id)
    target = row_target(row)
    if node.lifecycle == Lifecycle.READY and not target_mismatches(node, target):
        _set(row, "finish", now=now, started_at=now, detail="already at the target")
        event(upgrade, actor, "already at the target", node=node, to_state=UpgradeNodeState.DONE, phase=row.phase)
        return False
    if node.lifecycle == Lifecycle.READY:
        ops = pool_operations(node.pool)
        try:
            drain = disruption.disrupt(
                node=node,
                reason=DisruptionReason.UPGRADE,
                owner=outofservice.UPGRADE,
                why=f"upgrade to {target.get('version')}",
                policy=ops.drain_policy,
                timeout=ops.drain_timeout,
                max_unavailable=limit,
                now=now,
            )
        except disruption.DisruptionBlocked as blocked:
            blocked.record()
            detail = f"waiting: {blocked.verdict.describe()}"
            if row.detail != detail:
                row.detail = detail
                row.save(update_fields=["detail"])
            return blocked.verdict
        _set(row, "drain", now=now, started_at=now, drain_id=drain.pk, detail="draining")
        event(
            upgrade,
            actor,
            f"cordoned and draining ({ops.drain_policy})",
            node=node,
            from_state=UpgradeNodeState.WAITING,
            to_state=UpgradeNodeState.DRAINING,
            phase=row.phase,
            drain_id=str(drain.pk),
        )
        _step(row, upgrade, actor, now)  # a node without leases is drained at once
        return True
    if node.lifecycle in (Lifecycle.MAINTENANCE, Lifecycle.REJECTED, Lifecycle.PENDING):
        if not target_mismatches(node, target):
            # Already runs what this phase wants (a rollback of an upgrade that did not take):
            # no restart needed, only admission.
            outofservice.return_to_service(
                node=node, owner=outofservice.UPGRADE, reason=f"already at {node.agent_version}; admission verifies it"
            )
            _set(row, "admit", now=now, started_at=now, detail="already at the target; admitting")
            event(
                upgrade,
                actor,
                "already at the target; admission runs",
                node=node,
                from_state=UpgradeNodeState.WAITING,
                to_state=UpgradeNodeState.ADMITTING,
                phase=row.phase,
            )
            return False
        if node.lifecycle == Lifecycle.REJECTED:
            node = outofservice.release_for_retry(
                node=node, owner=outofservice.UPGRADE, reason=f"back to {target.get('version')}"
            )
        _set(
            row,
            "start_upgrade",
            now=now,
            started_at=now,
            incarnation_at_drain=node.incarnation,
            detail="told to upgrade",
        )
        event(
            upgrade,
            actor,
            "upgrade instruction sent",
            node=node,
            from_state=UpgradeNodeState.WAITING,
            to_state=UpgradeNodeState.UPGRADING,
            phase=row.phase,
            target=target.get("version"),
        )
        return False
    return None


def _start_waiting(upgrade: Upgrade, phase: str, actor: Actor, now) -> int:
    """Start waiting rows of ``phase`` in order, each ready node only if the gate allows it
    (:func:`operations.disruption.disrupt`: the pool's budgets, ``max_unavailable_nodes`` with
    the upgrade's ready surge nodes, the workload budgets). A pool-level refusal stops the pass for
    that pool; a workload budget skips that node for the next one. The upgrade names what it waits
    on in ``status_reason``."""
    rows = list(
        UpgradeNode.objects.filter(upgrade=upgrade, phase=phase, state=UpgradeNodeState.WAITING)
        .select_related("upgrade", "node__pool")
        .order_by("position")
    )
    if not rows:
        return 0
    pools = {row.node.pool_id: row.node.pool for row in rows}
    limits = {}
    for pool_id, pool in pools.items():
        limits[pool_id] = unavailable_limit(upgrade, capacity.member_nodes(pool).count())
        if upgrade.max_surge_nodes and pool_id == upgrade.pool_id and phase != UpgradePhase.ROLLBACK:
            # Nodes the provider added first keep capacity up while as many more are out.
            limits[pool_id] += min(upgrade.max_surge_nodes, surge_ready(pool_id=pool_id, upgrade_id=upgrade.pk))
    blocked_pools: set = set()
    waiting_on: list[str] = []
    started = 0
    for row in rows:
        pool_id = row.node.pool_id
        if pool_id in blocked_pools and row.node.lifecycle == Lifecycle.READY:
            continue
        outcome = _guarded(_start, row, upgrade, actor, now, limits[pool_id])
        if outcome is True:
            started += 1
        elif isinstance(outcome, disruption.Verdict):
            if outcome.pool_level:
                blocked_pools.add(pool_id)
                waiting_on.append(f"{pools[pool_id].name}: {outcome.describe()}")
            elif not started and len(waiting_on) < 3:
                waiting_on.append(f"node {row.node}: {outcome.describe()}")
    if waiting_on:
        reason = (f"started {started} node(s), then " if started else "") + "waiting on " + "; ".join(waiting_on)
        if upgrade.status_reason != reason:
            upgrade.status_reason = reason  # visible on the upgrade while it waits
    return started


def _counts(upgrade: Upgrade, phase: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for state in UpgradeNode.objects.filter(upgrade=upgrade, phase=phase).values_list("state", flat=True):
        counts[state] = counts.get(state, 0) + 1
    return counts


def _pause(upgrade: Upgrade, actor: Actor, reason: str, cause: str) -> None:

    upgrade.paused_from = upgrade.state
    upgrade.pause_cause = cause
    _transition(upgrade, "pause", "pause", actor, reason, automatic=True)


def _canary_failed(upgrade: Upgrade, actor: Actor, reason: str) -> None:
    if upgrade.auto_rollback:
        begin_rollback(upgrade, actor, f"canary failed: {reason}")
    else:
        _pause(upgrade, actor, f"canary failed: {reason}", PauseCause.CANARY_FAILED)


def _canary(upgrade: Upgrade, actor: Actor, now) -> None:
    failed = UpgradeNode.objects.filter(upgrade=upgrade, phase=UpgradePhase.CANARY, state=UpgradeNodeState.FAILED)
    if failed.exists():
        row = failed.first()
        _canary_failed(upgrade, actor, f"node {row.node_id}: {row.detail}")
        return
    counts = _counts(upgrade, UpgradePhase.CANARY)
    if counts.get(UpgradeNodeState.WAITING) or any(counts.get(s) for s in NODE_IN_PROGRESS):
        _start_waiting(upgrade, UpgradePhase.CANARY, actor, now)
        return
    if upgrade.soak_until is None:
        upgrade.soak_until = now + timedelta(seconds=upgrade.soak_seconds)
        upgrade.status_reason = f"canary admitted; soaking until {upgrade.soak_until.isoformat()}"
        event(upgrade, actor, upgrade.status_reason, soak_seconds=upgrade.soak_seconds)
        return
    done = UpgradeNode.objects.filter(upgrade=upgrade, phase=UpgradePhase.CANARY, state=UpgradeNodeState.DONE)
    sick = Node.objects.filter(pk__in=done.values("node_id")).exclude(capacity.AVAILABLE).first()
    if sick is not None:
        _canary_failed(
            upgrade,
            actor,
            f"node {sick.pk} stopped being available during the soak "
            f"({sick.lifecycle}, {sick.liveness}, health {sick.health})",
        )
        return
    if now >= upgrade.soak_until:
        _transition(upgrade, "roll", "roll", actor, "canary soaked healthy; rolling")


def _request_surge(upgrade: Upgrade) -> None:
    """Ask the provider for ``max_surge_nodes`` extra nodes once, from a task after this tick
    commits (the provider is never called while the upgrade row is locked)."""

    if upgrade.max_surge_nodes and not ScaleDecision.objects.filter(data__upgrade_id=str(upgrade.pk)).exists():
        # By name: operations.tasks runs this module (no import cycle).
        surge = celery_app.signature(
            "operations.request_surge", args=[upgrade.pool_id, upgrade.max_surge_nodes, str(upgrade.pk)]
        )
        transaction.on_commit(lambda: surge.apply_async(), robust=True)


def _rolling(upgrade: Upgrade, actor: Actor, now) -> None:
    if upgrade.failures >= upgrade.failure_threshold:
        _pause(
            upgrade,
            actor,
            f"{upgrade.failures} node(s) failed (threshold {upgrade.failure_threshold})",
            PauseCause.FAILURES,
        )
        return
    objective = capacity.ready_ratio_objective(upgrade.pool)
    if objective is not None:
        in_flight = UpgradeNode.objects.filter(upgrade=upgrade, state__in=NODE_IN_PROGRESS).values_list(
            "node_id", flat=True
        )
        ratio = capacity.ready_ratio(upgrade.pool, exclude_node_ids=list(in_flight))
        if ratio is not None and ratio < objective:
            _pause(
                upgrade,
                actor,
                f"Ready ratio {ratio:.3f} is below the pool's objective {objective:.3f}",
                PauseCause.READY_RATIO,
            )
            return
    _start_waiting(upgrade, UpgradePhase.ROLL, actor, now)
    counts = _counts(upgrade, UpgradePhase.ROLL)
    if not counts.get(UpgradeNodeState.WAITING) and not any(counts.get(s) for s in NODE_IN_PROGRESS):
        if upgrade.failures >= upgrade.failure_threshold:
            _pause(
                upgrade,
                actor,
                f"{upgrade.failures} node(s) failed (threshold {upgrade.failure_threshold})",
                PauseCause.FAILURES,
            )
            return

        totals = _counts(upgrade, UpgradePhase.CANARY)
        for state, n in counts.items():
            totals[state] = totals.get(state, 0) + n
        upgrade.finished_at = now
        _transition(upgrade, "complete", "complete", actor, "every node is at the target", nodes=totals)
        release_holds(upgrade, reason=f"upgrade {upgrade.state}")


def _rolling_back(upgrade: Upgrade, actor: Actor, now) -> None:
    _start_waiting(upgrade, UpgradePhase.ROLLBACK, actor, now)
    counts = _counts(upgrade, UpgradePhase.ROLLBACK)
    if counts.get(UpgradeNodeState.WAITING) or any(counts.get(s) for s in NODE_IN_PROGRESS):
        return

    upgrade.finished_at = now
    if counts.get(UpgradeNodeState.FAILED):
        _transition(upgrade, "fail", "fail", actor, f"{counts[UpgradeNodeState.FAILED]} node(s) failed to roll back")
    else:
        _transition(upgrade, "finish_rollback", "finish-rollback", actor, "every touched node is back", nodes=counts)
    release_holds(upgrade, reason=f"upgrade {upgrade.state}")
