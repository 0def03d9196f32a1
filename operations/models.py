"""Pool operations: each pool's operation settings (target, spot, autoscaling), upgrades and the
nodes they move, machines asked of a provider, scale decisions, and preemptions.

Each row records the operation around a node (who asked, why, how far it got); the node's own
lifecycle stays on :class:`fleet.models.Node` and moves only through the maintenance services.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django_fsm import RETURN_VALUE, ConcurrentTransitionMixin, FSMField, transition

from maintenance.choices import EvictionPolicy
from nodepool.fsm import SerializedFSMRefresh

from .choices import (
    ACTIVE_REPAIR_STATES,
    ACTIVE_REPLACEMENT_STATES,
    ACTIVE_UPGRADE_STATES,
    LIVE_MACHINE_STATES,
    NODE_IN_PROGRESS,
    DisruptionReason,
    MachineState,
    PauseCause,
    PreemptionSource,
    PreemptionState,
    ProviderKind,
    RepairAction,
    RepairState,
    ReplacementState,
    ScaleDirection,
    ScaleOutcome,
    UpgradeNodeState,
    UpgradePhase,
    UpgradeState,
)


def default_disruption_budgets() -> list[dict]:
    """Every pool's default: automation disrupts at most 10 % of the pool's nodes at once
    (rounded up, at least 1), Karpenter's default budget."""
    return [{"nodes": "10%"}]


