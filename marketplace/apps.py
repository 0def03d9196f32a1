from django.apps import AppConfig


class MarketplaceConfig(AppConfig):
    """Usage evidence, reconciliation, pricing, statements, appeals and the owner's view.

    Sits above maintenance (it reads quarantines); lower apps reach it only through hooks
    connected here: the lease's end (leases.signals.lease_ended), the retention guard and the
    status report (a status-report handler, fleet.instructions: availability evidence)."""

    name = "marketplace"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # Every import here waits for ready(): the app registry must be loaded before models are.
        from fleet.instructions import register_status_report_handler  # imports models: ready() only
        from leases.signals import lease_ended  # imports models: ready() only
        from nodepool import retention  # imports models: ready() only
        from nodepool.metrics import register_collector  # with the collectors: ready() only

        from . import (  # the app's modules import its models: ready() only
            availability,
            collectors,
            errors,  # noqa: F401  (declares the app's problem codes: the registry is complete)
            event_types,  # noqa: F401  (declares the app's event types)
            receivers,
            selectors,
        )

        lease_ended.connect(receivers.open_usage_record, dispatch_uid="marketplace.open_usage_record")
        # Retention (nodepool.retention) keeps unsettled usage's leases and their events.
        retention.keep_leases(selectors.keep_unsettled_leases)
        retention.keep_events(selectors.keep_unsettled_lease_events)
        # Payouts, holds and appeals are never pruned (no retention deletes them); their events stay too.
        retention.keep_events(selectors.keep_money_events)
        register_collector("marketplace", collectors.collect)
        register_collector("marketplace_money", collectors.collect_money)
        # Availability evidence (what each node offered) from every applied status report.
        register_status_report_handler("marketplace.availability", availability.record_status_report, order=400)
