"""Fail fast on a hung database (issue 30, item 2): gunicorn against a PostgreSQL reached through a
TCP proxy that the test makes accept and never answer. Requests end as 503 database_timeout with
Retry-After within seconds (never gunicorn's 30 s timeout), and /healthz, answered by the
gunicorn master's probe thread, stays under a second throughout, straight and through the shipped
nginx (which sends /healthz there); /readyz answers 503 not_ready within its budget plus at most
one request's worst case of queueing behind the stuck workers."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time

import httpx
import pytest
from django.db import connection

from bench.common import Nginx, nginx_binary
from tests.factories import PoolFactory, make_schedulable_node
from tests.processes import VENV_BIN, child_env, database_url, free_port, running, wait_for
from tests.tcp_proxy_support import TcpProxy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="a database server that hangs: PostgreSQL"),
]


def renew(base: str, node, secret: str, sequence: int) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(
        f"{base}/api/v1/nodes/{node.pk}/renewals",
        content=json.dumps({"incarnation": 1, "sequence": sequence}),
        headers={"Authorization": f"Node {secret}", "Content-Type": "application/json"},
        timeout=40,
    )
    return response, time.monotonic() - started


def test_requests_against_a_hung_database_end_as_503_database_timeout_and_healthz_stays_fast(tmp_path):
    node, secret = make_schedulable_node(PoolFactory(name="general"))
    settings_dict = connection.settings_dict
    proxy = TcpProxy(int(settings_dict["PORT"] or 5432), settings_dict["HOST"] or "127.0.0.1")
    port, probe = free_port(), free_port()
    url = database_url().replace(f":{settings_dict['PORT'] or 5432}/", f":{proxy.port}/")
    env = child_env(
        tmp_path,
        DATABASE_URL=url,
        NODEPOOL_REQUEST_DB_DEADLINE="2",
        NODEPOOL_DB_CONNECT_TIMEOUT="2",
        NODEPOOL_PROBE_BIND=f"127.0.0.1:{probe}",
        NODEPOOL_MIN_SPACING_FRACTION="0",
    )
    args = [str(VENV_BIN / "gunicorn"), "nodepool.wsgi:application", "--bind", f"127.0.0.1:{port}",
            "--workers", "2", "--timeout", "30"]  # fmt: skip
    base, probe_base = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{probe}"
    log = tmp_path / "gunicorn.log"
    edge = Nginx(f"127.0.0.1:{port}", probe_upstream=f"127.0.0.1:{probe}") if nginx_binary() else None
    try:
        with running(args, env, log), edge or _nothing():
            wait_for(lambda: _answers(probe_base + "/healthz") and _answers(base + "/healthz"), 30, "gunicorn", log)
            for sequence in (1, 2, 3):  # both workers hold an open connection (CONN_MAX_AGE)
                response, _ = renew(base, node, secret, sequence)
                assert response.status_code == 200, response.text

            proxy.hang()
            results: list[tuple[httpx.Response, float]] = []
            threads = [
                threading.Thread(target=lambda s=s: results.append(renew(base, node, secret, s))) for s in (4, 5, 6)
            ]
            for thread in threads:
                thread.start()
            time.sleep(0.3)  # both workers are now stuck on the hung database
            ready: list[tuple[int, float]] = []
            readyz = threading.Thread(target=lambda: ready.append(_timed_status(port, "/readyz", 20)))
            readyz.start()
            health, edge_health = [], []
            while any(t.is_alive() for t in [*threads, readyz]):
                started = time.monotonic()
                ok = _status(probe, "/healthz") == 200
                health.append((ok, time.monotonic() - started))
                if edge is not None:
                    edge_health.append(_timed_status(edge.port, "/healthz", 5))
                time.sleep(0.2)
            for thread in threads:
                thread.join()

            proxy.forward()
            recovered = wait_for(lambda: renew(base, node, secret, 7)[0].status_code == 200, 20, "recovery", log)
    finally:
        proxy.close()

    for response, elapsed in results:
        assert response.status_code == 503, response.text
        assert response.json()["code"] == "database_timeout"
        assert response.headers["Retry-After"] == "5"
        assert elapsed < 12  # 2 workers, 3 requests: the last waits for one deadline + connect timeout
    assert health and all(ok and seconds < 1 for ok, seconds in health), health
    if edge is not None:
        assert edge_health and all(status == 200 and seconds < 1 for status, seconds in edge_health), edge_health
    # /readyz: its budget (2.5 s), behind at most one stuck request (deadline 2 s + connect 2 s).
    assert ready and ready[0][0] == 503 and ready[0][1] < 2.5 + 2 + 2 + 1, ready
    assert recovered


@contextlib.contextmanager
def _nothing():
    yield


def _timed_status(port: int, path: str, timeout: float) -> tuple[int, float]:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        return conn.getresponse().status, time.monotonic() - started
    except OSError:
        return 0, time.monotonic() - started
    finally:
        conn.close()


def _status(port: int, path: str) -> int:
    """GET over a plain socket (http.client: no TLS context to build, unlike a new httpx client)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