class PoolOperations(models.Model):
    """The operation settings of one pool (created on first use, one per pool).

    ``target``: what the pool's nodes must run, verified by admission (check ``upgrade_target``):
    ``{"version": "2.0.0", "agent_versions": ">=2.0,<3" (PEP 440, default ==version),
    "image": str, "kernel": str, "labels": {k: v}, "artifact": {"ref": str, "sha256": hex},
    "action": "agent"}``; empty = no target. ``node_template`` is the shape of a node the provider
    creates: ``{"resources": {name: canonical int}, "labels": {}, "taints": [...], "features": {},
    "price": "0.40"}`` (``price``: what one such machine costs per hour, optional, a decimal string).
    Times are seconds; ``scale_down_utilization`` a fraction 0..1 of allocatable.
    """

    pool = models.OneToOneField("fleet.Pool", on_delete=models.CASCADE, related_name="operations")
    target = models.JSONField(default=dict, blank=True)
    drain_policy = models.CharField(max_length=16, choices=EvictionPolicy.choices, default=EvictionPolicy.CHECKPOINT)
    drain_timeout = models.PositiveIntegerField(default=600, help_text="Seconds a system drain may take.")
    # Spot / preemptible.
    spot = models.BooleanField(default=False)
    fallback_pool = models.ForeignKey(
        "fleet.Pool",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="Where a preempted node's work is requeued first.",
    )
    # Autoscaling.
    provider = models.CharField(max_length=16, choices=ProviderKind.choices, default=ProviderKind.NONE, blank=True)
    provider_url = models.URLField(blank=True, help_text="webhook: the operator's URL; simulated: the control plane")
    provider_secret = models.CharField(max_length=200, blank=True, help_text="HMAC-SHA256 key of the webhook.")
    min_nodes = models.PositiveIntegerField(default=0)
    max_nodes = models.PositiveIntegerField(default=0, help_text="0: the provider adds no nodes.")
    node_template = models.JSONField(default=dict, blank=True)
    scale_up_delay = models.PositiveIntegerField(default=30, help_text="Seconds a request waits before scale-up.")
    scale_up_cooldown = models.PositiveIntegerField(default=120)
    max_nodes_per_scale_up = models.PositiveIntegerField(default=5, help_text="The rate: nodes per decision.")
    scale_down_utilization = models.FloatField(default=0.2)
    scale_down_after = models.PositiveIntegerField(default=600, help_text="Seconds underused before removal.")
    scale_down_cooldown = models.PositiveIntegerField(default=300)
    boot_timeout = models.PositiveIntegerField(default=600, help_text="Seconds a new machine has to become ready.")
    # Pool disruption budgets (operations.disruption): [{"nodes": "10%", "reasons": [...],
    # "schedule": cron, "duration": "8h", "timezone": "UTC"}]; validated when written.
    disruption_budgets = models.JSONField(default=default_disruption_budgets, blank=True)
    # Safe provisioning: launches in flight (requested or enrolled, not ready) at most this many; after
    # consecutive failures (provider errors, machines not ready within boot_timeout, refused at
    # admission) scale-up backs off exponentially: scale_up_cooldown × 2^(failures − 1), capped.
    max_launches_in_flight = models.PositiveIntegerField(default=10)
    scale_up_backoff_base = models.PositiveIntegerField(
        default=120, help_text="Seconds: the first back-off after a failure (doubled per consecutive failure)."
    )
    scale_up_backoff_max = models.PositiveIntegerField(default=3600, help_text="Seconds: the back-off's cap.")
    # Ordered pool ids (cluster-autoscaler's priority expander): while this pool backs off, its
    # waiting requests go to the first of these pools that can launch a node holding them.
    fallback_pools = models.JSONField(default=list, blank=True)
    # Consolidation (operations.consolidation): off while consolidate_after is null. An empty machine
    # is removed after consolidate_after seconds; an under-used one is replaced by a cheaper template
    # node, or merged into the others, when its leases fit and it saves at least this fraction.
    consolidate_after = models.PositiveIntegerField(null=True, blank=True, help_text="Seconds; empty = off.")
    consolidation_min_saving = models.FloatField(
        default=0.2, help_text="Fraction 0..1 of a node's hourly price a replacement must save."
    )
    # Expiry (operations.expiry): a node is replaced once it has served this long since its last
    # admission (plus a per-node spread); null = never (Karpenter's expireAfter: Never).
    expire_after = models.PositiveIntegerField(
        null=True, blank=True, help_text="Seconds after admission a node is replaced; empty: never."
    )
    # After an expired node has waited this long for the budgets, its drain is forced; null = never forced.
    termination_grace = models.PositiveIntegerField(
        null=True, blank=True, help_text="Seconds an expired node waits for the budgets before it is forced out."
    )
    consecutive_failures = models.PositiveIntegerField(default=0)
    backoff_until = models.DateTimeField(null=True, blank=True)
    last_scale_up_at = models.DateTimeField(null=True, blank=True)
    last_scale_down_at = models.DateTimeField(null=True, blank=True)
    # {node_id: ISO time it was first seen below the utilization threshold}.
    underused_since = models.JSONField(default=dict, blank=True)
    # Repair (operations.repair): [{"condition": "Ready", "status": "False", "for": 600, "action":
    # "reboot"}]; validated when written. The breaker: no automated repair while more than
    # repair_max_unhealthy of the members are unhealthy, at most repair_max_concurrent at once.
    repair_rules = models.JSONField(
        default=list,
        blank=True,
        help_text='[{"condition": "Ready", "status": "False", "for": "10m", "action": "reboot" | "replace" | '
        '"quarantine"}]. A quarantine revokes the node\'s credential: it comes back only when a person '
        "releases it.",
    )
    repair_max_unhealthy = models.FloatField(
        default=0.2, help_text="Fraction 0..1: no automated repair while more of the pool is unhealthy."
    )
    repair_max_concurrent = models.PositiveIntegerField(default=1, help_text="Repairs in progress at once.")
    repair_breaker_open = models.BooleanField(default=False, editable=False)
    repair_breaker_since = models.DateTimeField(null=True, blank=True, editable=False)
    repair_breaker_detail = models.TextField(blank=True, editable=False)
    version = models.PositiveIntegerField(default=1)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "pool operations"
        constraints = [
            models.CheckConstraint(
                condition=Q(max_nodes=0) | Q(max_nodes__gte=models.F("min_nodes")), name="poolops_max_at_least_min"
            ),
            models.CheckConstraint(
                condition=Q(scale_down_utilization__gte=0) & Q(scale_down_utilization__lte=1),
                name="poolops_utilization_fraction",
            ),
            models.CheckConstraint(
                condition=Q(consolidation_min_saving__gte=0) & Q(consolidation_min_saving__lte=1),
                name="poolops_saving_fraction",
            ),
            models.CheckConstraint(
                condition=Q(repair_max_unhealthy__gte=0) & Q(repair_max_unhealthy__lte=1),
                name="poolops_repair_unhealthy_fraction",
            ),
        ]

    def __str__(self) -> str:
        return f"operations of {self.pool}"


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


class ScaleDecision(models.Model):
    """One autoscaling decision with its reason: acted on (requested/succeeded/failed) or held back."""

    pool = models.ForeignKey("fleet.Pool", on_delete=models.CASCADE, related_name="scale_decisions")
    direction = models.CharField(max_length=8, choices=ScaleDirection.choices)
    outcome = models.CharField(max_length=16, choices=ScaleOutcome.choices)
    count = models.PositiveIntegerField(default=0)
    reason = models.TextField()
    data = models.JSONField(default=dict, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.direction} {self.count} ({self.outcome})"


