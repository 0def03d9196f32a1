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
# How a revocation for a device fault (leases.device_faults) begins its reason: leases.reliability
# counts such a revocation against the node's reliability record.
DEVICE_FAULT_REVOKE_PREFIX = "device fault: "


class WorkloadState(models.TextChoices):
    """Job states a node reports through ``/node-leases/{id}/events``."""

    RUNNING = "running", "running"
    CHECKPOINTED = "checkpointed", "checkpointed"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    # Set by the control plane, never reported: the lease ended (revoked, lost, expired, released)
    # while the node last said "running", and a node cannot report on an ended lease. Kubernetes
    # shows a pod on a lost node the same way (phase Unknown).
    UNKNOWN = "unknown", "unknown (the lease ended while the workload was reported running)"


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
    TOO_LARGE = "too_large", "no node (nor node template) in the pool could ever hold the request"


class EvidenceClose(models.TextChoices):
    """Why an evidence interval closed; the gap after it carries the same reason (docs/marketplace.md)."""

    NOT_REPORTED = "not_reported", "a status report omitted the lease"
    STALE_INCARNATION = "stale_incarnation", "the node restarted (new incarnation)"
    TOKEN_MISMATCH = "token_mismatch", "the node listed the lease with another fencing token"
    SILENCE = "silence", "nothing heard from the node for longer than the pool's grace"
    LEASE_ENDED = "lease_ended", "the lease ended"


class CheckpointState(models.TextChoices):
    REQUESTED = "requested", "requested (waiting for the workload)"
    TAKEN = "taken", "taken (the node reported checkpointed)"
    WITHDRAWN = "withdrawn", "withdrawn (the lease ended first)"


# The words of a device request (leases.device_requests parses them): a constraint's attribute →
# its fleet.Device column, and the columns a request may ask its devices to share. Here, below
# both, because leases.sql.devices writes the same rules as SQL over those columns.
NUMERIC_ATTRIBUTES = {"memory": "memory_bytes", "numa_node": "numa_node", "index": "index"}
TEXT_ATTRIBUTES = {
    "model": "model",
    "mig_profile": "mig_profile",
    "interconnect_group": "interconnect_group",
    "driver_version": "driver_version",
    "cuda_version": "cuda_version",
    "pci_bus_id": "pci_bus_id",
}
ATTRIBUTES = {**NUMERIC_ATTRIBUTES, **TEXT_ATTRIBUTES}
COLOCATE = ("interconnect_group", "numa_node")
