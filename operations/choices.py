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
