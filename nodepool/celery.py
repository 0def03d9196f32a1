"""The Celery application. Configuration comes from Django settings (``CELERY_*``)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nodepool.settings")

app = Celery("nodepool")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.task(name="nodepool.ping")
def ping(value: str = "pong") -> str:
    """Round-trip probe used by /readyz-style checks and the worker tests."""
    return value
