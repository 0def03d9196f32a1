from django.apps import AppConfig


class LeasesConfig(AppConfig):
    name = "leases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # Every import below is local: models may be imported only once the app registry is
        # ready, which is when Django calls ready() (the module head runs before that).
        from fleet import signals as fleet_signals  # ready(): the app registry is loaded now
        from fleet.instructions import register_status_report_handler  # ready(): as above
        from nodepool.metrics import register_collector  # ready(): as above

        from . import (  # ready(): as above
            collectors,
            errors,  # noqa: F401  (declares the app's problem codes: the registry is complete)
            event_types,  # noqa: F401  (declares the app's event types)
            receivers,
            signals,  # registers the queue kick on node saves
            tasks,  # noqa: F401  (registers the tasks leases sends by name)
        )
        from .device_faults import device_faulted  # ready(): as above
        from .fencing import register_lease_secret_verifier  # ready(): as above
        from .reliability import count_lease_outcome  # ready(): as above
        from .secrets import lease_secret_verifier  # ready(): as above

        # What fleet publishes and leases acts on (fleet never imports leases); the orders are
        # fleet.instructions' table: leases reconciles first, the quarantine rules see the result.
        register_status_report_handler("leases.reconcile_status_report", receivers.reconcile_status_report, order=100)
        register_status_report_handler("leases.status_report_kicks_queue", signals.status_report_kicks_queue, order=110)
        fleet_signals.nodes_lost.connect(receivers.lose_leases_of_lost_nodes, dispatch_uid="leases.lose_leases")
        fleet_signals.device_faulted.connect(device_faulted, dispatch_uid="leases.device_faulted")
        fleet_signals.node_revived.connect(signals.revived_node_kicks_queue, dispatch_uid="leases.revived_node_kicks")
        # Each ended lease counts in its node's reliability record, in the ending transaction.
        signals.lease_ended.connect(count_lease_outcome, dispatch_uid="leases.count_lease_outcome")
        register_collector("leases", collectors.collect)
        # A caller presenting a lease's own secret may validate that lease's fencing token.
        register_lease_secret_verifier(lease_secret_verifier)
