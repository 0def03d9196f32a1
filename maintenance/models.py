"""Maintenance records: drains (with their evictions), disruption budgets and quarantines.

The node's lifecycle itself lives on :class:`fleet.models.Node` (FSM); these rows record the
operation around it: who asked, why, by when, how far it got, and what it disrupted.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone
from django_fsm import FSMField, transition

from fleet.choices import ActorType
from nodepool.fsm import SerializedFSMRefresh

from .choices import DrainState, EvictionKind, EvictionPolicy, QuarantineRule


class Drain(SerializedFSMRefresh, models.Model):
    """One drain of one node: move its leases off by ``deadline`` under an eviction ``policy``.

    ``progress`` is the snapshot of the last evaluation (see ``maintenance.drains``):
    ``{"evaluated_at", "leases_remaining", "remaining": [...], "at_risk": [lease ids],
    "unconfirmed": [lease ids], "waiting_on": [{"code", "message", "lease_ids", "groups"}],
    "budgets": [{"group", "allowed_disruptions", ...}]}``. ``version`` counts operator-visible
    changes (deadline, state), not progress refreshes, so an operator's If-Match stays valid
    while the sweep updates progress.

    ``state`` is a protected FSM field: the verbs below declare the graph (docs/state-machines.md);
    maintenance.drains and maintenance.services move it with claims built from them
    (``nodepool.fsm.move``), in their transactions, under the node's row lock.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    node = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="drains")
    state = FSMField(max_length=16, choices=DrainState.choices, default=DrainState.ACTIVE, protected=True)
    policy = models.CharField(max_length=16, choices=EvictionPolicy.choices, default=EvictionPolicy.WAIT)
    reason = models.TextField()
    deadline = models.DateTimeField()
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    requested_by_name = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    finish_reason = models.TextField(blank=True)
    leases_at_start = models.PositiveIntegerField(default=0)
    leases_remaining = models.PositiveIntegerField(default=0)
    progress = models.JSONField(default=dict, blank=True)
    progress_at = models.DateTimeField(null=True, blank=True)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            # A node has at most one drain in progress; a second request is a 409, not a second drain.
            models.UniqueConstraint(fields=["node"], condition=Q(state=DrainState.ACTIVE), name="drain_one_active"),
        ]
        indexes = [
            # The safety-net sweep reads active drains ordered by deadline.
            models.Index(fields=["deadline"], name="drain_active_deadline", condition=Q(state=DrainState.ACTIVE)),
        ]

    def __str__(self) -> str:
        return f"drain of {self.node_id} ({self.state})"

    # --- transitions: the declared graph; the services claim with nodepool.fsm.move ------------------
    @transition(field=state, source=DrainState.ACTIVE, target=DrainState.COMPLETED)
    def complete(self):
        """Every lease ended and the node no longer reports any (claimed by maintenance.drains)."""

    @transition(field=state, source=DrainState.ACTIVE, target=DrainState.FORCED)
    def force(self):
        """The deadline passed: what is left is revoked. The claim's condition is
        ``deadline <= now`` (the service's clock, not this process's)."""

    @transition(field=state, source=DrainState.ACTIVE, target=DrainState.CANCELLED)
    def cancel(self):
        """An operator cancelled it: the node goes back to ready, the drain's hold is removed."""

    @transition(field=state, source=DrainState.ACTIVE, target=DrainState.ABORTED)
    def abort(self):
        """The node is being quarantined or retired."""


class Eviction(models.Model):
    """A disruption a drain caused to one lease; the disruption-budget accounting counts these."""

    drain = models.ForeignKey(Drain, on_delete=models.CASCADE, related_name="evictions")
    lease = models.ForeignKey("leases.Lease", on_delete=models.CASCADE, related_name="evictions")
    workload_id = models.CharField(max_length=200)
    group = models.CharField(max_length=200, blank=True)
    fencing_token = models.PositiveBigIntegerField()
    kind = models.CharField(max_length=16, choices=EvictionKind.choices)
    created_at = models.DateTimeField(default=timezone.now)
    # Set when a cancelled drain withdraws a checkpoint request: the lease stops counting as disrupted.
    withdrawn_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["group", "created_at"], name="eviction_group_recent")]

    def __str__(self) -> str:
        return f"{self.kind} {self.workload_id}#{self.fencing_token}"


class DisruptionBudget(models.Model):
    """How many leases of one workload ``group`` drains may disrupt at once.

    Exactly one of ``max_unavailable`` / ``min_available`` is set, as in Kubernetes'
    PodDisruptionBudget. A lease evicted by a drain counts as unavailable until its workload holds
    a newer live lease or ``replacement_grace`` seconds have passed (we do not know a group's
    desired size, so a workload that is never placed again stops counting after the grace).
    """

    group = models.CharField(max_length=200, unique=True)
    description = models.TextField(blank=True)
    max_unavailable = models.PositiveIntegerField(null=True, blank=True)
    min_available = models.PositiveIntegerField(null=True, blank=True)
    replacement_grace = models.PositiveIntegerField(default=300, help_text="Seconds an eviction counts if unplaced.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    version = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["group"]
        constraints = [
            models.CheckConstraint(
                condition=(Q(max_unavailable__isnull=False) & Q(min_available__isnull=True))
                | (Q(max_unavailable__isnull=True) & Q(min_available__isnull=False)),
                name="disruptionbudget_exactly_one_limit",
            )
        ]

    def __str__(self) -> str:
        if self.max_unavailable is not None:
            return f"{self.group}: max_unavailable={self.max_unavailable}"
        return f"{self.group}: min_available={self.min_available}"


class Quarantine(models.Model):
    """One quarantine of one node: the rule (or operator), the reason and the evidence.

    Owners of the node can read it, so that a contributor sees why their machine was cut off.
    """

    node = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="quarantines")
    rule = models.CharField(max_length=32, choices=QuarantineRule.choices, default=QuarantineRule.MANUAL)
    reason = models.TextField()
    evidence = models.JSONField(default=dict, blank=True)
    from_state = models.CharField(max_length=16)
    actor_type = models.CharField(max_length=8, choices=ActorType.choices)
    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_name = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    credentials_revoked = models.PositiveIntegerField(default=0)
    leases_revoked = models.PositiveIntegerField(default=0)
    released_at = models.DateTimeField(null=True, blank=True)
    released_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    released_by_name = models.CharField(max_length=150, blank=True)
    release_reason = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["node"], condition=Q(released_at__isnull=True), name="quarantine_one_open_per_node"
            )
        ]

    def __str__(self) -> str:
        return f"quarantine of {self.node_id} ({self.rule})"

    @property
    def is_open(self) -> bool:
        return self.released_at is None
