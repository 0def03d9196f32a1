from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "fleet"

    def ready(self):
        # In ready(), not at the head: Django imports this module while it loads the app registry,
        # before any model may be imported; everything below imports fleet's models.
        from django.db.models.signals import post_delete

        from nodepool.metrics import register_collector, register_object_label  # in ready(): see above

        from . import (  # in ready(): see above
            collectors,
            errors,  # noqa: F401  (declares the app's problem codes: the registry is complete)
            event_types,  # noqa: F401  (fleet's own event types, and the registry every app declares in)
            metrics,  # noqa: F401  (the heartbeat counter exists, at 0, from process start)
            reverification,  # noqa: F401  (connects its receiver of fleet.signals.benchmark_finished)
            sql,
            tasks,  # noqa: F401  (registers the tasks fleet.admission and fleet.services enqueue by name)
        )
        from .models import Pool  # the registry is ready here (see above)

        register_collector("fleet", collectors.collect)
        # SQLite: the SQL functions fleet's statements call, on every new connection (fleet.sql).
        sql.connect_signals()
        # Per-process series follow the pools and their request classes (nodepool.metrics): gone
        # with the object, from zero when one of the same name is created again.
        register_object_label("pool", collectors.existing_pools)
        register_object_label("request_class", collectors.existing_request_classes, parent="pool")
        post_delete.connect(collectors.forget_pool_series, sender=Pool, dispatch_uid="fleet.forget_pool_series")
