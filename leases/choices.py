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
