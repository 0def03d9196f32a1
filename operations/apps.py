from django.apps import AppConfig


class OperationsConfig(AppConfig):
    """Pool operations: rolling upgrades, autoscaling through providers, spot preemptions.

    Sits above maintenance (docs/foundation.md, "Which way dependencies point"); it plugs into the lower apps through
    the hooks they declare: an admission check, fleet's ordered status-report handlers (whose
    answer carries the upgrade instruction) and leases' ``lease_ended`` signal.
    """

    name = "operations"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # Django: the app registry must be ready before these modules (models, signals) load.
        from fleet import admission, health
        from fleet.instructions import register_status_report_handler  # app registry ready (see above)
        from leases import impossible, preview  # app registry ready (see above)
        from leases.signals import lease_ended  # app registry ready (see above)
        from nodepool.metrics import register_collector  # app registry ready (see above)

        from . import (  # app registry ready (see above)
            capacity,
            drift,
            errors,  # noqa: F401  (declares the app's problem codes: the registry is complete)
            event_types,  # noqa: F401  (declares the app's event types)
            preemption,
            repair,
            targets,
            tasks,  # noqa: F401  (registers the tasks the domain modules send by name)
            upgrades,
        )
        from .metrics import OperationsCollector  # app registry ready (see above)

        admission.register_check(
            targets.CHECK_NAME, targets.check_upgrade_target, applies=lambda pool: bool(targets.pool_target(pool))
        )
        # Records the pool shape hash each admission admits a node with (drift).
        admission.register_check(drift.CHECK_NAME, drift.check_pool_shape)
        # Drifted is server-owned: a node's own report never sets or clears it.
        health.register_kept_condition(drift.CONDITION)
        register_status_report_handler(
            "operations.upgrade_instruction", upgrades.upgrade_instruction_for_report, order=300
        )
        register_status_report_handler("operations.repair_instruction", repair.repair_instruction_for_report, order=310)
        lease_ended.connect(preemption.requeue_evicted_lease, dispatch_uid="operations.requeue_evicted_lease")
        register_collector("operations", OperationsCollector().collect)
        # A request no node holds is still placeable if the autoscaler's template would hold it.
        impossible.register_growth_source("operations.node_template", capacity.template_shapes)
        # "Would it fit after scale-up to max_nodes?" in POST /placement-previews.
        preview.register_scale_up_source("operations.node_template", capacity.scale_up_view)
