"""Real Celery workers for tests: a private queue on the embedded broker or Redis, a client app.

Used by tests/plumbing/test_celery_worker.py (the plumbing) and tests/project/test_celery_product_tasks.py (the
product's own tasks). Workers import ``tests.celery_tasks`` (``-I``): test-only tasks and the
test-only fault injection, which the product never imports.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
from celery import Celery
from django.conf import settings
from kombu import Connection

from tests.processes import child_env

REDIS_URL = os.environ.get(
    "NODEPOOL_TEST_REDIS_URL",
    settings.CELERY_BROKER_URL if settings.CELERY_BROKER_URL.startswith("redis") else "redis://127.0.0.1:6379/1",
)


def redis_answers() -> bool:
    try:
        with Connection(REDIS_URL, connect_timeout=1) as conn:
            conn.ensure_connection(max_retries=1, timeout=1)
    except Exception:
        return False
    return True


class Broker:
    """Where a test's worker and client meet: broker URL, result backend and a private queue."""

    def __init__(self, kind: str, tmp_path: Path):
        self.kind = kind
        self.tmp = tmp_path
        self.queue = f"test-{uuid.uuid4().hex[:12]}"
        if kind == "embedded":
            self.url = f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}"
            self.backend = f"db+sqlite:///{tmp_path / 'results.sqlite3'}"
        else:
            self.url = self.backend = REDIS_URL
        self.log = tmp_path / "processes.log"

    def env(self, **extra: str) -> dict[str, str]:
        return child_env(self.tmp / "var", CELERY_BROKER_URL=self.url, CELERY_RESULT_BACKEND=self.backend, **extra)

    def client(self) -> Celery:
        client = Celery("test-client", broker=self.url, backend=self.backend, set_as_current=False)
        client.conf.task_default_queue = self.queue
        return client

    def worker_args(self, concurrency: int = 2) -> list[str]:
        return [
            *celery_cmd(),
            "worker",
            "-I",
            "tests.celery_tasks",
            "-Q",
            self.queue,
            "-n",
            f"{self.queue}@%h",
            f"--concurrency={concurrency}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel=INFO",
        ]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def celery_cmd() -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "nodepool"]


@pytest.fixture(params=["embedded", "redis"])
def broker(request, tmp_path, monkeypatch) -> Broker:
    if request.param == "redis" and not redis_answers():
        pytest.skip(f"Redis does not answer at {REDIS_URL}")
    # Celery lets these variables override a client app's explicit broker and backend.
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    monkeypatch.delenv("CELERY_RESULT_BACKEND", raising=False)
    (tmp_path / "var").mkdir()
    return Broker(request.param, tmp_path)


def assert_clean_log(broker: Broker) -> None:
    text = broker.log_text()
    for bad in ("JSONDecodeError", "Traceback", "database is locked", "Unrecoverable error"):
        assert bad not in text, f"{bad} in the worker log:\n{text[-4000:]}"
