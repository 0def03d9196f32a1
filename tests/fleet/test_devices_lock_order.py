"""The device part of a status report locks the node row before its device rows (issue 27), the
order every other node and device writer takes (an operator's device action, the grant's hold of
its node): a report that locked devices first and then waited for the node deadlocked with them.

PostgreSQL row locks: another transaction holds the node (as an operator's device action does
first); the report waits for it, and while it waits it must hold none of the node's device rows —
a third connection takes them with ``NOWAIT``. With the old order the report holds every device
row while it waits, and the ``NOWAIT`` fails.
"""

from __future__ import annotations

import re

import pytest
from django.db import DatabaseError, connection, transaction

from fleet.models import Device, Node
from tests.device_support import gpus, make_gpu_node, report_devices
from tests.factories import PoolFactory
from tests.races import in_thread, wait_until_waiting_on_locks

errors: list = []


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
        reporter = in_thread(report, errors)
        assert wait_until_waiting_on_locks(), f"the report never waited for the node: {errors!r}"
        in_thread(probe, errors).join(20)
    reporter.join(20)
    assert outcome["probed"] == 2, f"the waiting report held device rows: {outcome['probed']!r}"
    assert outcome["report"]["changed"]
    assert set(Device.objects.filter(node=node).values_list("driver_version", flat=True)) == {"560.1"}


def _device_locks(queries) -> list[str]:
    """The statements that lock device rows (``SELECT … FROM "fleet_device" … FOR [NO KEY] UPDATE``)."""
    return [
        q["sql"]
        for q in queries
        if re.search(r'FROM "fleet_device"', q["sql"]) and re.search(r"FOR (NO KEY )?UPDATE", q["sql"])
    ]


def _locks_another_table(sql: str) -> bool:
    """True when the lock reaches past the device rows: ``OF`` names another table, or a join
    (the model's ordering by node, a select_related) without ``OF`` locks the joined rows too."""
    of = re.search(r"FOR (?:NO KEY )?UPDATE OF (.+?)(?: NOWAIT| SKIP LOCKED)?$", sql)
    if of:
        return of.group(1).strip() != '"fleet_device"'
    return " JOIN " in sql


@pytest.mark.django_db
def test_every_device_lock_takes_device_rows_only_never_the_node(client_user):
    """Device's ordering starts with ``node``, which joins the node table: a ``select_for_update``
    with that ordering and no ``of=("self",)`` locks the node row as well, after the device rows
    — against the order node first, then devices, that every device writer takes. Each path that
    locks devices (status report, operator action, recovery sweep, a lease's release) is
    captured; every device lock is ``OF "fleet_device"`` or has no join."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite serialises every writing transaction")
    from datetime import timedelta

    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from fleet.device_actions import device_taint, recover_devices
    from fleet.events import Actor
    from leases import devices as lease_devices
    from tests.device_support import gpu
    from tests.support import grant

    pool = PoolFactory(name="gpu")
    node, _ = make_gpu_node(pool, count=2)
    lease = grant(client_user, "two", pool="gpu", resources={"nvidia.com/gpu": 1})
    with CaptureQueriesContext(connection) as queries:
        report_devices(node, [gpu(0, driver_version="560.1"), gpu(1, health={"ecc_uncorrectable": 3})])
        device_taint(node_id=node.pk, device_id="GPU-n-0000", key="example.com/check", effect="NoSchedule",
                     reason="bench", actor=Actor.system("t"))  # fmt: skip
        assert recover_devices(now=timezone.now() + timedelta(hours=2)) >= 1
        with transaction.atomic():
            assert lease_devices.release(lease.pk) == 1
    locks = _device_locks(queries.captured_queries)
    assert len(locks) >= 4, locks
    assert [sql for sql in locks if _locks_another_table(sql)] == []
