from django.db import models


class LeaseState(models.TextChoices):
    GRANTED = "granted", "granted"
    ACTIVE = "active", "active"
    RELEASED = "released", "released"
    EXPIRED = "expired", "expired"
    LOST = "lost", "lost"
    REVOKED = "revoked", "revoked"


LIVE_LEASE_STATES = (LeaseState.GRANTED, LeaseState.ACTIVE)
TERMINAL_LEASE_STATES = (LeaseState.RELEASED, LeaseState.EXPIRED, LeaseState.LOST, LeaseState.REVOKED)


class WorkloadState(models.TextChoices):
    """Job states a node reports through ``/node-leases/{id}/events``."""

    RUNNING = "running", "running"
    CHECKPOINTED = "checkpointed", "checkpointed"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"


class LeaseRequestState(models.TextChoices):
    PENDING = "pending", "pending"
    PLACED = "placed", "placed"
    CANCELLED = "cancelled", "cancelled"
    EXPIRED = "expired", "expired"


class ReleaseOutcome(models.TextChoices):
    """Why a client released a lease (``/release``'s ``outcome``)."""

    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"
    PREEMPTED = "preempted", "preempted"
    UNKNOWN = "unknown", "unknown"


class SpreadMode(models.TextChoices):
    SPREAD = "spread", "spread (soft: prefer the emptiest topology domain)"
    ANTI_AFFINITY = "anti-affinity", "anti-affinity (hard: one per topology domain)"


class UnschedulableCause(models.TextChoices):
    """The headline of a 409 ``unschedulable``: told apart so a client knows whether to wait."""

    NO_NODES = "no_nodes", "the pool has no nodes"
    NO_READY_NODES = "no_ready_nodes", "no node in the pool is schedulable"
    INSUFFICIENT_CAPACITY = "insufficient_capacity", "not enough free capacity"
    FRAGMENTED = "fragmented", "enough free capacity in total, but no single node fits"
    CONSTRAINTS = "constraints", "no node satisfies the constraints"
