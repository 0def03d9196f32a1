"""/healthz says the process is up; /readyz says whether the database and the broker answer."""

from __future__ import annotations

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db


def test_healthz_answers_without_touching_dependencies(client, settings, django_assert_num_queries):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
    with django_assert_num_queries(0):
        response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_healthz_refuses_post(client):
    assert client.post("/healthz").status_code == 405


def test_readyz_is_200_when_database_and_broker_answer(client, settings, tmp_path):
    settings.CELERY_BROKER_URL = f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}"
    response = client.get("/readyz")
    assert response.status_code == 200, response.json()
    assert response.json()["checks"] == {"database": "ok", "broker": "ok"}


def test_readyz_is_200_on_the_configured_broker(client):
    response = client.get("/readyz")
    assert response.status_code == 200, response.json()


def test_readyz_is_503_when_the_broker_does_not_answer(client, settings):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["database"] == "ok"
    assert "refused" in body["checks"]["broker"].lower()


def test_readyz_is_503_when_the_embedded_broker_file_cannot_be_opened(client, settings):
    settings.CELERY_BROKER_URL = "sqla+sqlite:////nonexistent-dir/broker.sqlite3"
    response = client.get("/readyz")
    assert response.status_code == 503
    assert "unable to open database file" in response.json()["checks"]["broker"]


def test_readyz_is_503_when_the_database_does_not_answer(client, monkeypatch, settings, tmp_path):
    settings.CELERY_BROKER_URL = f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}"

    def broken_cursor(*args, **kwargs):
        raise connection.Database.OperationalError("connection refused")

    monkeypatch.setattr(connection, "cursor", broken_cursor)
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["broker"] == "ok"
    assert "refused" in response.json()["checks"]["database"]
