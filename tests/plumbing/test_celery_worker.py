"""A real Celery worker (and beat) runs tasks end to end, on the embedded broker and on Redis.

Each test starts ``celery -A nodepool worker`` as a subprocess on its own queue, against the
test database, and talks to it through a separate client app: eager mode is not involved.
"""

from __future__ import annotations

import time

import pytest
from celery.result import ResultSet
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from fleet.models import Pool
from tests.celery_support import Broker, assert_clean_log, celery_cmd  # noqa: F401
from tests.factories import PoolFactory
from tests.processes import running, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


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
    # Beat's "Sending due task" lines are at DEBUG (nodepool.logs); its log level is LOG_LEVEL's.
    beat_env = {**env, "LOG_LEVEL": "DEBUG"}
    with running(broker.worker_args(), env, broker.log), running(beat_args, beat_env, broker.log):
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
    processes (UNIQUE constraint failed: kombu_queue.name), and so did its creation of the tables
    (table kombu_message already exists); the loser now reads what the winner made."""
    import subprocess
    import sys
    import time

    url = f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}"
    # Every process waits for the same instant before it opens the broker, so that their
    # table creation (kombu's check-then-create) and queue inserts overlap.
    script = (
        "import sys, time, nodepool.broker\n"
        "from kombu import Connection\n"
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"
        "with Connection(sys.argv[1]) as conn:\n"
        "    ch = conn.channel()\n"
        "    for i in range(40):\n"
        "        ch._get_or_create(f'q{i}')\n"
    )
    start = str(time.time() + 3.0)  # importing kombu and nodepool takes about a second per process
    procs = [subprocess.Popen([sys.executable, "-c", script, url, start], stderr=subprocess.PIPE) for _ in range(4)]
    results = [(p.wait(timeout=60), p.stderr.read().decode()) for p in procs]
    assert all(code == 0 for code, _ in results), results
