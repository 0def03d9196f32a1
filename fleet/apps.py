from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "fleet"

    def ready(self):
        from nodepool.metrics import register_collector

        from . import (
            collectors,
            metrics,  # noqa: F401  (the heartbeat counter exists, at 0, from process start)
        )

        register_collector("fleet", collectors.collect)
