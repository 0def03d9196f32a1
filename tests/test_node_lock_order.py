"""A node's report about its lease and an operator's action on the node, at the same moment, on
PostgreSQL: no deadlock.

CI's PostgreSQL run once saw ``POST /node-leases/{id}/events`` (a checkpoint report) answered 503:
the report held the lease row and inserted an event referencing the node (PostgreSQL takes
``FOR KEY SHARE`` on the node row for the foreign key), while a preemption held the node row
``FOR UPDATE`` and waited for the lease row. Every product lock on a node or lease row is now
``FOR NO KEY UPDATE`` (it still excludes every other writer and ``FOR SHARE``, but not a foreign-key
check), so the report finishes and the action goes on after it.

A status report and a drain revoking one of its leases take the lease rows, then the lease's
evidence rows, in that order: the report once took them the other way round and deadlocked with a
drain's revocation (found in the autoscaling end-to-end test's worker).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from fleet.events import Actor
from fleet.models import Node
from leases import evidence, fencing
from leases.models import EvidenceInterval, Lease
from leases.reconcile import reconcile_heartbeat
from maintenance import drains
from maintenance import services as maintenance
from operations import outofservice
from tests.factories import make_schedulable_node
from tests.maintenance_helpers import make_lease
from tests.races import race

pytestmark = [pytest.mark.race, pytest.mark.django_db(transaction=True)]


def test_a_checkpoint_report_and_a_quarantine_of_its_node_both_complete(monkeypatch):
    if connection.vendor != "postgresql":
        pytest.skip("row locks and foreign-key share locks are PostgreSQL's; SQLite serialises writers")
    node, _ = make_schedulable_node()
    lease = make_lease(node, "job-1")
    report_holds_lease, action_holds_node = threading.Event(), threading.Event()

    checkpoint_taken, lock_node = fencing._checkpoint_taken, maintenance.lock_node

    def checkpoint_taken_after_the_node_is_locked(*args, **kwargs):
        report_holds_lease.set()  # the report's UPDATE of the lease row is done, not committed
        assert action_holds_node.wait(10)
        time.sleep(0.3)  # the action is now waiting for the lease row
        return checkpoint_taken(*args, **kwargs)  # inserts an event referencing the node

    def lock_node_once_the_report_holds_the_lease(node_id):
        assert report_holds_lease.wait(10)
        locked = lock_node(node_id)
        action_holds_node.set()
        return locked

    monkeypatch.setattr(fencing, "_checkpoint_taken", checkpoint_taken_after_the_node_is_locked)
    monkeypatch.setattr(maintenance, "lock_node", lock_node_once_the_report_holds_the_lease)

    def racer(i):
        if i == 0:
            body = {"state": "checkpointed", "fencing_token": lease.fencing_token, "node_incarnation": node.incarnation}
            return fencing.lease_report_event(lease_id=lease.pk, data=body, node=node, actor=Actor.for_node(node))
        return maintenance.quarantine_node(node_id=node.pk, reason="incident", evidence={}, actor=Actor.system("test"))

    outcome = race(racer, 2, timeout=30)
    assert outcome.errors == [], outcome.errors
    lease.refresh_from_db()
    assert lease.state == "revoked"  # the quarantine went on after the report committed
    assert lease.checkpoints.filter(state="taken").count() == 1


def _someone_waits_for_a_row_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return bool(cursor.fetchone()[0])


def test_a_status_report_and_a_drain_revoking_its_lease_both_complete(monkeypatch):
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite serialises writers")
    node, _ = make_schedulable_node()
    lease = make_lease(node, "db-1", resources={"cpu": 500})
    now = timezone.now()
    Lease.objects.filter(pk=lease.pk).update(command=["sleep", "600"], granted_at=now - timedelta(seconds=60))
    lease.refresh_from_db()
    EvidenceInterval.objects.create(
        lease=lease,
        node=node,
        node_incarnation=node.incarnation,
        fencing_token=lease.fencing_token,
        started_at=now - timedelta(seconds=5),
        last_seen_at=now - timedelta(seconds=1),
    )
    drain = outofservice.take_out_of_service(
        node=node, owner=outofservice.AUTOSCALER, policy="checkpoint", reason="scale-down", timeout=30
    )
    # The workload answered the drain's checkpoint request: the next evaluation revokes the lease.
    Lease.objects.filter(pk=lease.pk).update(checkpoint_requested_at=None, workload_state="checkpointed")
    report_holds_rows = threading.Event()
    record_status_report = evidence.record_status_report

    def record_then_wait_for_the_drain(**kwargs):
        record_status_report(**kwargs)
        report_holds_rows.set()  # the report's writes so far are uncommitted: their rows stay locked
        deadline = time.monotonic() + 5
        while not _someone_waits_for_a_row_lock() and time.monotonic() < deadline:
            time.sleep(0.01)

    monkeypatch.setattr(evidence, "record_status_report", record_then_wait_for_the_drain)
    reported = [{"lease_id": str(lease.pk), "fencing_token": lease.fencing_token}]

    def racer(i):
        if i == 0:
            reporting = Node.objects.select_related("pool").get(pk=node.pk)
            return reconcile_heartbeat(
                reporting, incarnation=node.incarnation, reported=reported, restarted=False, actor=Actor.system("t")
            )
        assert report_holds_rows.wait(10)
        return drains.evaluate_drain(drain_id=drain.pk, actor=Actor.system(outofservice.AUTOSCALER))

    outcome = race(racer, 2, timeout=30)
    assert outcome.errors == [], outcome.errors
    lease.refresh_from_db()
    assert lease.state == "revoked"
    assert EvidenceInterval.objects.get(lease=lease).closed_at is not None