class ProviderMachine(SerializedFSMRefresh, models.Model):
    """A machine the pool's provider was asked to create, followed until it is deleted.

    ``pending_since`` is when the oldest lease request that caused it started waiting: the
    scale-up time is ``ready_at - pending_since`` (request pending to node ready).

    Passes do not lock each other out of following machines: every move is a compare-and-swap
    built from the transition declared here (``operations.autoscaler._moved``, ``nodepool.fsm.move``).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    pool = models.ForeignKey("fleet.Pool", on_delete=models.CASCADE, related_name="machines")
    provider = models.CharField(max_length=16, choices=ProviderKind.choices)
    name = models.CharField(max_length=100, unique=True)
    state = FSMField(max_length=16, choices=MachineState.choices, default=MachineState.REQUESTED, protected=True)
    decision = models.ForeignKey(ScaleDecision, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    bootstrap_token = models.ForeignKey(
        "fleet.BootstrapToken", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    node = models.OneToOneField("fleet.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="machine")
    provider_data = models.JSONField(default=dict, blank=True)
    requested_at = models.DateTimeField()
    pending_since = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True)
    # A removal claimed (state deleting): the state it ends in (deleted or failed) and why.
    removing_to = models.CharField(max_length=16, choices=MachineState.choices, blank=True)
    removal_reason = models.TextField(blank=True)
    # What the machine was made from: the pool's node template when it was requested (its
    # resources and hourly ``price``), so consolidation knows its type and price later.
    template = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-requested_at"]
        indexes = [models.Index(fields=["pool", "state"], name="machine_pool_state")]

    def __str__(self) -> str:
        return f"{self.name} ({self.state})"

    @property
    def scale_up_seconds(self) -> float | None:
        start = self.pending_since or self.requested_at
        return (self.ready_at - start).total_seconds() if self.ready_at else None

    # --- transitions: memory only (the claims in operations.autoscaler move the rows) -------------
    @transition(field=state, source=MachineState.REQUESTED, target=MachineState.ENROLLED)
    def enroll(self):
        """requested → enrolled: a node enrolled with the machine's bootstrap token."""

    @transition(field=state, source=MachineState.ENROLLED, target=MachineState.READY)
    def become_ready(self):
        """enrolled → ready: its node was admitted."""

    @transition(field=state, source=MachineState.READY, target=MachineState.DRAINING)
    def drain(self):
        """ready → draining: scale-down or consolidation cordoned and drains its node."""

    @transition(field=state, source=[*LIVE_MACHINE_STATES, MachineState.DRAINING], target=MachineState.DELETING)
    def claim_removal(self):
        """requested | enrolled | ready | draining → deleting: claimed for removal before the provider is asked."""

    @transition(field=state, source=MachineState.DELETING, target=MachineState.DELETED)
    def finish_deletion(self):
        """deleting → deleted: the provider deleted it."""

    @transition(field=state, source=[MachineState.REQUESTED, MachineState.DELETING], target=MachineState.FAILED)
    def fail(self):
        """requested (the provider's create failed) | deleting (a failed machine's removal finished) → failed."""


class Preemption(SerializedFSMRefresh, models.Model):
    """A preemption notice for a spot node: drained at once, its work requeued before ``deadline``."""

    node = models.ForeignKey("fleet.Node", on_delete=models.CASCADE, related_name="preemptions")
    pool = models.ForeignKey("fleet.Pool", on_delete=models.CASCADE, related_name="preemptions")
    source = models.CharField(max_length=16, choices=PreemptionSource.choices)
    deadline = models.DateTimeField()
    received_at = models.DateTimeField(db_index=True)
    state = FSMField(max_length=16, choices=PreemptionState.choices, default=PreemptionState.DRAINING, protected=True)
    drain_id = models.UUIDField(null=True, blank=True)
    fallback_pool = models.ForeignKey("fleet.Pool", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    leases_requeued = models.PositiveIntegerField(default=0)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-received_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["node"], condition=Q(state=PreemptionState.DRAINING), name="preemption_one_open_per_node"
            )
        ]

    def __str__(self) -> str:
        return f"preemption of {self.node_id} by {self.deadline:%H:%M:%S}"

    @transition(field=state, source=PreemptionState.DRAINING, target=PreemptionState.DRAINED)
    def close(self):
        """draining → drained: its node is in maintenance, retired or quarantined (operations.preemption.follow)."""


class SeenDelivery(models.Model):
    """Delivery ids of signed provider requests already accepted (replay protection)."""

    delivery_id = models.CharField(max_length=64, unique=True)
    seen_at = models.DateTimeField(db_index=True)

    def __str__(self) -> str:
        return self.delivery_id


