from django.apps import AppConfig


class LeasesConfig(AppConfig):
    name = "leases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from fleet import signals as fleet_signals
        from fleet.instructions import register_status_report_handler

        from . import (
            errors,  # noqa: F401  (declares the app's problem codes: the registry is complete)
            event_types,  # noqa: F401  (declares the app's event types)
            signals,  # registers the queue kick on node saves
            tasks,  # noqa: F401  (registers the tasks leases.services sends by name)
        )

        # What fleet publishes and leases acts on (fleet never imports leases); the orders are
        # fleet.instructions' table: leases reconciles first, the quarantine rules see the result.
        register_status_report_handler("leases.reconcile_status_report", signals.reconcile_status_report, order=100)
        register_status_report_handler("leases.status_report_kicks_queue", signals.status_report_kicks_queue, order=110)
        fleet_signals.nodes_lost.connect(signals.lose_leases_of_lost_nodes, dispatch_uid="leases.lose_leases")
        from .device_faults import device_faulted

        fleet_signals.device_faulted.connect(device_faulted, dispatch_uid="leases.device_faulted")
        fleet_signals.node_revived.connect(signals.revived_node_kicks_queue, dispatch_uid="leases.revived_node_kicks")
        from .reliability import count_lease_outcome

        # Each ended lease counts in its node's reliability record, in the ending transaction.
        signals.lease_ended.connect(count_lease_outcome, dispatch_uid="leases.count_lease_outcome")

        from nodepool.metrics import register_collector

        from . import collectors

        register_collector("leases", collectors.collect)

        from .fencing import register_lease_secret_verifier
        from .secrets import lease_secret_verifier

        # A caller presenting a lease's own secret may validate that lease's fencing token.
        register_lease_secret_verifier(lease_secret_verifier)
