from django.apps import AppConfig


class MaintenanceConfig(AppConfig):
    name = "maintenance"

    def ready(self):
        from nodepool.metrics import register_collector

        from . import (
            collectors,
            errors,  # noqa: F401  (declares the app's problem codes: the registry is complete)
            signals,  # noqa: F401  (pauses drain deadlines and holds across a clock gap)
        )

        register_collector("maintenance", collectors.collect)

        from fleet import signals as fleet_signals

        fleet_signals.status_report_applied.connect(evaluate_status_report, dispatch_uid="maintenance.rules")
        fleet_signals.device_identity_conflict.connect(quarantine_device_claimant, dispatch_uid="maintenance.devices")


def evaluate_status_report(sender, node, usage, agent_version, actor, **kwargs):
    """fleet.signals.status_report_applied: the automatic-quarantine rules (maintenance.rules)."""
    from . import rules  # looked up on each call (tests replace rules.evaluate_heartbeat)

    rules.evaluate_heartbeat(node, usage=usage, agent_version=agent_version, actor=actor)


def quarantine_device_claimant(sender, node, conflicts, actor, **kwargs):
    """fleet.signals.device_identity_conflict: quarantine the later claimant (maintenance.rules)."""
    from . import rules

    rules.device_identity_conflict(node, conflicts=conflicts, actor=actor)
