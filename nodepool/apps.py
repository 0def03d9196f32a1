from django.apps import AppConfig
from django.db.models.signals import post_migrate


class NodepoolConfig(AppConfig):
    name = "nodepool"
    verbose_name = "nodepool"

    def ready(self):
        from .api import schema  # noqa: F401  (registers the OpenAPI authentication extensions)
        from .roles import ensure_roles

        post_migrate.connect(ensure_roles, dispatch_uid="nodepool.ensure_roles")
