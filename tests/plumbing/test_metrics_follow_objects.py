"""Series follow the objects (issue 29, item 3), in Prometheus' multiprocess mode: a pool's
per-process series vanish from /metrics on the next scrape after the pool is deleted, whatever
process counted them (here processes that have exited: their files persist), and a pool created
again under the same name starts from zero."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.models import Pool
from nodepool.models import MetricBaseline
from tests.factories import PoolFactory
from tests.metrics_support import scrape, value

pytestmark = [pytest.mark.django_db, pytest.mark.slow]

# Another process counting placement failures, as a gunicorn worker or a Celery worker does.
CHILD = """
import sys
from prometheus_client import Counter
failures = Counter("nodepool_placement_failures_total", "Unschedulable answers.", ["pool", "reason"])
failures.labels(pool=sys.argv[1], reason="insufficient_cpu").inc(float(sys.argv[2]))
"""
NAME = "nodepool_placement_failures_total"


@pytest.fixture
def multiprocess(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))

    def count(pool: str, amount: float) -> None:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
        subprocess.run([sys.executable, "-c", CHILD, pool, str(amount)], env=env, check=True, timeout=60)

    return count


def failures(client, pool: str) -> float | None:
    return value(scrape(client), NAME, pool=pool, reason="insufficient_cpu")


def test_a_deleted_pools_series_vanish_and_a_recreated_pool_starts_from_zero(client, multiprocess, time_machine):
    PoolFactory(name="p9"), PoolFactory(name="p1")
    multiprocess("p9", 3)
    multiprocess("p1", 1)
    assert (failures(client, "p9"), failures(client, "p1")) == (3.0, 1.0)

    Pool.objects.get(name="p9").delete()  # DELETE /pools/p9 and the admin end here too

    assert failures(client, "p9") is None, "the next scrape no longer has the deleted pool's series"
    assert failures(client, "p1") == 1.0
    assert MetricBaseline.objects.get(label="pool", value="p9").samples

    time_machine.move_to(timezone.now() + timedelta(seconds=1), tick=True)
    PoolFactory(name="p9")
    assert failures(client, "p9") == 0.0, "a pool created again under the same name starts from zero"
    multiprocess("p9", 2)
    assert failures(client, "p9") == 2.0


def test_a_request_class_removed_from_its_pool_takes_its_series_along(client, multiprocess):
    """Per-process series labelled by request class follow the pool's declared classes."""
    pool = PoolFactory(name="general", request_classes=[{"name": "one-core", "resources": {"cpu": 1000}}])
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": os.environ["PROMETHEUS_MULTIPROC_DIR"]}
    code = (
        "from prometheus_client import Counter\n"
        "c = Counter('nodepool_test_class_total', 'x', ['pool', 'request_class'])\n"
        "c.labels(pool='general', request_class='one-core').inc()\n"
        "c.labels(pool='general', request_class='gone').inc()\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    text = scrape(client)
    assert value(text, "nodepool_test_class_total", pool="general", request_class="one-core") == 1.0
    assert value(text, "nodepool_test_class_total", pool="general", request_class="gone") is None
    Pool.objects.filter(pk=pool.pk).update(request_classes=[])
    assert value(scrape(client), "nodepool_test_class_total", pool="general", request_class="one-core") is None
