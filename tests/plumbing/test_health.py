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


def test_readyz_is_503_naming_only_the_broker_when_it_does_not_answer(client, settings):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
    response = client.get("/readyz")
    body = assert_problem(response, 503, "not_ready")
    assert body["checks"] == {"database": "ok", "broker": "failed"} and body["failing"] == ["broker"]
    assert "127.0.0.1" not in response.content.decode() and "refused" not in response.content.decode().lower()
    assert response["Retry-After"] == "5"


def test_readyz_is_503_when_the_embedded_broker_file_cannot_be_opened(client, settings):
    settings.CELERY_BROKER_URL = "sqla+sqlite:////nonexistent-dir/broker.sqlite3"
    response = client.get("/readyz")
    assert assert_problem(response, 503, "not_ready")["failing"] == ["broker"]
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
