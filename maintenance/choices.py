from django.db import models


class EvictionPolicy(models.TextChoices):
    """How a drain moves work off its node before the deadline."""

    WAIT = "wait", "wait for leases to finish"
    CHECKPOINT = "checkpoint", "ask the workload to checkpoint and relocate"
    TERMINATE = "terminate", "terminate (revoke) leases now"


class DrainState(models.TextChoices):
    ACTIVE = "active", "active"
    COMPLETED = "completed", "completed (every lease ended and unreported)"
    FORCED = "forced", "completed as forced at the deadline"
    CANCELLED = "cancelled", "cancelled (node back to ready, the drain's hold removed)"
    ABORTED = "aborted", "aborted (node quarantined or retired)"


DRAIN_FINAL_STATES = (DrainState.COMPLETED, DrainState.FORCED, DrainState.CANCELLED, DrainState.ABORTED)


class EvictionKind(models.TextChoices):
    CHECKPOINT = "checkpoint", "checkpoint requested"
    TERMINATE = "terminate", "revoked by policy"
    DEADLINE = "deadline", "revoked at the deadline"


class WaitingOn(models.TextChoices):
    """Why an active drain has not completed yet (stable codes shown in its progress)."""

    LEASES_RUNNING = "leases_running", "leases still running (wait policy)"
    CHECKPOINT_PENDING = "checkpoint_pending", "workloads asked to checkpoint have not reported it yet"
    DISRUPTION_BUDGET = "disruption_budget", "a disruption budget allows no more evictions now"
    NODE_STILL_REPORTING = "node_still_reporting", "the node still reports leases that have ended"
    NO_HEARTBEAT_SINCE_END = "no_heartbeat_since_end", "no heartbeat since the last lease ended"


class QuarantineRule(models.TextChoices):
    """Automatic quarantine rules; ``manual`` is an operator's decision."""

    MANUAL = "manual", "operator"
    IMPOSSIBLE_USAGE = "impossible_usage", "usage reported above capacity"
    AGENT_VERSION = "agent_version_not_allowed", "agent version outside the pool's allowed set"
    ATTESTATION_FAILED = "attestation_failed", "attestation failed"
    INTEGRITY_FAILED = "integrity_check_failed", "integrity check failed"
    CAPACITY_ABOVE_VERIFIED = "capacity_above_verified", "declared capacity far above verified"
    DEVICE_IDENTITY_CONFLICT = "device_identity_conflict", "a device id another live node holds"
