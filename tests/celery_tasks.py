"""Test-only code for real Celery workers (they import this module with ``-I``; the product never does).

* ``tests.bump_pool``: a task that writes to the database.
* Fault injection: with ``NODEPOOL_TEST_ADMISSION_FAILURES=<file>`` in the worker's environment,
  the first call of ``fleet.admission.run_admission`` in that worker raises ``OperationalError``
  (what a dropped database connection raises), so that the product's ``fleet.run_admission`` task
  must retry. The file records each injected failure, so the test can tell it happened.
"""

import os
from pathlib import Path

from celery import shared_task
from django.db import OperationalError
from django.db.models import F

from fleet.models import Pool


@shared_task(name="tests.bump_pool")
def bump_pool(pool_id: int, description: str) -> int:
    """Write to the database from the worker: set the description and bump the version."""
    Pool.objects.filter(pk=pool_id).update(description=description, version=F("version") + 1)
    return Pool.objects.get(pk=pool_id).version


def _inject_admission_failure() -> None:
    marker = os.environ.get("NODEPOOL_TEST_ADMISSION_FAILURES")
    if not marker:
        return
    from fleet import admission

    real = admission.run_admission

    def fails_once(**kwargs):
        path = Path(marker)
        if not path.exists():  # the first call only, in whichever worker process gets it
            path.write_text(f"OperationalError injected into run_admission({kwargs.get('node_id')})\n")
            raise OperationalError("server closed the connection unexpectedly (injected by tests.celery_tasks)")
        return real(**kwargs)

    # fleet.tasks.run_admission imports the function at call time, so it finds this wrapper.
    admission.run_admission = fails_once


_inject_admission_failure()
