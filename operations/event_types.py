"""Operations' event types (fleet.event_types explains the registry): stored values never change."""

from fleet.event_types import declare

UPGRADE = declare("upgrade", "upgrade step")
SCALE = declare("scale", "autoscaling decision")
PREEMPTION = declare("preemption", "preemption notice")
DISRUPTION_BLOCKED = declare(
    "disruption_blocked", "automated disruption blocked (pool budget, window, workload budget)"
)
REPLACEMENT = declare("replacement", "node replacement for drift or expiry (operations.replacement)")
DRIFT = declare("drift", "node drifted from its pool's shape, or back at it (operations.drift)")
REPAIR = declare("repair", "automated repair step (started, rebooted, verified, escalated, succeeded, failed)")
REPAIR_BREAKER = declare("repair_breaker", "repair safety breaker opened or closed (too much of the pool unhealthy)")
