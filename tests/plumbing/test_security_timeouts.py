"""Timeouts everywhere (issue 11, item 3): a hung database or broker costs seconds, and a database
that is down or too slow answers 503 problem+json with Retry-After, never 500."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django.db import IntegrityError, InterfaceError, OperationalError, connection

from nodepool import health
from nodepool.settings import postgres_options
from tests.problems import assert_problem

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def silent_server():
    """A TCP server that accepts connections and never answers (the failure seen in issue 11)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


def test_the_postgresql_connect_timeout_gives_up_on_a_server_that_never_answers(silent_server):
    import psycopg

    options = postgres_options(connect_timeout=1, statement_timeout_ms=0)
    started = time.monotonic()

    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(host="127.0.0.1", port=silent_server, dbname="x", user="x", **options)

    assert time.monotonic() - started < 5


@pytest.mark.django_db
def test_readyz_answers_within_its_budget_when_a_check_hangs_and_names_only_it(client, monkeypatch, settings):
    settings.NODEPOOL_READYZ_BUDGET = 1.0
    release = threading.Event()
    monkeypatch.setitem(health.CHECKS, "database", lambda: release.wait(30))
    monkeypatch.setitem(health.CHECKS, "broker", lambda: None)
    try:
        started = time.monotonic()
        first = client.get("/readyz", HTTP_ACCEPT="text/html")
        second = client.get("/readyz")  # the first check still hangs: not started twice
        elapsed = time.monotonic() - started
    finally:
        release.set()

    assert elapsed < 3
    for response in (first, second):
        body = assert_problem(response, 503, "not_ready")
        assert body["failing"] == ["database"] and body["checks"]["broker"] == "ok"
    assert len([t for t in threading.enumerate() if t.name == "readyz-database"]) <= 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("error", "code"),
    [
        (OperationalError("connection to server at 10.1.2.3 failed: Connection refused"), "database_unavailable"),
        (InterfaceError("connection already closed"), "database_unavailable"),
        (OperationalError("canceling statement due to statement timeout"), "database_timeout"),
    ],
)
def test_a_database_outage_during_a_request_is_503_with_retry_after(operator_api, monkeypatch, error, code):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr("fleet.api.views.node_queryset_for", fail)

    response = operator_api.get("/api/v1/nodes", HTTP_ACCEPT="text/html")

    body = assert_problem(response, 503, code)
    assert response["Retry-After"] == "5" and body["retry_after"] == 5
    assert "10.1.2.3" not in response.content.decode()


@pytest.mark.django_db
def test_an_integrity_error_stays_409(operator_api, monkeypatch):
    def clash(*args, **kwargs):
        raise IntegrityError("duplicate key value violates unique constraint")

    monkeypatch.setattr("fleet.api.views.node_queryset_for", clash)

    assert_problem(operator_api.get("/api/v1/nodes"), 409, "integrity_error")


def test_a_database_outage_outside_drf_is_503_problem_json(rf):
    from nodepool.api import middleware

    response = middleware.ProblemJsonMiddleware(lambda r: None).process_exception(
        rf.get("/readyz"), OperationalError("server closed the connection unexpectedly")
    )

    assert response.status_code == 503 and response["Retry-After"] == "5"
    assert json.loads(response.content)["code"] == "database_unavailable"


@pytest.mark.django_db(transaction=True)
def test_the_statement_timeout_cancels_a_slow_statement_on_postgresql():
    if connection.vendor != "postgresql":
        pytest.skip("statement_timeout is a PostgreSQL setting")
    import psycopg

    params = connection.get_connection_params()
    params.update(postgres_options(connect_timeout=3, statement_timeout_ms=200))
    params.pop("cursor_factory", None)
    params.pop("context", None)
    with psycopg.connect(**params) as conn, pytest.raises(psycopg.errors.QueryCanceled):
        conn.execute("SELECT pg_sleep(5)")


def _settings_in_a_fresh_process(**env) -> dict:
    code = (
        "import os, json, sys\n"
        "kind = os.environ.get('KIND')\n"
        "if kind == 'web':\n    import nodepool.wsgi\n"
        "else:\n    import django\n"
        "    os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'nodepool.settings')\n"
        "    django.setup()\n"
        "from django.conf import settings\n"
        "print(json.dumps({'db': settings.DATABASES['default'].get('OPTIONS', {}),"
        " 'broker': settings.CELERY_BROKER_TRANSPORT_OPTIONS, 'redis': settings.CELERY_REDIS_SOCKET_TIMEOUT}))\n"
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("NODEPOOL_PROCESS_KIND",)}
    environment.update(env)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environment, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_web_processes_get_the_statement_timeout_and_other_processes_the_sweep_one():
    env = {
        "DATABASE_URL": "postgres://u@127.0.0.1:5432/x",
        "CELERY_BROKER_URL": "redis://127.0.0.1:6379/9",
        "NODEPOOL_DB_STATEMENT_TIMEOUT_MS": "7000",
        "NODEPOOL_DB_CONNECT_TIMEOUT": "4",
    }

    web = _settings_in_a_fresh_process(KIND="web", **env)
    sweep = _settings_in_a_fresh_process(KIND="worker", **env)
    migrate = _settings_in_a_fresh_process(KIND="worker", NODEPOOL_DB_SWEEP_STATEMENT_TIMEOUT_MS="600000", **env)

    generic = "-c plan_cache_mode=force_generic_plan"
    # TCP keepalives and tcp_user_timeout in every process (issue 30: a vanished host is noticed).
    tcp = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3,
           "tcp_user_timeout": 10_000}  # fmt: skip
    assert web["db"] == {"connect_timeout": 4, **tcp, "options": f"-c jit=off -c statement_timeout=7000 {generic}"}
    assert sweep["db"] == {"connect_timeout": 4, **tcp, "options": f"-c jit=off {generic}"}
    assert migrate["db"]["options"] == f"-c jit=off -c statement_timeout=600000 {generic}"
    # Web processes only publish (nodepool.failsafe): a short broker socket; workers keep 10 s / 3 s.
    assert web["broker"]["socket_timeout"] == 1.0 and web["broker"]["socket_connect_timeout"] == 1.0
    assert sweep["broker"]["socket_timeout"] == 10.0 and sweep["broker"]["socket_connect_timeout"] == 3.0
    assert web["redis"] == 10.0


@pytest.mark.skipif(connection.vendor != "postgresql", reason="a PostgreSQL setting")
@pytest.mark.django_db
def test_postgresql_sessions_run_without_jit_compilation():
    """JIT compiled the 409 explanation's grouped queries for longer than they ran (settings.postgres_options)."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW jit")
        assert cursor.fetchone()[0] == "off"
