"""Autoscaling and spot: scale decisions, the machines a provider was asked for, preemption notices and
the signed deliveries already accepted."""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q
from django_fsm import FSMField, transition

from nodepool.fsm import SerializedFSMRefresh

from ..choices import (
    LIVE_MACHINE_STATES,
    MachineState,
    PreemptionSource,
    PreemptionState,
    ProviderKind,
    ScaleDirection,
    ScaleOutcome,
)


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
    built from the transition declared here (``operations.machines._moved``, ``nodepool.fsm.move``).
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
