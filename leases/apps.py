from django.apps import AppConfig


class LeasesConfig(AppConfig):
    name = "leases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from . import signals  # noqa: F401  (registers the queue kick on node saves)
