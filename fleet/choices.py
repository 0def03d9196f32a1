from django.db import models


class PoolKind(models.TextChoices):
    STANDARD = "standard", "standard"
    MARKETPLACE = "marketplace", "marketplace"


class AdmissionMode(models.TextChoices):
    MANUAL = "manual", "manual (an operator admits)"
    AUTOMATIC = "automatic", "automatic (on enrollment)"


class SchedulingPolicy(models.TextChoices):
    BINPACK = "binpack", "binpack (most allocated first)"
    SPREAD = "spread", "spread (least allocated first)"


class Lifecycle(models.TextChoices):
    """The administrative lifecycle: what the control plane intends for the node.

    There is no ``cordoned`` state: a cordon is a hold (fleet.models.NodeHold), a dimension of its
    own beside the lifecycle, like taints (fleet migration 0003 turned cordoned nodes into ready
    nodes with one hold each).
    """

    PENDING = "pending", "pending"
    ADMITTING = "admitting", "admitting"
    READY = "ready", "ready"
    REJECTED = "rejected", "rejected"
    DRAINING = "draining", "draining"
    MAINTENANCE = "maintenance", "maintenance"
    QUARANTINED = "quarantined", "quarantined"
    RETIRED = "retired", "retired"


class Liveness(models.TextChoices):
    """Computed by the control plane from its own receipt times only."""

    UNKNOWN = "unknown", "unknown (never heard)"
    ALIVE = "alive", "alive"
    STALE = "stale", "stale (missed heartbeats)"
    UNREACHABLE = "unreachable", "unreachable (past grace)"
    LOST = "lost", "lost (past loss threshold)"


class Readiness(models.TextChoices):
    """Readiness as shown (issue 33): the node's reported ``ready`` while its signals are current,
    ``unknown`` once it is unreachable, lost or never heard from (Kubernetes' ``Ready=Unknown``)."""

    READY = "ready", "ready"
    NOT_READY = "not_ready", "not ready"
    UNKNOWN = "unknown", "unknown (no current report)"


# Liveness states in which the node's last report no longer describes it: its readiness and health
# are shown as unknown (``stale`` is still within grace, as Kubernetes waits its grace period).
SIGNALS_UNKNOWN_LIVENESS = ("unknown", "unreachable", "lost")


class Health(models.TextChoices):
    """The control plane's judgement of reported conditions under the pool's policy."""

    UNKNOWN = "unknown", "unknown"
    HEALTHY = "healthy", "healthy"
    DEGRADED = "degraded", "degraded"
    UNHEALTHY = "unhealthy", "unhealthy"


class ActorType(models.TextChoices):
    USER = "user", "user"
    NODE = "node", "node"
    SYSTEM = "system", "system task"


class CheckStatus(models.TextChoices):
    PENDING = "pending", "pending"
    PASSED = "passed", "passed"
    FAILED = "failed", "failed"
    SKIPPED = "skipped", "skipped"


class BenchmarkStatus(models.TextChoices):
    REQUESTED = "requested", "requested"
    COMPLETED = "completed", "completed"
    TIMED_OUT = "timed_out", "timed out"


# Event types are not here: each app declares its own (fleet.event_types).


class DeviceHealth(models.TextChoices):
    """A device's health as the control plane judges its reports (never the node's health)."""

    UNKNOWN = "unknown", "unknown (no health reported)"
    HEALTHY = "healthy", "healthy"
    UNHEALTHY = "unhealthy", "unhealthy (a fault taints it)"
    MISSING = "missing", "missing (no longer reported by the node)"


class ReverificationState(models.TextChoices):
    """A scheduled re-verification run (fleet.reverification): ``scheduled`` (its due time drawn,
    never shown to the node) → ``running`` (claimed by a sweep; a benchmark asked for) →
    ``passed`` | ``failed``; ``cancelled`` when the node left service or the pool turned its
    schedule off before it ran."""

    SCHEDULED = "scheduled", "scheduled"
    RUNNING = "running", "running"
    PASSED = "passed", "passed"
    FAILED = "failed", "failed (deverified)"
    CANCELLED = "cancelled", "cancelled"


class ReverificationBusyPolicy(models.TextChoices):
    """What a re-verification does on a node with live leases (fleet.reverification)."""

    FREE = "free", "measure only what is free (allocatable − allocated)"
    IDLE = "idle", "wait until the node has no live leases"
    FULL = "full", "measure the whole machine even while busy"


class LeaseOutcome(models.TextChoices):
    """How a lease ended, as the node's reliability record counts it (fleet.reliability, docs/fleet.md
    "Reliability"). ``completed`` counts for the node; every other value is a loss through the
    node's fault. Leases that ended for other reasons (expired, revoked by an operator, a drain,
    preemption) are not counted at all."""

    COMPLETED = "completed", "completed (released by its client)"
    LOST_UNREACHABLE = "lost_unreachable", "lost while the node was unreachable or lost"
    LOST_UNREPORTED = "lost_unreported", "lost: the live node stopped reporting it"
    LOST_ON_RESTART = "lost_on_restart", "lost: the node restarted and no longer ran it"
    FAILED_AFTER_RESTART = "failed_after_restart", "failed right after an unplanned restart of the node"
    REVOKED_DEVICE_FAULT = "revoked_device_fault", "revoked by a fault of a device it held"
    REVOKED_QUARANTINE = "revoked_quarantine", "revoked because the node was quarantined"


NODE_FAULT_OUTCOMES = tuple(o for o in LeaseOutcome if o != LeaseOutcome.COMPLETED)
