"""Node traffic needs only the database (issue 30, item 1): renewals and status reports answer 200
throughout a Redis outage, with the cache and the broker on a real Redis behind a TCP proxy the
test stops (connection refused), hangs (accepts, never answers) and starts again. No mocks."""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

import pytest
from django.test import Client

from fleet.choices import Liveness
from fleet.models import Node
from fleet.renewals import forget_cached_timings
from nodepool import failsafe
from nodepool.failsafe import FAIL_OPEN
from tests.celery_support import REDIS_URL, redis_answers
from tests.factories import PoolFactory, make_schedulable_node
from tests.heartbeat_support import node_api, post_beat
from tests.tcp_proxy_support import TcpProxy

pytestmark = [pytest.mark.django_db, pytest.mark.slow]


@pytest.fixture
def redis_proxy(settings):
    """The cache on the test Redis through a stoppable proxy, failing open fast."""
    if not redis_answers():
        pytest.skip(f"Redis does not answer at {REDIS_URL}")
    target = urlsplit(REDIS_URL)
    proxy = TcpProxy(target.port or 6379, target.hostname or "127.0.0.1")
    db = (target.path or "/0").lstrip("/") or "0"
    settings.CACHES = {
        "default": {
            "BACKEND": "nodepool.failsafe.FailOpenRedisCache",
            "LOCATION": f"redis://127.0.0.1:{proxy.port}/{db}",
            "KEY_PREFIX": f"np-outage-{proxy.port}",
            "OPTIONS": {"socket_timeout": 0.25, "socket_connect_timeout": 0.25},
        }
    }
    settings.NODEPOOL_CACHE_RETRY_SECONDS = 0.2
    settings.NODEPOOL_BROKER_RETRY_SECONDS = 0.2
    settings.NODEPOOL = {**settings.NODEPOOL, "MIN_SPACING_FRACTION": 0}
    failsafe.CACHE_CIRCUIT.reset()
    failsafe.BROKER_CIRCUIT.reset()
    yield proxy
    proxy.close()
    failsafe.CACHE_CIRCUIT.reset()
    failsafe.BROKER_CIRCUIT.reset()


def fail_open_count(component: str) -> float:
    return sum(
        sample.value
        for metric in FAIL_OPEN.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels["component"] == component
    )


class Renewer:
    def __init__(self, node, secret):
        self.node, self.secret, self.sequence = node, secret, 0

    def __call__(self):
        """One renewal that reads the fleet population from the cache (timings forgotten first)."""
        forget_cached_timings()
        self.sequence += 1
        started = time.monotonic()
        response = Client().post(
            f"/api/v1/nodes/{self.node.pk}/renewals",
            json.dumps({"incarnation": 1, "sequence": self.sequence}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Node {self.secret}",
        )
        return response, time.monotonic() - started


def test_renewals_answer_200_before_during_and_after_a_redis_outage(redis_proxy):
    node, secret = make_schedulable_node(PoolFactory(name="general"))
    renew = Renewer(node, secret)

    response, _ = renew()
    assert response.status_code == 200, response.content
    failures_before = fail_open_count("cache")

    redis_proxy.stop()  # connection refused
    for _ in range(3):
        response, elapsed = renew()
        assert response.status_code == 200, response.content
        assert elapsed < 1.0
    assert fail_open_count("cache") > failures_before

    redis_proxy.hang()  # accepts and never answers: each call costs at most the socket timeout
    time.sleep(0.25)  # the circuit closes again: the next call really tries Redis
    for _ in range(3):
        response, elapsed = renew()
        assert response.status_code == 200, response.content
        assert elapsed < 1.5

    redis_proxy.forward()
    time.sleep(0.25)
    response, _ = renew()
    assert response.status_code == 200
    failures_after_recovery = fail_open_count("cache")
    response, _ = renew()
    assert response.status_code == 200
    assert fail_open_count("cache") == failures_after_recovery  # Redis is used again
    assert Node.objects.get(pk=node.pk).sequence == renew.sequence


def test_status_reports_and_the_queue_kick_they_cause_answer_200_with_the_broker_down(
    redis_proxy, client_api, django_capture_on_commit_callbacks, monkeypatch
):
    """A status report that makes a stale node alive kicks the lease queue (a task published after
    commit): with the broker behind a stopped proxy it is sent once, fails open, and the report
    still answers 200 in well under a second."""
    from nodepool.celery import app

    pool = PoolFactory(name="general")
    node, secret = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    busy = {"workload_id": "busy", "pool": "general", "resources": {"cpu": "3"}}
    assert client_api.post("/api/v1/node-leases", busy, format="json").status_code == 201
    queued = client_api.post(
        "/api/v1/node-leases", {"workload_id": "next", "pool": "general", "resources": {"cpu": "3"}, "queue": True},
        format="json",
    )  # fmt: skip
    assert queued.status_code == 202, queued.content
    Node.objects.filter(pk=node.pk).update(liveness=Liveness.STALE)

    redis_proxy.stop()
    # Celery reads these variables before app.conf (celery.app.utils.Settings): with the suite's
    # CELERY_BROKER_URL set, the kick would go to the real Redis and never meet the stopped proxy.
    for variable in ("CELERY_BROKER_URL", "CELERY_BROKER_WRITE_URL", "CELERY_BROKER_READ_URL"):
        monkeypatch.delenv(variable, raising=False)
    saved = (app.conf.broker_url, app.conf.broker_transport_options, app.conf.task_always_eager)
    app.conf.broker_url = f"redis://127.0.0.1:{redis_proxy.port}/0"
    app.conf.broker_transport_options = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0, "max_retries": 0}
    app.conf.task_always_eager = False
    app._after_fork()  # forget pooled connections to the old broker
    before = fail_open_count("broker")
    try:
        started = time.monotonic()
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            response = post_beat(node_api(secret), node, sequence=1)
        elapsed = time.monotonic() - started
    finally:
        app.conf.broker_url, app.conf.broker_transport_options, app.conf.task_always_eager = saved
        app._after_fork()
    assert response.status_code == 200, response.content
    assert elapsed < 2.0
    assert Node.objects.get(pk=node.pk).liveness == Liveness.ALIVE
    assert callbacks and fail_open_count("broker") == before + 1
