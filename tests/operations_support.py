"""Helpers for the pool-operations tests: a pool of ready nodes, heartbeats as the agent sends them,
and the real Celery worker + live server harness the end-to-end tests share."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from django.utils import timezone

from fleet.models import Node, Pool
from tests.factories import PoolFactory, make_schedulable_node
from tests.heartbeat_support import beat, node_api


def ready_pool(name: str, count: int, **pool_fields) -> tuple[Pool, list[tuple[Node, str]]]:
    """A pool of ``count`` ready nodes (agent 1.0.0), each with its credential secret."""
    pool = PoolFactory(name=name, heartbeat_interval=1, heartbeat_grace=30, loss_threshold=60, **pool_fields)
    return pool, [make_schedulable_node(pool) for _ in range(count)]


class FakeAgent:
    """Heartbeats of one node through the real API, and an upgrade carried out as the agent does."""

    def __init__(self, node: Node, secret: str):
        self.node, self.api = node, node_api(secret)
        self.incarnation, self.sequence, self.version = 1, 0, node.agent_version
        self.broken = False
        self.handled: set = set()

    def beat(self) -> dict:
        self.sequence += 1
        body = beat(
            sequence=self.sequence, incarnation=self.incarnation, agent_version=self.version, observed_at=timezone.now()
        )
        response = self.api.post(f"/api/v1/nodes/{self.node.pk}/heartbeats", body, format="json")
        if response.status_code == 429:
            return {}  # the status-report flood guard: a real agent renews instead, nothing to act on
        assert response.status_code == 200, response.content
        answer = response.json()
        upgrade = answer["instructions"].get("upgrade")
        key = (upgrade or {}).get("upgrade_id"), (upgrade or {}).get("version")
        if upgrade and upgrade["version"] != self.version and key not in self.handled:
            self.handled.add(key)
            if not self.broken:
                self.version = upgrade["version"]
            self.incarnation, self.sequence = self.incarnation + 1, 0
            self.beat()  # the restarted agent's first heartbeat
        return answer


def worker_env_redis() -> str | None:
    return os.environ.get("NODEPOOL_TEST_REDIS_URL")


@contextmanager
def celery_client_app(broker_url: str, backend_url: str):
    """Point this process's Celery app (used by ``.delay()`` in views and services) at the test
    broker, not eager, for the length of the block."""
    from nodepool.celery import app

    saved = {k: app.conf.get(k) for k in ("broker_url", "result_backend", "task_always_eager", "task_default_queue")}
    app.conf.update(broker_url=broker_url, result_backend=backend_url, task_always_eager=False)
    _forget_connections(app)
    try:
        yield app
    finally:
        app.conf.update(saved)
        _forget_connections(app)


def _forget_connections(app) -> None:
    """Drop the app's cached producer pool and queue routing, so new settings take effect."""
    from kombu import pools

    # kombu keeps producer pools in a process-wide registry keyed by connection: reset it too, or
    # the next test would get the pool this one closed ("Acquire on closed pool").
    pools.reset()
    app._pool = None
    app.__dict__.pop("amqp", None)
    app.__dict__.pop("backend", None)
    app._local.__dict__.pop("backend", None) if hasattr(app, "_local") else None


def var_dir(tmp_path: Path) -> Path:
    path = tmp_path / "var"
    path.mkdir(exist_ok=True)
    return path


class Stack:
    """A real Celery worker on its own queue and broker, and this process's Celery app pointed at it
    (so views and services dispatch to that worker), against the live server's database."""

    def __init__(self, tmp_path: Path, *, tick: float = 0.3):
        import uuid

        self.tmp = tmp_path
        self.queue = f"ops-{uuid.uuid4().hex[:10]}"
        redis = worker_env_redis()
        if redis:
            self.broker = self.backend = redis
        else:
            self.broker = f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}"
            self.backend = f"db+sqlite:///{tmp_path / 'results.sqlite3'}"
        self.log = tmp_path / "worker.log"
        self.tick = tick

    def env(self, **extra: str) -> dict[str, str]:
        from tests.processes import child_env

        return child_env(
            var_dir(self.tmp),
            CELERY_BROKER_URL=self.broker,
            CELERY_RESULT_BACKEND=self.backend,
            CELERY_TASK_DEFAULT_QUEUE=self.queue,
            NODEPOOL_UPGRADE_TICK=str(self.tick),
            **extra,
        )

    def worker_args(self, concurrency: int = 3) -> list[str]:
        import sys

        return [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "nodepool",
            "worker",
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

    @contextmanager
    def running(self, **env: str):
        from nodepool.celery import app
        from tests.processes import running

        with (
            running(self.worker_args(), self.env(**env), self.log) as worker,
            celery_client_app(self.broker, self.backend),
        ):
            app.conf.task_default_queue = self.queue
            _forget_connections(app)
            yield worker

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def assert_clean_log(self) -> None:
        text = self.log_text()
        for bad in ("Traceback", "database is locked", "Unrecoverable error"):
            at = text.find(bad)
            # the log's tail is routine task chatter: show what surrounds the first bad line instead
            assert at < 0, f"{bad} in the worker log:\n{text[max(0, at - 1500) : at + 4500]}"
