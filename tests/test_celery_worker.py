"""A real Celery worker (and beat) runs tasks end to end, on the embedded broker and on Redis.

Each test starts ``celery -A nodepool worker`` as a subprocess on its own queue, against the
test database, and talks to it through a separate client app: eager mode is not involved.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import pytest
from celery import Celery
from celery.result import ResultSet
from django.conf import settings
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from kombu import Connection

from fleet.models import Pool
from tests.factories import PoolFactory
from tests.processes import child_env, running, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

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

    def env(self) -> dict[str, str]:
        return child_env(self.tmp / "var", CELERY_BROKER_URL=self.url, CELERY_RESULT_BACKEND=self.backend)

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


def test_a_real_worker_runs_ping_and_a_database_task(broker):
    pool = PoolFactory(description="before")
    client = broker.client()
    with running(broker.worker_args(), broker.env(), broker.log) as worker:
        ping = client.send_task("nodepool.ping", args=["hello"])
        bump = client.send_task("tests.bump_pool", args=[pool.pk, "written by the worker"])

        assert ping.get(timeout=25) == "hello"
        assert bump.get(timeout=25) == 2

    assert worker.returncode == 0, "the worker did not shut down cleanly on SIGTERM"

    pool.refresh_from_db()
    assert (pool.description, pool.version) == ("written by the worker", 2)
    assert_clean_log(broker)


def test_three_hundred_tasks_all_complete(broker):
    client = broker.client()
    # The embedded broker delivers about concurrency / 0.1 s tasks a second (see nodepool.broker).
    with running(broker.worker_args(concurrency=4), broker.env(), broker.log):
        results = ResultSet([client.send_task("nodepool.ping", args=[f"v{n}"]) for n in range(300)])
        values = results.join(timeout=60, interval=0.2, propagate=True)

    assert values == [f"v{n}" for n in range(300)]
    assert_clean_log(broker)


def test_beat_sends_a_one_second_schedule_that_the_worker_executes(broker):
    pool = PoolFactory(name="beat-ticks")
    every_second, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(
        name=f"test-tick-{broker.queue}",
        task="tests.bump_pool",
        interval=every_second,
        args=f'[{pool.pk}, "tick"]',
        queue=broker.queue,
        expire_seconds=5,
    )
    beat_args = [
        *celery_cmd(),
        "beat",
        "--scheduler",
        "nodepool.beat:DatabaseScheduler",
        "--max-interval",
        "1",
        "--loglevel=INFO",
        "--pidfile=",
        f"--schedule={broker.tmp / 'beat-schedule'}",
    ]
    env = broker.env()
    with running(broker.worker_args(), env, broker.log), running(beat_args, env, broker.log):
        started = time.monotonic()
        wait_for(lambda: Pool.objects.get(pk=pool.pk).version >= 4, 25, "three beat ticks", broker.log)
        elapsed = time.monotonic() - started

    pool.refresh_from_db()
    assert pool.description == "tick"
    assert pool.version >= 4
    # One tick a second: three ticks cannot have been sent in much less than two seconds.
    assert elapsed > 1.0
    assert "Sending due task" in broker.log_text()
    assert_clean_log(broker)


def test_two_processes_creating_the_same_queue_on_a_fresh_embedded_broker_both_succeed(tmp_path):
    """``make run`` starts worker and beat at once: kombu's insert of the queue row raced across
    processes (UNIQUE constraint failed: kombu_queue.name); the loser now reads the winner's row."""
    import subprocess
    import sys

    url = f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}"
    script = (
        "import sys, nodepool.broker\n"
        "from kombu import Connection\n"
        "with Connection(sys.argv[1]) as conn:\n"
        "    ch = conn.channel()\n"
        "    for i in range(40):\n"
        "        ch._get_or_create(f'q{i}')\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, url], stderr=subprocess.PIPE) for _ in range(4)]
    results = [(p.wait(timeout=60), p.stderr.read().decode()) for p in procs]
    assert all(code == 0 for code, _ in results), results
