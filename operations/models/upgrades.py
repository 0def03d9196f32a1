"""Rolling upgrades: the upgrade of a pool and each node's turn in it (django-fsm-2 state machines)."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django_fsm import RETURN_VALUE, ConcurrentTransitionMixin, FSMField, transition

from nodepool.fsm import SerializedFSMRefresh

from ..choices import (
    ACTIVE_UPGRADE_STATES,
    NODE_IN_PROGRESS,
    PauseCause,
    UpgradeNodeState,
    UpgradePhase,
    UpgradeState,
)


class Upgrade(SerializedFSMRefresh, ConcurrentTransitionMixin, models.Model):
    """A rolling upgrade of one pool to ``target`` (shape of :attr:`PoolOperations.target`).

    ``max_unavailable_nodes`` is a count (``"2"``) or a percentage of the pool (``"10%"``, rounded
    down, at least 1) — distinct from ``DisruptionBudget.max_unavailable``, which counts leases.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    pool = models.ForeignKey("fleet.Pool", on_delete=models.PROTECT, related_name="upgrades")
    state = FSMField(max_length=16, choices=UpgradeState.choices, default=UpgradeState.PENDING, protected=True)
    target = models.JSONField(default=dict)
    previous_target = models.JSONField(default=dict, blank=True)
    max_unavailable_nodes = models.CharField(max_length=8, default="1")
    max_surge_nodes = models.PositiveIntegerField(default=0)
    canary_nodes = models.PositiveIntegerField(default=1)
    canary_pool = models.ForeignKey("fleet.Pool", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    soak_seconds = models.PositiveIntegerField(default=300)
    failure_threshold = models.PositiveIntegerField(default=1, help_text="Failed nodes that pause the roll.")
    node_timeout = models.PositiveIntegerField(default=900, help_text="Seconds a node has to drain, restart, admit.")
    auto_rollback = models.BooleanField(default=True, help_text="Roll back by itself when a canary fails.")
    reason = models.TextField(blank=True)
    status_reason = models.TextField(blank=True)
    paused_from = models.CharField(max_length=16, blank=True)
    pause_cause = models.CharField(max_length=16, choices=PauseCause.choices, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_by_name = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    soak_until = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    failures = models.PositiveIntegerField(default=0)
    # The tick chain that drives the workflow: a chain whose generation is not this one stops.
    tick_generation = models.PositiveIntegerField(default=0)
    last_tick_at = models.DateTimeField(null=True, blank=True)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["pool"], condition=Q(state__in=ACTIVE_UPGRADE_STATES), name="upgrade_one_active_per_pool"
            )
        ]
        permissions = [("operate_upgrade", "Can start, pause, resume, roll back and abort upgrades")]

    def __str__(self) -> str:
        return f"upgrade of {self.pool_id} to {self.target.get('version', '?')} ({self.state})"

    # --- transitions: memory only (services lock, save and record the event) ------------------
    @transition(field=state, source=UpgradeState.PENDING, target=UpgradeState.CANARY)
    def start_canary(self):
        """pending → canary: the canary nodes go first."""

    @transition(field=state, source=[UpgradeState.PENDING, UpgradeState.CANARY], target=UpgradeState.ROLLING)
    def roll(self):
        """pending (no canary) | canary (soaked) → rolling."""

    @transition(field=state, source=[UpgradeState.CANARY, UpgradeState.ROLLING], target=UpgradeState.PAUSED)
    def pause(self):
        """canary | rolling → paused: no new node starts; nodes in flight finish."""

    @transition(
        field=state,
        source=UpgradeState.PAUSED,
        target=RETURN_VALUE(UpgradeState.CANARY, UpgradeState.ROLLING),
    )
    def resume(self):
        """paused → where it paused from."""
        return self.paused_from if self.paused_from == UpgradeState.CANARY else UpgradeState.ROLLING

    @transition(field=state, source=UpgradeState.ROLLING, target=UpgradeState.COMPLETED)
    def complete(self):
        """rolling → completed: every node admitted at the target."""

    @transition(
        field=state,
        source=[UpgradeState.CANARY, UpgradeState.ROLLING, UpgradeState.PAUSED],
        target=UpgradeState.ROLLING_BACK,
    )
    def rollback(self):
        """canary | rolling | paused → rolling_back: nodes go back to the previous target."""

    @transition(field=state, source=UpgradeState.ROLLING_BACK, target=UpgradeState.ROLLED_BACK)
    def finish_rollback(self):
        """rolling_back → rolled_back."""

    @transition(field=state, source=list(ACTIVE_UPGRADE_STATES), target=UpgradeState.ABORTED)
    def abort(self):
        """any active state → aborted: nothing new starts; nodes stay where they are."""

    @transition(field=state, source=list(ACTIVE_UPGRADE_STATES), target=UpgradeState.FAILED)
    def fail(self):
        """any active state → failed (the rollback itself failed, or the pool vanished)."""


