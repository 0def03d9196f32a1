"""A node's report about its lease and an operator's action on the node, at the same moment, on
PostgreSQL: no deadlock.

CI's PostgreSQL run once saw ``POST /node-leases/{id}/events`` (a checkpoint report) answered 503:
the report held the lease row and inserted an event referencing the node (PostgreSQL takes
``FOR KEY SHARE`` on the node row for the foreign key), while a preemption held the node row
``FOR UPDATE`` and waited for the lease row. Every product lock on a node or lease row is now
``FOR NO KEY UPDATE`` (it still excludes every other writer and ``FOR SHARE``, but not a foreign-key
check), so the report finishes and the action goes on after it.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from fleet.events import Actor
from leases import fencing
from maintenance import services as maintenance
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