class DisruptionBlock(models.Model):
    """Why automation may not disrupt a node now (the latest refusal of the gate,
    :func:`operations.disruption.request_disruption`); deleted when the node is disrupted.

    ``kind``: pool_budget, window, max_unavailable_nodes, workload_budget. ``blocker``: the
    gate's full answer (the budget with its index, or the workload group and the lease).
    """

    node = models.OneToOneField("fleet.Node", on_delete=models.CASCADE, related_name="disruption_block")
    pool = models.ForeignKey("fleet.Pool", on_delete=models.CASCADE, related_name="disruption_blocks")
    reason = models.CharField(max_length=16, choices=DisruptionReason.choices)
    owner = models.CharField(max_length=200)
    kind = models.CharField(max_length=32)
    detail = models.TextField(blank=True)
    blocker = models.JSONField(default=dict, blank=True)
    since = models.DateTimeField()
    last_seen_at = models.DateTimeField()

    class Meta:
        ordering = ["since"]

    def __str__(self) -> str:
        return f"{self.reason} of {self.node_id} blocked: {self.kind}"


class NodeShape(models.Model):
    """What a node was admitted with: the hash of its pool's node-shaping settings at its latest
    admission (:mod:`operations.drift`), and whether it has drifted from them since.

    ``pool_hash`` comes from the ``pool_shape`` admission check of ``admission_attempt`` (so an
    upgrade, which re-admits the node, records the new one); a node admitted before drift existed
    got its pool's hash at the first sweep. ``admitted_at`` is when expiry counts from.
    ``drift_reasons``: ``["pool shape changed (hash …)", "agent version 1.0.0 is outside …"]``.
    """

    node = models.OneToOneField("fleet.Node", on_delete=models.CASCADE, primary_key=True, related_name="shape")
    pool = models.ForeignKey("fleet.Pool", on_delete=models.CASCADE, related_name="+")
    pool_hash = models.CharField(max_length=64)
    hash_version = models.CharField(max_length=8, default="v1")
    admission_attempt = models.PositiveIntegerField(default=0)
    admitted_at = models.DateTimeField()
    drifted = models.BooleanField(default=False)
    drifted_since = models.DateTimeField(null=True, blank=True)
    drift_reasons = models.JSONField(default=list, blank=True)

    def __str__(self) -> str:
        return f"shape of {self.node_id}: {self.pool_hash[:12]}{' (drifted)' if self.drifted else ''}"


