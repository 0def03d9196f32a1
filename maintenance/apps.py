from django.apps import AppConfig


class MaintenanceConfig(AppConfig):
    name = "maintenance"

    def ready(self):
        # Here, not at the head: an AppConfig module is imported before the app registry is ready,
        # and these modules import models.
        from nodepool.metrics import register_collector

        # The app's modules that register something when imported (see each line).
        from . import (
            collectors,
            errors,  # noqa: F401  (declares the app's problem codes: the registry is complete)
            event_types,  # noqa: F401  (declares the app's event types)
            signals,  # noqa: F401  (pauses drain deadlines and holds across a clock gap)
            tasks,  # noqa: F401  (registers the tasks maintenance.drains enqueues by name)
        )

        register_collector("maintenance", collectors.collect)

        # fleet's registries (imported in ready(): they import fleet's models).
        from fleet import signals as fleet_signals
        from fleet.instructions import register_status_report_handler  # (same reason)

        # After leases reconciled the report (fleet.instructions' table of orders).
        register_status_report_handler("maintenance.rules", evaluate_status_report, order=200)
        fleet_signals.device_identity_conflict.connect(quarantine_device_claimant, dispatch_uid="maintenance.devices")
        fleet_signals.devices_above_verified.connect(
            quarantine_devices_above_verified, dispatch_uid="maintenance.devices_above_verified"
        )


def evaluate_status_report(sender, node, usage, agent_version, actor, **kwargs):
    """A status-report handler (fleet.instructions): the automatic-quarantine rules (maintenance.rules)."""
    from . import rules  # looked up on each call (tests replace rules.evaluate_heartbeat)

    rules.evaluate_heartbeat(node, usage=usage, agent_version=agent_version, actor=actor)


def quarantine_device_claimant(sender, node, conflicts, actor, **kwargs):
    """fleet.signals.device_identity_conflict: quarantine the later claimant (maintenance.rules)."""
    from . import rules  # looked up on each call, like evaluate_status_report's (and rules imports models)

    rules.device_identity_conflict(node, conflicts=conflicts, actor=actor)


def quarantine_devices_above_verified(sender, node, over, actor, **kwargs):
    """fleet.signals.devices_above_verified: more devices than verified fall under the
    ``capacity_above_verified`` rule (declared above verified × the factor; maintenance.rules)."""
    from . import rules  # looked up on each call, like evaluate_status_report's (and rules imports models)

    rules.evaluate_declared_capacity(
        node,
        declared={kind: item["declared"] for kind, item in over.items()},
        verified={kind: item["verified"] for kind, item in over.items()},
        actor=actor,
    )
