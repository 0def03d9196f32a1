"""/healthz says the process is up; /readyz says whether the database and the broker answer."""

from __future__ import annotations

import pytest
from django.db import connection

from nodepool import health
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db


def test_healthz_answers_without_touching_dependencies(client, settings, django_assert_num_queries):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
    with django_assert_num_queries(0):
        response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_healthz_refuses_post_with_a_problem(client):
    assert_problem(client.post("/healthz", HTTP_ACCEPT="text/html"), 405, "method_not_allowed")


def test_readyz_is_200_when_database_and_broker_answer(client, settings, tmp_path):
    settings.CELERY_BROKER_URL = f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}"
    response = client.get("/readyz")
    assert response.status_code == 200, response.json()
    assert response.json()["checks"] == {"database": "ok", "broker": "ok"}


def test_readyz_is_200_on_the_configured_broker(client):
    response = client.get("/readyz")
    assert response.status_code == 200, response.json()


def test_readyz_is_200_degraded_naming_only_the_broker_when_it_does_not_answer(client, settings):
    """Node traffic needs only the database (issue 30): a broker outage is named, not fatal."""
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
    response = client.get("/readyz")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "degraded" and body["degraded"] == ["broker"]
    assert body["checks"] == {"database": "ok", "broker": "failed"}
    assert "127.0.0.1" not in response.content.decode() and "refused" not in response.content.decode().lower()


def test_readyz_names_an_unreachable_redis_cache(client, settings, tmp_path):
    settings.CELERY_BROKER_URL = f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}"
    settings.CACHES = {"default": {"BACKEND": "nodepool.failsafe.FailOpenRedisCache", "LOCATION": "redis://127.0.0.1:1/0",
                                   "OPTIONS": {"socket_timeout": 0.25, "socket_connect_timeout": 0.25}}}  # fmt: skip
    body = client.get("/readyz").json()
    assert body["status"] == "degraded" and body["degraded"] == ["cache"], body
    assert body["checks"] == {"database": "ok", "broker": "ok", "cache": "failed"}


def test_readyz_is_degraded_when_the_embedded_broker_file_cannot_be_opened(client, settings):
    settings.CELERY_BROKER_URL = "sqla+sqlite:////nonexistent-dir/broker.sqlite3"
    response = client.get("/readyz")
    assert response.status_code == 200 and response.json()["degraded"] == ["broker"]
    assert "nonexistent" not in response.content.decode()


def test_readyz_is_503_when_the_database_does_not_answer(client, monkeypatch, settings, tmp_path):
    settings.CELERY_BROKER_URL = f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}"

    def broken():
        raise connection.Database.OperationalError("connection to server at db.internal:5432 refused")

    monkeypatch.setitem(health.CHECKS, "database", broken)
    response = client.get("/readyz")
    body = assert_problem(response, 503, "not_ready")
    assert body["checks"] == {"database": "failed", "broker": "ok"}
    assert "db.internal" not in response.content.decode()
