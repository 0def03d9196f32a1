"""Leases: shapes, fencing sequences, leases and queued lease requests.

Lease, LeaseRequest and LeaseCheckpoint are state machines on django-fsm-2 (issue 28, step 6): the
transitions below are the graph (docs/state-machines.md is generated from them). The services
move rows with set-based claims built from these declarations (``nodepool.fsm.move``), so a
statement cannot allow a move the graph does not; the methods themselves change nothing in the
database.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone
from django_fsm import FSMField, transition

from nodepool.fsm import SerializedFSMRefresh

from .choices import LIVE_LEASE_STATES, CheckpointState, EvidenceClose, LeaseRequestState, LeaseState, WorkloadState


class Shape(models.Model):
    """A named, versioned request shape (``large`` v3 = 8 CPU, 32Gi).

    ``resources`` is ``{resource: canonical int}`` (cpu millicores, bytes, counts). A new
    definition is a new row with a higher ``version``; leases record the version they used.
    """

    name = models.SlugField(max_length=63)
    version = models.PositiveIntegerField()
    resources = models.JSONField(default=dict)
    features = models.JSONField(default=dict, blank=True)
    # Device requests (leases.device_requests), as validated: [{"type", "count", "constraints", "colocate"}].
    devices = models.JSONField(default=list, blank=True)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name", "-version"]
        constraints = [models.UniqueConstraint(fields=["name", "version"], name="shape_unique_version")]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"


class FencingSequence(models.Model):
    """The last fencing token issued for one workload; tokens increase strictly per workload."""

    workload_id = models.CharField(max_length=200, primary_key=True)
    last_token = models.PositiveBigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.workload_id}@{self.last_token}"


class Lease(SerializedFSMRefresh, models.Model):
    """The right of one workload to run on one node, fenced by ``fencing_token``.

    ``resources`` is ``{resource: canonical int}``, added to the node's ``NodeResource.allocated``
    in the same transaction that grants the lease and subtracted when it ends.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    workload_id = models.CharField(max_length=200)
    fencing_token = models.PositiveBigIntegerField()
    node = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="leases")
    node_incarnation = models.PositiveBigIntegerField()
    pool = models.ForeignKey("fleet.Pool", on_delete=models.PROTECT, related_name="leases")
    state = FSMField(max_length=16, choices=LeaseState.choices, default=LeaseState.GRANTED, protected=True)
    workload_state = models.CharField(max_length=16, choices=WorkloadState.choices, blank=True)
    resources = models.JSONField(default=dict)
    # The devices the grant assigned, in order: [{"id", "type", "index"}] (a copy of its live
    # LeaseDevice rows, which are the guard; read by the API and the agent without a join).
    devices = models.JSONField(default=list, blank=True)
    shape = models.ForeignKey(Shape, null=True, blank=True, on_delete=models.PROTECT, related_name="leases")
    shape_version = models.PositiveIntegerField(null=True, blank=True)
    group = models.CharField(max_length=200, blank=True, help_text="Spread / anti-affinity / disruption group.")
    priority = models.IntegerField(default=0)
    command = models.JSONField(default=list, blank=True, help_text="argv the agent runs, if any.")
    spec = models.JSONField(default=dict, blank=True, help_text="The placement request as accepted.")
    decision = models.JSONField(default=dict, blank=True, help_text="Why this node: policy version, score.")
    ttl_seconds = models.PositiveIntegerField()
    expires_at = models.DateTimeField()
    granted_at = models.DateTimeField()
    activated_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.TextField(blank=True)
    outcome = models.CharField(max_length=32, blank=True)
    checkpoint_requested_at = models.DateTimeField(null=True, blank=True)
    # Heartbeats in a row in which the node did not report this live lease (reconciliation).
    missed_reports = models.PositiveIntegerField(default=0)
    last_reported_at = models.DateTimeField(null=True, blank=True)
    client = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="leases"
    )
    idempotency_key = models.CharField(max_length=200, blank=True)
    # sha256 of the request body: a retry under the same Idempotency-Key must carry the same body.
    request_hash = models.CharField(max_length=64, blank=True)
    # Set when the control plane requeued this lease's work (preemption, scale-down, upgrade drain)
    # and the work now runs under a newer lease with a larger fencing token (docs/pool-operations.md).
    superseded_by = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="supersedes"
    )
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["-granted_at"]
        constraints = [
            # No workload ever has two live leases.
            models.UniqueConstraint(
                fields=["workload_id"], condition=Q(state__in=LIVE_LEASE_STATES), name="lease_one_live_per_workload"
            ),
            models.UniqueConstraint(fields=["workload_id", "fencing_token"], name="lease_unique_token"),
            models.UniqueConstraint(
                fields=["client", "idempotency_key"],
                condition=~Q(idempotency_key=""),
                name="lease_unique_idempotency_key",
            ),
        ]
        indexes = [
            models.Index(fields=["node", "state"], name="lease_node_state"),
            models.Index(fields=["expires_at"], name="lease_live_expiry", condition=Q(state__in=LIVE_LEASE_STATES)),
            models.Index(fields=["group", "state"], name="lease_group_state"),
        ]

    def __str__(self) -> str:
        return f"{self.workload_id}#{self.fencing_token} on {self.node_id} ({self.state})"

    # A lease is born granted (the grant's INSERT); the verbs below are every later move. Ending
    # moves run in leases.lifecycle.end_lease (``ENDINGS`` maps a terminal state to its verb).
    @transition(field=state, source=LeaseState.GRANTED, target=LeaseState.ACTIVE)
    def activate(self):
        """granted → active: the node reported the workload running."""

    @transition(field=state, source=LIVE_LEASE_STATES, target=LeaseState.RELEASED)
    def release(self):
        """live → released: the client (or the node, reporting succeeded/failed) ended it."""

    @transition(field=state, source=LIVE_LEASE_STATES, target=LeaseState.EXPIRED)
    def expire(self):
        """live → expired: its TTL passed without renewal (the expiry sweep)."""

    @transition(field=state, source=LIVE_LEASE_STATES, target=LeaseState.LOST)
    def lose(self):
        """live → lost: its node was lost, restarted without it, or stopped reporting it."""

    @transition(field=state, source=LIVE_LEASE_STATES, target=LeaseState.REVOKED)
    def revoke(self):
        """live → revoked: the control plane took it back (drain, quarantine, taint, operator)."""