class NodeReplacement(SerializedFSMRefresh, ConcurrentTransitionMixin, models.Model):
    """One replacement of a node for ``reason`` (drift, expiry; repair may use it too), moved by
    :mod:`operations.replacement`. At most one active per node (the constraint is what makes two
    sweeps that find the same node start one replacement).

    ``key`` names the machines asked for it (``ScaleDecision.data.replacement``); ``attempt``
    counts launches (a replacement that failed to come up is asked for again). ``overrode``: the
    gate's blocker a forced replacement went past (``termination_grace``).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.ForeignKey("fleet.Node", on_delete=models.CASCADE, related_name="replacements")
    pool = models.ForeignKey("fleet.Pool", on_delete=models.CASCADE, related_name="replacements")
    reason = models.CharField(max_length=16, choices=DisruptionReason.choices)
    owner = models.CharField(max_length=200)
    state = FSMField(max_length=16, choices=ReplacementState.choices, default=ReplacementState.PENDING, protected=True)
    detail = models.TextField(blank=True)
    wanted_since = models.DateTimeField()
    force_at = models.DateTimeField(null=True, blank=True)
    forced = models.BooleanField(default=False)
    overrode = models.JSONField(default=dict, blank=True)
    attempt = models.PositiveIntegerField(default=0)
    # After a replacement machine failed to come up: not tried again before this (growing back-off).
    not_before = models.DateTimeField(null=True, blank=True)
    drain_id = models.UUIDField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["wanted_since"]
        constraints = [
            models.UniqueConstraint(
                fields=["node"],
                condition=Q(state__in=ACTIVE_REPLACEMENT_STATES),
                name="replacement_one_active_per_node",
            )
        ]
        indexes = [models.Index(fields=["pool", "state"], name="replacement_pool_state")]

    def __str__(self) -> str:
        return f"{self.reason} replacement of {self.node_id} ({self.state})"

    @property
    def key(self) -> str:
        return f"{self.pk}:{self.attempt}"

    # --- transitions: memory only (operations.replacement locks, saves and records the event) --
    @transition(field=state, source=ReplacementState.PENDING, target=ReplacementState.LAUNCHING)
    def launch(self):
        """pending → launching: cordoned through the gate; a replacement machine is requested."""

    @transition(field=state, source=ReplacementState.LAUNCHING, target=ReplacementState.PENDING)
    def relaunch(self):
        """launching → pending: the replacement did not come up; the cordon is lifted (Karpenter un-taints)."""

    @transition(
        field=state, source=[ReplacementState.PENDING, ReplacementState.LAUNCHING], target=ReplacementState.DRAINING
    )
    def drain(self):
        """pending (no pre-spun replacement) | launching (replacement ready) → draining."""

    @transition(field=state, source=ReplacementState.DRAINING, target=ReplacementState.REPLACED)
    def finish(self):
        """draining → replaced: the machine deleted, or the node re-admitted."""

    @transition(field=state, source=ACTIVE_REPLACEMENT_STATES, target=ReplacementState.CANCELLED)
    def cancel(self):
        """pending | launching | draining → cancelled: no longer needed."""

    @transition(field=state, source=ACTIVE_REPLACEMENT_STATES, target=ReplacementState.FAILED)
    def fail(self):
        """→ failed: re-admission refused the node, or its drain ended otherwise."""


class Repair(SerializedFSMRefresh, ConcurrentTransitionMixin, models.Model):
    """One automated repair of one node by a rule of its pool (operations.repair).

    ``rule`` is the rule as it was when the repair started (``{"condition", "status", "for",
    "action"}``, ``for`` in seconds) and ``rule_index`` its place in the pool's list; ``action``
    may differ from the rule's when the repair escalates (``escalated_from``). ``boot_id`` and
    ``incarnation`` are the node's at the reboot instruction (a new boot id or a higher incarnation
    is the reboot); ``verify_until`` is when a rebooted node still failing escalates.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    pool = models.ForeignKey("fleet.Pool", on_delete=models.CASCADE, related_name="repairs")
    node = models.ForeignKey("fleet.Node", on_delete=models.CASCADE, related_name="repairs")
    state = FSMField(max_length=16, choices=RepairState.choices, default=RepairState.PENDING, protected=True)
    action = models.CharField(max_length=16, choices=RepairAction.choices)
    rule = models.JSONField(default=dict)
    rule_index = models.PositiveSmallIntegerField(default=0)
    condition = models.CharField(max_length=100, help_text="the condition that held: Ready=False")
    escalated_from = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    drain_id = models.UUIDField(null=True, blank=True)
    boot_id = models.CharField(max_length=64, blank=True)
    incarnation = models.PositiveBigIntegerField(null=True, blank=True)
    rebooted_at = models.DateTimeField(null=True, blank=True)
    verify_until = models.DateTimeField(null=True, blank=True)
    detail = models.TextField(blank=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            # Two sweeps that pick the same node: the second insert fails (operations.repair.start).
            models.UniqueConstraint(
                fields=["node"], condition=Q(state__in=ACTIVE_REPAIR_STATES), name="repair_one_active_per_node"
            )
        ]
        indexes = [models.Index(fields=["pool", "state"], name="repair_pool_state")]

    def __str__(self) -> str:
        return f"{self.action} of {self.node_id} ({self.state})"

    # --- transitions: memory only (operations.repair locks, saves and records the event) ----------
    @transition(field=state, source=RepairState.PENDING, target=RepairState.REBOOTING)
    def reboot(self):
        """pending → rebooting: drained; the agent is told to run its reboot command."""

    @transition(field=state, source=RepairState.REBOOTING, target=RepairState.VERIFYING)
    def rebooted(self):
        """rebooting → verifying: a new boot (or agent incarnation) was seen."""

    @transition(field=state, source=RepairState.PENDING, target=RepairState.REPLACING)
    def replace(self):
        """pending → replacing: drained; a replacement is asked, the node removed."""

    @transition(field=state, source=[RepairState.PENDING, RepairState.VERIFYING, RepairState.REPLACING],
                target=RepairState.SUCCEEDED)  # fmt: skip
    def succeed(self):
        """verifying (health checks pass) | replacing (node removed) | pending (quarantined) → succeeded."""

    @transition(field=state, source=RepairState.VERIFYING, target=RepairState.ESCALATED)
    def escalate(self):
        """verifying → escalated: still failing one rule duration after the reboot."""

    @transition(field=state, source=list(ACTIVE_REPAIR_STATES), target=RepairState.FAILED)
    def fail(self):
        """any active state → failed (the node left, the drain was cancelled, no reboot came)."""
