"""Leases: shapes, fencing sequences, leases and queued lease requests."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q

from .choices import LIVE_LEASE_STATES, LeaseRequestState, LeaseState, WorkloadState


class Shape(models.Model):
    """A named, versioned request shape (``large`` v3 = 8 CPU, 32Gi).

    ``resources`` is ``{resource: canonical int}`` (cpu millicores, bytes, counts). A new
    definition is a new row with a higher ``version``; leases record the version they used.
    """

    name = models.SlugField(max_length=63)
    version = models.PositiveIntegerField()
    resources = models.JSONField(default=dict)
    features = models.JSONField(default=dict, blank=True)
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


class Lease(models.Model):
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
    state = models.CharField(max_length=16, choices=LeaseState.choices, default=LeaseState.GRANTED)
    workload_state = models.CharField(max_length=16, choices=WorkloadState.choices, blank=True)
    resources = models.JSONField(default=dict)
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

    @property
    def is_live(self) -> bool:
        return self.state in LIVE_LEASE_STATES


class LeaseRequest(models.Model):
    """A placement request that could not be placed at once and waits (``queue: true``)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    workload_id = models.CharField(max_length=200)
    pool = models.ForeignKey("fleet.Pool", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    spec = models.JSONField(default=dict)
    priority = models.IntegerField(default=0)
    state = models.CharField(max_length=16, choices=LeaseRequestState.choices, default=LeaseRequestState.PENDING)
    reasons = models.JSONField(default=dict, blank=True)
    lease = models.OneToOneField(Lease, null=True, blank=True, on_delete=models.SET_NULL, related_name="request")
    client = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    idempotency_key = models.CharField(max_length=200, blank=True)
    request_hash = models.CharField(max_length=64, blank=True)
    message = models.TextField(blank=True, help_text="The latest '0/N nodes are available' explanation.")
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
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