# The verb that moves a live lease to each terminal state (leases.lifecycle.end_lease).
ENDINGS = {
    LeaseState.RELEASED: "release",
    LeaseState.EXPIRED: "expire",
    LeaseState.LOST: "lose",
    LeaseState.REVOKED: "revoke",
}


class LeaseDevice(models.Model):
    """One device a lease holds, written in the grant's transaction.

    ``live`` is true while the lease is live; ending the lease clears it in the same transaction
    that gives its capacity back. The partial unique index ``leasedevice_one_live_holder`` is the
    guard: the database refuses a second live row for one device, whoever writes it (PostgreSQL
    and SQLite alike). A whole GPU's grant also writes ``implied`` rows for the GPU's MIG
    instances, so a GPU and its MIG instances exclude each other through the same index (a MIG
    grant holds the instance's row, which the whole GPU's grant would need, and the other way
    round); MIG siblings of one GPU never share a row and can go to different leases.
    """

    lease = models.ForeignKey(Lease, on_delete=models.CASCADE, related_name="device_claims")
    device = models.ForeignKey("fleet.Device", on_delete=models.PROTECT, related_name="claims")
    implied = models.BooleanField(default=False, help_text="held because the lease holds its parent GPU")
    position = models.PositiveSmallIntegerField(default=0, help_text="order in the lease's device list")
    live = models.BooleanField(default=True)

    class Meta:
        ordering = ["lease", "position"]
        constraints = [
            # Two live leases never hold the same device.
            models.UniqueConstraint(fields=["device"], condition=Q(live=True), name="leasedevice_one_live_holder"),
        ]

    def __str__(self) -> str:
        return f"{self.device_id} for {self.lease_id}"