class UpgradeNode(SerializedFSMRefresh, ConcurrentTransitionMixin, models.Model):
    """One node's turn in one phase of an upgrade, resumable from its ``state`` alone."""

    upgrade = models.ForeignKey(Upgrade, on_delete=models.CASCADE, related_name="nodes")
    node = models.ForeignKey("fleet.Node", on_delete=models.CASCADE, related_name="+")
    phase = models.CharField(max_length=16, choices=UpgradePhase.choices)
    position = models.PositiveIntegerField()
    state = FSMField(max_length=16, choices=UpgradeNodeState.choices, default=UpgradeNodeState.WAITING, protected=True)
    from_version = models.CharField(max_length=64, blank=True)
    incarnation_at_drain = models.PositiveBigIntegerField(null=True, blank=True)
    drain_id = models.UUIDField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    detail = models.TextField(blank=True)

    class Meta:
        ordering = ["upgrade", "phase", "position"]
        constraints = [
            models.UniqueConstraint(fields=["upgrade", "node", "phase"], name="upgradenode_unique_phase"),
        ]
        indexes = [models.Index(fields=["node", "state"], name="upgradenode_node_state")]

    def __str__(self) -> str:
        return f"{self.phase} #{self.position} {self.node_id}: {self.state}"

    # --- transitions: memory only (operations.rollout saves under the upgrade's row lock; the
    # set-based moves in operations.upgrades go through nodepool.fsm.move) -------------------------
    @transition(field=state, source=UpgradeNodeState.WAITING, target=UpgradeNodeState.DRAINING)
    def drain(self):
        """waiting → draining: cordoned and draining through the disruption gate."""

    @transition(field=state, source=[UpgradeNodeState.WAITING, UpgradeNodeState.DRAINING],
                target=UpgradeNodeState.UPGRADING)  # fmt: skip
    def start_upgrade(self):
        """waiting (not ready: nothing to drain) | draining (drained) → upgrading: told to upgrade."""

    @transition(field=state, source=[UpgradeNodeState.WAITING, UpgradeNodeState.UPGRADING],
                target=UpgradeNodeState.ADMITTING)  # fmt: skip
    def admit(self):
        """waiting (already at the target) | upgrading (restarted) → admitting."""

    @transition(field=state, source=[UpgradeNodeState.WAITING, UpgradeNodeState.ADMITTING],
                target=UpgradeNodeState.DONE)  # fmt: skip
    def finish(self):
        """waiting (already at the target) | admitting (admitted at the target) → done."""

    @transition(field=state, source=list(NODE_IN_PROGRESS), target=UpgradeNodeState.FAILED)
    def fail(self):
        """draining | upgrading | admitting → failed (admission refused, the drain ended, a timeout)."""

    @transition(field=state, source=UpgradeNodeState.FAILED, target=UpgradeNodeState.WAITING)
    def retry(self):
        """failed → waiting: a canary retried by an operator's override."""

    @transition(field=state, source=UpgradeNodeState.WAITING, target=UpgradeNodeState.SKIPPED)
    def skip(self):
        """waiting → skipped: the upgrade ended (abort, rollback) or an override moved its turn."""

    @transition(field=state, source=list(NODE_IN_PROGRESS), target=UpgradeNodeState.SKIPPED)
    def abandon(self):
        """draining | upgrading | admitting → skipped: in flight when the upgrade ended or rolled back."""
