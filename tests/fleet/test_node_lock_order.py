"""A node's report about its lease and an operator's action on the node, at the same moment, on
PostgreSQL: no deadlock.

CI's PostgreSQL run once saw ``POST /node-leases/{id}/events`` (a checkpoint report) answered 503:
the report held the lease row and inserted an event referencing the node (PostgreSQL takes
``FOR KEY SHARE`` on the node row for the foreign key), while a preemption held the node row
``FOR UPDATE`` and waited for the lease row. Every product lock on a node or lease row is now
``FOR NO KEY UPDATE`` (it still excludes every other writer and ``FOR SHARE``, but not a foreign-key
check), so the report finishes and the action goes on after it.

A status report and a drain take a node's lease rows all at once, oldest first, then the leases'
evidence rows: the report once took evidence first, then its listed leases before its unlisted
ones, and deadlocked with a drain either way. A grant takes the workload's fencing row before its
queued request's row, as a direct grant (which cancels the workload's requeued request) does.
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
from tests.maintenance_support import make_lease
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


def _wait_until_another_transaction_waits_for_a_lock(seconds: float = 5) -> None:
    """Hold this racer (and the row locks its transaction has) until the other racer is blocked."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            if cursor.fetchone()[0]:
                return
        time.sleep(0.01)


def _status_report_races_a_drain(node, lease, drain, report_inside: threading.Event):
    """A status report listing ``lease``, and ``drain``'s evaluation once ``report_inside`` is set."""
    reported = [{"lease_id": str(lease.pk), "fencing_token": lease.fencing_token}]

    def racer(i):
        if i == 0:
            reporting = Node.objects.select_related("pool").get(pk=node.pk)
            return reconcile_heartbeat(
                reporting, incarnation=node.incarnation, reported=reported, restarted=False, actor=Actor.system("t")
            )
        assert report_inside.wait(10)
        return drains.evaluate_drain(drain_id=drain.pk, actor=Actor.system(outofservice.AUTOSCALER))

    return race(racer, 2, timeout=30)


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
        _wait_until_another_transaction_waits_for_a_lock()

    monkeypatch.setattr(evidence, "record_status_report", record_then_wait_for_the_drain)
    outcome = _status_report_races_a_drain(node, lease, drain, report_holds_rows)
    assert outcome.errors == [], outcome.errors
    lease.refresh_from_db()
    assert lease.state == "revoked"
    assert EvidenceInterval.objects.get(lease=lease).closed_at is not None


def test_a_status_report_with_an_unlisted_older_lease_and_a_drain_both_complete(monkeypatch):
    """The report writes the lease it lists, then the older one it does not list; the drain locks
    both oldest first. Locked one by one, each held one and waited for the other."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite serialises writers")
    from django.db.models import F

    from leases import reconcile

    node, _ = make_schedulable_node()
    older, newer = make_lease(node, "old-1", resources={"cpu": 500}), make_lease(node, "new-1", resources={"cpu": 500})
    now = timezone.now()
    for lease, age in ((older, 120), (newer, 60)):
        Lease.objects.filter(pk=lease.pk).update(command=["sleep", "600"], granted_at=now - timedelta(seconds=age))
    drain = outofservice.take_out_of_service(
        node=node, owner=outofservice.AUTOSCALER, policy="wait", reason="scale-down", timeout=300
    )
    listed_written = threading.Event()

    def f_then_wait_for_the_drain(name, *args, **kwargs):
        if name == "missed_reports":  # built between the listed leases' UPDATE and the unlisted ones'
            listed_written.set()
            _wait_until_another_transaction_waits_for_a_lock()
        return F(name, *args, **kwargs)

    monkeypatch.setattr(reconcile, "F", f_then_wait_for_the_drain)
    outcome = _status_report_races_a_drain(node, newer, drain, listed_written)
    assert outcome.errors == [], outcome.errors
    assert Lease.objects.get(pk=older.pk).missed_reports == 1


def test_a_queue_pass_and_the_clients_own_grant_of_a_requeued_workload_both_complete(client_user, monkeypatch):
    """The pass places the workload's requeued request while its client asks for it directly (a
    grant cancels the workload's requeued request): one lease, no deadlock."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite serialises writers")
    from leases import kick, requeue, services
    from leases.models import LeaseRequest
    from leases.reconcile import revoke_lease
    from leases.sql import grant as grant_sql
    from leases.sweeps import place_pending_requests
    from tests.factories import PoolFactory

    make_schedulable_node(PoolFactory(name="general"), resources={"cpu": 8000, "memory": 2**34})
    monkeypatch.setattr(kick, "kick_queue", lambda: None)  # this test runs the pass itself
    body = {"workload_id": "job-2", "pool": "general", "resources": {"cpu": "1"}}
    old, _ = services.lease_create(data=body, client=client_user, actor=Actor.system("t"))
    revoke_lease(old, actor=Actor.system("t"), reason="preempted")
    old.refresh_from_db()
    request = requeue.requeue_lease(old, pool=None, actor=Actor.system("t"), reason="spot preemption", now=old.ended_at)
    assert request.state == "pending"
    pass_inside, next_fencing_token = threading.Event(), grant_sql.next_fencing_token

    def fencing_token_once_the_grant_waits(workload_id):
        if threading.current_thread().name == "racer-0":  # the pass, with what it has locked so far
            pass_inside.set()
            _wait_until_another_transaction_waits_for_a_lock()
        return next_fencing_token(workload_id)

    monkeypatch.setattr(grant_sql, "next_fencing_token", fencing_token_once_the_grant_waits)

    def racer(i):
        if i == 0:
            return place_pending_requests()
        assert pass_inside.wait(10)
        return services.lease_create(data=body, client=client_user, actor=Actor.system("client"))[1]

    outcome = race(racer, 2, timeout=30)
    assert outcome.errors == [], outcome.errors
    assert Lease.objects.filter(workload_id="job-2", state__in=["granted", "active"]).count() == 1
    assert LeaseRequest.objects.get(pk=request.pk).state in ("placed", "cancelled")
