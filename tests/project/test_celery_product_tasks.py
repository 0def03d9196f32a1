"""The product's own tasks on a real ``celery worker`` subprocess, on the embedded broker and on
Redis: admission retried after a database error, the drain deadline fired by its ETA message,
and the liveness sweep sent by beat. No eager mode: the worker is another process, on the test
database (hence transactional tests), listening on a private queue.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from fleet import event_types as fleet_events
from fleet.choices import Lifecycle, Liveness
from fleet.events import Actor
from fleet.models import AdmissionCheck, Node, NodeEvent, NodeResource
from leases import event_types as leases_events
from leases.models import Lease
from maintenance import drains, tasks
from maintenance.models import Drain
from tests.celery_support import assert_clean_log, celery_cmd
from tests.factories import NodeFactory, PoolFactory, make_schedulable_node, set_lifecycle
from tests.maintenance_support import make_lease
from tests.processes import running, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SYSTEM = Actor.system("test")


def test_admission_is_retried_after_a_database_error_and_admits_the_node(broker):
    node = NodeFactory(pool=PoolFactory(name="admit-on-worker"))
    set_lifecycle(node, Lifecycle.ADMITTING)
    Node.objects.filter(pk=node.pk).update(admission_attempt=1)
    injected = broker.tmp / "admission-failures.txt"
    client = broker.client()

    with running(broker.worker_args(), broker.env(NODEPOOL_TEST_ADMISSION_FAILURES=str(injected)), broker.log):
        result = client.send_task("fleet.run_admission", args=[str(node.pk), 1])
        wait_for(lambda: Node.objects.get(pk=node.pk).lifecycle == Lifecycle.READY, 40, "admission", broker.log)
        assert result.get(timeout=20) == "ready"

    assert injected.read_text().startswith("OperationalError injected"), "the first run met the database error"
    log = broker.log_text()
    assert "Retry in" in log and "OperationalError" in log, log[-3000:]
    checks = AdmissionCheck.objects.filter(node=node, attempt=1)
    assert checks.exists() and {c.status for c in checks} <= {"passed", "skipped"}
    assert NodeEvent.objects.filter(node=node, type=fleet_events.LIFECYCLE, to_state=Lifecycle.READY).count() == 1


def test_the_drain_deadline_is_enforced_by_its_eta_message_on_the_worker(broker, monkeypatch):
    node, _ = make_schedulable_node()
    lease = make_lease(node, "job-long", ttl=7200)
    client = broker.client()
    sent = []

    def to_the_worker(args=None, kwargs=None, **options):  # the product's own message, through the real broker
        sent.append(options["eta"])
        return client.send_task(tasks.enforce_drain_deadline.name, args=list(args or ()), kwargs=kwargs, **options)

    monkeypatch.setattr(tasks.enforce_drain_deadline, "apply_async", to_the_worker)
    with running(broker.worker_args(), broker.env(), broker.log):
        node.refresh_from_db()
        deadline = timezone.now() + timedelta(seconds=4)
        drain = drains.start_drain(
            node_id=node.pk, expected_version=node.version, policy="wait", deadline=deadline,
            reason="rack move", actor=SYSTEM,
        )  # fmt: skip
        assert sent == [deadline]
        assert Drain.objects.get(pk=drain.pk).state == "active"
        wait_for(lambda: Drain.objects.get(pk=drain.pk).state == "forced", 40, "the deadline task", broker.log)

    drain.refresh_from_db()
    assert drain.finished_at >= deadline, "not before its ETA"
    assert Lease.objects.get(pk=lease.pk).state == "revoked"
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 0
    assert Node.objects.get(pk=node.pk).lifecycle == "maintenance"
    assert "maintenance.enforce_drain_deadline" in broker.log_text()
    assert_clean_log(broker)


def test_beat_sends_the_liveness_sweep_and_the_worker_loses_a_silent_nodes_lease(broker):
    node, _ = make_schedulable_node()
    lease = make_lease(node, "job-on-a-dead-node", ttl=7200)
    silent_since = timezone.now() - timedelta(seconds=400)  # past the 300 s loss threshold
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=silent_since, next_liveness_check_at=silent_since)
    every_second, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(
        name=f"test-sweep-{broker.queue}",
        task="fleet.sweep_liveness",
        interval=every_second,
        queue=broker.queue,
        expire_seconds=5,
    )
    beat_args = [
        *celery_cmd(), "beat", "--scheduler", "nodepool.beat:DatabaseScheduler", "--max-interval", "1",
        "--loglevel=INFO", "--pidfile=", f"--schedule={broker.tmp / 'beat-schedule'}",
    ]  # fmt: skip
    env = broker.env()
    with running(broker.worker_args(), env, broker.log), running(beat_args, env, broker.log):
        wait_for(lambda: Lease.objects.get(pk=lease.pk).state == "lost", 40, "the sweep from beat", broker.log)

    node.refresh_from_db()
    assert node.liveness == Liveness.LOST
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 0
    assert NodeEvent.objects.filter(node=node, type=leases_events.LEASE, to_state="lost").count() == 1
    # Beat's own record that it sent the task (its "Sending due task" line is DEBUG chatter now).
    assert PeriodicTask.objects.get(name=f"test-sweep-{broker.queue}").total_run_count >= 1
    assert "fleet.sweep_liveness" in broker.log_text()
    assert_clean_log(broker)
