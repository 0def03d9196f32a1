from django.db import models


class UpgradeState(models.TextChoices):
    """The upgrade workflow (django-fsm): pending → canary → rolling ⇄ paused → completed;
    rolling_back → rolled_back; aborted and failed from any active state."""

    PENDING = "pending", "pending (not started)"
    CANARY = "canary", "canary (first nodes, then soak)"
    ROLLING = "rolling", "rolling"
    PAUSED = "paused", "paused"
    COMPLETED = "completed", "completed"
    ROLLING_BACK = "rolling_back", "rolling back to the previous target"
    ROLLED_BACK = "rolled_back", "rolled back"
    ABORTED = "aborted", "aborted by an operator"
    FAILED = "failed", "failed"


ACTIVE_UPGRADE_STATES = (
    UpgradeState.PENDING,
    UpgradeState.CANARY,
    UpgradeState.ROLLING,
    UpgradeState.PAUSED,
    UpgradeState.ROLLING_BACK,
)
# States in which the workflow's tick moves nodes (paused and pending wait for an operator).
MOVING_UPGRADE_STATES = (UpgradeState.CANARY, UpgradeState.ROLLING, UpgradeState.ROLLING_BACK)


class PauseCause(models.TextChoices):
    """Why an upgrade is paused (an operator, or the workflow by itself)."""

    OPERATOR = "operator", "paused by an operator"
    CANARY_FAILED = "canary_failed", "the canary failed (auto_rollback off)"
    FAILURES = "failures", "failed nodes reached failure_threshold"
    READY_RATIO = "ready_ratio", "the pool's Ready SLI fell below its objective"


class CanaryOverride(models.TextChoices):
    """What resuming an upgrade paused by its canary does (an explicit choice, with a reason)."""

    RETRY = "retry_canary", "retry the canary on the same nodes"
    RETRY_OTHER_NODES = "retry_canary_on_other_nodes", "retry the canary on the next nodes of the roll"
    SKIP = "skip_canary", "skip the canary and roll on"


class UpgradePhase(models.TextChoices):
    CANARY = "canary", "canary"
    ROLL = "roll", "roll"
    ROLLBACK = "rollback", "rollback"


class UpgradeNodeState(models.TextChoices):
    """One node's way through an upgrade (or its rollback)."""

    WAITING = "waiting", "waiting for its turn"
    DRAINING = "draining", "cordoned and draining"
    UPGRADING = "upgrading", "drained; told to upgrade, waiting for its restart"
    ADMITTING = "admitting", "restarted; admission verifying the target"
    DONE = "done", "admitted at the target"
    FAILED = "failed", "failed (admission refused the target, or a timeout)"
    SKIPPED = "skipped", "skipped (the upgrade ended before its turn)"


NODE_IN_PROGRESS = (UpgradeNodeState.DRAINING, UpgradeNodeState.UPGRADING, UpgradeNodeState.ADMITTING)


class ProviderKind(models.TextChoices):
    NONE = "", "none (no autoscaling)"
    SIMULATED = "simulated", "simulated (starts simulator nodes)"
    WEBHOOK = "webhook", "webhook (signed scale requests to an operator's URL)"


class MachineState(models.TextChoices):
    """A machine the provider was asked for, from request to deletion."""

    REQUESTED = "requested", "requested from the provider"
    ENROLLED = "enrolled", "enrolled (node exists, not ready yet)"
    READY = "ready", "ready"
    DRAINING = "draining", "being removed (cordoned and draining)"
    DELETING = "deleting", "claimed for removal; the provider is being asked to delete it"
    DELETED = "deleted", "deleted by the provider"
    FAILED = "failed", "failed (provider error or boot timeout); cleaned up"


LIVE_MACHINE_STATES = (MachineState.REQUESTED, MachineState.ENROLLED, MachineState.READY)


class ScaleDirection(models.TextChoices):
    UP = "up", "scale up"
    DOWN = "down", "scale down"
    NONE = "none", "no change"


