from django.apps import AppConfig
from django.contrib.admin.apps import AdminConfig
from django.db.models.signals import post_migrate


class NodepoolConfig(AppConfig):
    name = "nodepool"
    verbose_name = "nodepool"

    def ready(self):
        # In ready(), not at the head: an AppConfig module is imported before the app registry is
        # ready, and what follows imports models (or DRF, whose settings read ours).
        from .api import schema  # noqa: F401  (registers the OpenAPI authentication extensions)
        from .roles import ensure_roles  # (in ready(): see above)

        post_migrate.connect(ensure_roles, dispatch_uid="nodepool.ensure_roles")

        from . import auth_backends  # noqa: F401  (connects the per-account failed-login counter)
        from .metrics import collect_queue_depth, register_collector  # (in ready(): see above)

        register_collector("celery", collect_queue_depth)

        from django_structlog import signals as structlog_signals  # (in ready(): see above)

        from .structured_logs import bind_node_of_request, bind_request_id  # (in ready(): see above)

        structlog_signals.bind_extra_request_metadata.connect(bind_request_id, dispatch_uid="nodepool.request_id")
        structlog_signals.bind_extra_request_finished_metadata.connect(
            bind_node_of_request, dispatch_uid="nodepool.node_of_request"
        )

        from .tracing import configure_tracing  # (in ready(): see above)

        configure_tracing()  # does nothing unless OTEL_EXPORTER_OTLP_ENDPOINT is set


class NodepoolAdminConfig(AdminConfig):
    """django.contrib.admin with nodepool's site as ``admin.site`` (nodepool.admin_site)."""

    default_site = "nodepool.admin_site.NodepoolAdminSite"
