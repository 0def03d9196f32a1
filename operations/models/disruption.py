"""Automated disruption: why the gate refused a node, the shape a node was admitted with (drift), and
the replacements and repairs that take nodes out."""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q
from django_fsm import ConcurrentTransitionMixin, FSMField, transition

from nodepool.fsm import SerializedFSMRefresh

from ..choices import (
    ACTIVE_REPAIR_STATES,
    ACTIVE_REPLACEMENT_STATES,
    DisruptionReason,
    RepairAction,
    RepairState,
    ReplacementState,
)


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
