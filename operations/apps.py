from django.apps import AppConfig


class OperationsConfig(AppConfig):
    """Pool operations: rolling upgrades, autoscaling through providers, spot preemptions.

    Sits above maintenance (docs/foundation.md, "Which way dependencies point"); it plugs into the lower apps through
    the hooks they declare: an admission check, fleet's ``status_report_applied`` signal (whose
    answer carries the upgrade instruction) and leases' ``lease_ended`` signal.
    """

    name = "operations"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from fleet import admission
        from fleet import signals as fleet_signals
        from leases import impossible
        from leases.signals import lease_ended
        from nodepool.metrics import register_collector

        from . import (
            capacity,
            errors,  # noqa: F401  (declares the app's problem codes: the registry is complete)
            preemption,
            targets,
            upgrades,
        )
        from .metrics import OperationsCollector

        admission.register_check(
            targets.CHECK_NAME, targets.check_upgrade_target, applies=lambda pool: bool(targets.pool_target(pool))
        )
        fleet_signals.status_report_applied.connect(
            upgrades.upgrade_instruction_for_report, dispatch_uid="operations.upgrade_instruction"
        )
        lease_ended.connect(preemption.requeue_evicted_lease, dispatch_uid="operations.requeue_evicted_lease")
        register_collector("operations", OperationsCollector().collect)
        # A request no node holds is still placeable if the autoscaler's template would hold it.
        impossible.register_growth_source("operations.node_template", capacity.template_shapes)
