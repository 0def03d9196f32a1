"""Maintenance's event types (fleet.event_types explains the registry): stored values never change."""

from fleet.event_types import declare

DRAIN = declare("drain", "drain")
QUARANTINE = declare("quarantine", "quarantine")
HOLD = declare("hold", "cordon hold placed or removed")
