"""The device part of a status report locks the node row before its device rows (issue 27), the
order every other node and device writer takes (an operator's device action, the grant's hold of
its node): a report that locked devices first and then waited for the node deadlocked with them.

PostgreSQL row locks: another transaction holds the node (as an operator's device action does
first); the report waits for it, and while it waits it must hold none of the node's device rows —
a third connection takes them with ``NOWAIT``. With the old order the report holds every device
row while it waits, and the ``NOWAIT`` fails.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import DatabaseError, connection, connections, transaction

from fleet.models import Device, Node
from tests.device_support import gpus, make_gpu_node, report_devices
from tests.factories import PoolFactory

errors: list = []


def _in_thread(target) -> threading.Thread:
    def run():
        try:
            target()
        except BaseException as exc:  # shown by the test's assertion
            errors.append(exc)
            raise
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _waiting_on_locks() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")  # else one snapshot per transaction
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_a_device_report_waits_for_the_node_before_it_locks_any_device():
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite serialises every writing transaction")
    node, _ = make_gpu_node(PoolFactory(name="gpu"), count=2)
    outcome: dict = {}

    def report():
        outcome["report"] = report_devices(node, gpus(2, node="n", driver_version="560.1"))

    def probe():
        try:
            with transaction.atomic():
                outcome["probed"] = len(
                    list(Device.objects.select_for_update(nowait=True, of=("self",)).filter(node=node).order_by("pk"))
                )
        except DatabaseError as exc:
            outcome["probed"] = exc

    with transaction.atomic():
        Node.objects.select_for_update(no_key=True).get(pk=node.pk)  # another writer holds the node
        reporter = _in_thread(report)
        deadline = time.monotonic() + 20
        while not _waiting_on_locks() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _waiting_on_locks(), f"the report never waited for the node: {errors!r}"
        _in_thread(probe).join(20)
    reporter.join(20)
    assert outcome["probed"] == 2, f"the waiting report held device rows: {outcome['probed']!r}"
    assert outcome["report"]["changed"]
    assert set(Device.objects.filter(node=node).values_list("driver_version", flat=True)) == {"560.1"}