class LeaseRequest(SerializedFSMRefresh, models.Model):
    """A placement request that could not be placed at once and waits (``queue: true``)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    workload_id = models.CharField(max_length=200)
    pool = models.ForeignKey("fleet.Pool", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    spec = models.JSONField(default=dict)
    priority = models.IntegerField(default=0)
    state = FSMField(
        max_length=16, choices=LeaseRequestState.choices, default=LeaseRequestState.PENDING, protected=True
    )
    reasons = models.JSONField(default=dict, blank=True)
    lease = models.OneToOneField(Lease, null=True, blank=True, on_delete=models.SET_NULL, related_name="request")
    client = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    idempotency_key = models.CharField(max_length=200, blank=True)
    request_hash = models.CharField(max_length=64, blank=True)
    # The lease whose work this request carries on, when the control plane created it on behalf of
    # the lease's client (a requeue); empty for requests a client sent itself.
    requeued_from = models.ForeignKey(Lease, null=True, blank=True, on_delete=models.SET_NULL, related_name="requeues")
    message = models.TextField(blank=True, help_text="The latest '0/N nodes are available' explanation.")
    attempts = models.PositiveIntegerField(default=0)
    # Not auto_now_add (which overrides any value given): the services create a request with the
    # instant they judged it by (``now``), so a queued request's first attempt (last_attempt_at)
    # and its creation are the same instant, never its attempt a few ms before its creation.
    created_at = models.DateTimeField(default=timezone.now, editable=False, blank=True)
    placed_at = models.DateTimeField(null=True, blank=True)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["-priority", "created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["client", "idempotency_key"],
                condition=~Q(idempotency_key=""),
                name="leaserequest_unique_idempotency_key",
            ),
        ]
        indexes = [models.Index(fields=["state", "-priority", "created_at"], name="leaserequest_queue")]

    def __str__(self) -> str:
        return f"{self.workload_id} ({self.state})"

    @transition(field=state, source=LeaseRequestState.PENDING, target=LeaseRequestState.PLACED)
    def place(self):
        """pending → placed: a grant took it (claimed in the grant's transaction)."""

    @transition(field=state, source=LeaseRequestState.PENDING, target=LeaseRequestState.CANCELLED)
    def cancel(self):
        """pending → cancelled: its client cancelled it, a grant of the workload superseded a
        requeue, or its spec no longer validates."""

    @property
    def pending_seconds(self) -> float | None:
        end = self.placed_at
        return (end - self.created_at).total_seconds() if end else None


class ConsistencyReport(models.Model):
    """One run of the capacity consistency check: ``NodeResource.allocated`` against the sum of
    live leases. ``drift`` is ``[{"node_id", "resource", "allocated", "leased"}]``; empty = in step."""

    checked_at = models.DateTimeField(auto_now_add=True, db_index=True)
    nodes_checked = models.PositiveIntegerField(default=0)
    drift = models.JSONField(default=list, blank=True)
    repaired = models.BooleanField(default=False)

    class Meta:
        ordering = ["-checked_at"]

    def __str__(self) -> str:
        return f"{self.checked_at:%Y-%m-%d %H:%M:%S}: {len(self.drift)} drift(s)"


class EvidenceInterval(models.Model):
    """A period in which the node listed the lease as running, with its fencing token, in its
    current incarnation (execution evidence; billable time is the sum of these).

    Opened by the first status report listing the lease, extended by each later one (and by
    renewals of the same incarnation), closed by the events in :class:`EvidenceClose`. The
    evidenced span is ``[started_at, last_seen_at]``; ``closed_at`` marks when the control plane
    decided it was over. ``usage_max`` is the largest node-reported usage per resource (canonical
    units) seen while it was open: reconciliation compares it with the allocation. ``devices`` are
    the lease's devices with their health while it was open (marketplace reconciliation flags a
    usage whose device was unhealthy for review).
    """

    lease = models.ForeignKey(Lease, on_delete=models.CASCADE, related_name="evidence_intervals")
    node = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="+")
    node_incarnation = models.PositiveBigIntegerField()
    fencing_token = models.PositiveBigIntegerField()
    started_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    closed_at = models.DateTimeField(null=True, blank=True)
    close_reason = models.CharField(max_length=24, choices=EvidenceClose.choices, blank=True)
    status_reports = models.PositiveIntegerField(default=1)
    renewals = models.PositiveIntegerField(default=0)
    usage_max = models.JSONField(default=dict, blank=True)
    # The lease's devices and their health while the interval was open (KEP-4680 in spirit):
    # [{"id", "type", "model", "health", "worst", "faulted_at"?}]; ``health`` as last reported,
    # ``worst`` the worst seen (leases.evidence.HEALTH_RANK), ``faulted_at`` the device's last fault
    # since the lease's grant.
    devices = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["started_at", "id"]
        constraints = [
            # At most one open interval per lease: two racing reconciliations cannot open two.
            models.UniqueConstraint(
                fields=["lease"], condition=Q(closed_at__isnull=True), name="evidence_one_open_per_lease"
            ),
        ]
        indexes = [
            # Each status report reads its node's open intervals.
            models.Index(fields=["node"], name="evidence_open_by_node", condition=Q(closed_at__isnull=True)),
        ]

    def __str__(self) -> str:
        return f"{self.lease_id}: {self.started_at:%H:%M:%S}–{self.last_seen_at:%H:%M:%S}"

    @property
    def seconds(self) -> float:
        return max(0.0, (self.last_seen_at - self.started_at).total_seconds())


class LeaseCheckpoint(SerializedFSMRefresh, models.Model):
    """One checkpoint of one lease: requested (by a drain, an operator, a client) and/or taken
    (the node reported ``checkpointed``). A checkpoint the workload took unasked is a row with
    ``requested_at`` empty."""

    lease = models.ForeignKey(Lease, on_delete=models.CASCADE, related_name="checkpoints")
    state = FSMField(max_length=16, choices=CheckpointState.choices, default=CheckpointState.REQUESTED, protected=True)
    fencing_token = models.PositiveBigIntegerField()
    node_incarnation = models.PositiveBigIntegerField()
    requested_at = models.DateTimeField(null=True, blank=True)
    requested_by = models.CharField(max_length=150, blank=True)
    taken_at = models.DateTimeField(null=True, blank=True)
    message = models.TextField(blank=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(
                fields=["lease"], condition=Q(state="requested"), name="checkpoint_one_pending_per_lease"
            ),
        ]

    def __str__(self) -> str:
        return f"checkpoint of {self.lease_id} ({self.state})"

    # A checkpoint the workload took unasked is created taken; the verbs move a requested one.
    @transition(field=state, source=CheckpointState.REQUESTED, target=CheckpointState.TAKEN)
    def take(self):
        """requested → taken: the node reported ``checkpointed``."""

    @transition(field=state, source=CheckpointState.REQUESTED, target=CheckpointState.WITHDRAWN)
    def withdraw(self):
        """requested → withdrawn: the lease ended first, or the drain that asked was cancelled."""
