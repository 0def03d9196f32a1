"""Leases' event types (fleet.event_types explains the registry): stored values never change."""

from fleet.event_types import declare

LEASE = declare("lease", "lease")
CHECKPOINT = declare("checkpoint", "checkpoint requested or taken")