class ScaleOutcome(models.TextChoices):
    REQUESTED = "requested", "requested from the provider"
    SUCCEEDED = "succeeded", "the provider accepted"
    FAILED = "failed", "the provider failed (cleaned up)"
    BLOCKED = "blocked", "wanted but held back (bound, cool-down, budget)"


class PreemptionSource(models.TextChoices):
    AGENT = "agent", "the node's agent"
    PROVIDER = "provider", "the provider"
    SIMULATOR = "simulator", "the simulator (injected)"
    OPERATOR = "operator", "an operator"


class PreemptionState(models.TextChoices):
    DRAINING = "draining", "draining before the deadline"
    DRAINED = "drained", "drained (node in maintenance or retired)"


class DisruptionReason(models.TextChoices):
    """Why automation wants to take a node out (Karpenter's disruption reasons, ours by name).

    Pool disruption budgets (``PoolOperations.disruption_budgets``) limit every reason but
    ``preemption``: a spot notice is forced (the machine goes away whatever we decide) and is
    exempt, as in Karpenter, but its node counts as disrupting while it drains.
    """

    UPGRADE = "upgrade", "rolling upgrade"
    DRIFT = "drift", "drift replacement"
    EXPIRY = "expiry", "expiry replacement"
    REPAIR = "repair", "automated repair"
    SCALE_DOWN = "scale_down", "scale-down of an idle node"
    CONSOLIDATION = "consolidation", "consolidation"
    PREEMPTION = "preemption", "spot preemption (forced, exempt from pool budgets)"
    MAINTENANCE = "maintenance", "an operator's bulk drain by selector"


# The reasons a pool disruption budget may name (everything automation decides on its own).
BUDGETED_REASONS = tuple(r for r in DisruptionReason.values if r != DisruptionReason.PREEMPTION)


class ReplacementState(models.TextChoices):
    """A node's replacement for drift or expiry (operations.replacement), Karpenter's disruption
    flow: cordon through the gate, a replacement ready first where the pool autoscales, then drain."""

    PENDING = "pending", "wanted; waiting for the gate (budget, window) or its turn"
    LAUNCHING = "launching", "cordoned; a replacement machine is on its way"
    DRAINING = "draining", "cordoned and draining"
    REPLACED = "replaced", "replaced (machine deleted, or the node re-admitted at the pool's shape)"
    CANCELLED = "cancelled", "no longer needed (the node matches again, left the pool or was retired)"
    FAILED = "failed", "failed (re-admission refused the node, or the drain ended otherwise)"


ACTIVE_REPLACEMENT_STATES = (ReplacementState.PENDING, ReplacementState.LAUNCHING, ReplacementState.DRAINING)
REPLACEMENT_REASONS = ("drift", "expiry", "repair")


class RepairAction(models.TextChoices):
    """What a pool's repair rule does to a node whose condition held too long (operations.repair)."""

    REBOOT = "reboot", "reboot (the agent runs its operator-configured reboot command)"
    REPLACE = "replace", "replace through the pool's provider"
    QUARANTINE = "quarantine", "quarantine (revokes the credential: a person must release it)"


class RepairState(models.TextChoices):
    """One automated repair of one node (django-fsm-2, ``Repair.state``)::

    pending ──drained──▶ rebooting ──new boot──▶ verifying ──healthy──▶ succeeded
       │                                           └──still failing──▶ escalated
       ├──drained──▶ replacing ──machine removed──▶ succeeded
       ├──quarantined────────────────────────────▶ succeeded
       └──(node gone, drain cancelled, timeout)──▶ failed
    """

    PENDING = "pending", "claimed; cordoned and draining through the gate"
    REBOOTING = "rebooting", "drained; the agent was told to reboot"
    VERIFYING = "verifying", "rebooted; waiting for its health checks to pass"
    REPLACING = "replacing", "drained; a replacement asked of the provider, the node being removed"
    SUCCEEDED = "succeeded", "succeeded"
    ESCALATED = "escalated", "escalated (still failing after a reboot: a stronger action follows)"
    FAILED = "failed", "failed"


ACTIVE_REPAIR_STATES = (RepairState.PENDING, RepairState.REBOOTING, RepairState.VERIFYING, RepairState.REPLACING)
