"""Tasks only the worker tests use (the test worker imports this module with ``-I``)."""

from celery import shared_task
from django.db.models import F

from fleet.models import Pool


@shared_task(name="tests.bump_pool")
def bump_pool(pool_id: int, description: str) -> int:
    """Write to the database from the worker: set the description and bump the version."""
    Pool.objects.filter(pk=pool_id).update(description=description, version=F("version") + 1)
    return Pool.objects.get(pk=pool_id).version
