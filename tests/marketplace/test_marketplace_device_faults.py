"""Item 9 of the devices issue: a lease's execution evidence records its devices and their health
while it ran, and a device fault that tainted a lease's device puts its usage up for review (the
``device_fault`` finding flags the statement line, which holds the payout)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine

from fleet import devices as fleet_devices
from fleet.events import Actor
from fleet.models import Node
from leases.fencing import lease_release
from leases.models import EvidenceInterval, Lease
from leases.services import lease_create
from marketplace.choices import HoldReason, UsageState
from marketplace.models import PayoutHold, Statement, UsageRecord
from marketplace.reconciliation import reconcile_usage
from marketplace.statements import finalize_statement
from tests.device_support import gpus, make_gpu_node
from tests.heartbeat_support import send
from tests.marketplace_support import ACTOR, at, priced_pool

pytestmark = pytest.mark.django_db
FATAL = {"xid_events": [{"xid": 79, "at": "2026-11-02T10:00:35Z", "message": "GPU has fallen off the bus"}]}


@pytest.fixture
def gpu_node(owner):
    with time_machine.travel(at(-60), tick=False):
        node, _ = make_gpu_node(priced_pool(), count=2)
    Node.objects.filter(pk=node.pk).update(owner=owner, labels={"name": "g"})
    node.refresh_from_db()
    return node


class GpuReporter:
    """Status reports listing leases and carrying the node's two GPUs (one possibly faulted)."""

    def __init__(self, node):
        self.node = node
        self.sequence = Node.objects.get(pk=node.pk).sequence

    def report(self, seconds, leases, *, bad: str | None = None):
        self.sequence += 1
        devices = [{**d, "health": FATAL} if d["id"] == bad else d for d in gpus(2)]
        parsed, refusals = fleet_devices.parse_devices(devices)
        listed = [{"lease_id": str(x.pk), "fencing_token": x.fencing_token, "state": "running"} for x in leases]
        with time_machine.travel(at(seconds), tick=False):
            send(
                self.node, self.sequence, leases=listed, usage={"cpu": 1000, "memory": 2**30, "nvidia.com/gpu": 1},
                devices=parsed, device_refusals=refusals, boot_id="boot-1",
            )  # fmt: skip


def grant_gpu(client_user, node, workload_id, **extra):
    body = {
        "workload_id": workload_id, "pool": node.pool.name, "node_selector": {"name": "g"},
        "resources": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": 1}, "command": ["sleep", "3600"],
        "ttl_seconds": 86400, **extra,
    }  # fmt: skip
    with time_machine.travel(at(0), tick=False):
        lease, status = lease_create(data=body, client=client_user, actor=ACTOR)
    assert status == 201, lease
    return Lease.objects.get(pk=lease.pk)


def release_at(seconds, lease, client_user):
    with time_machine.travel(at(seconds), tick=False):
        lease_release(
            lease_id=lease.pk,
            data={"fencing_token": lease.fencing_token, "node_incarnation": lease.node_incarnation},
            user=client_user,
            actor=ACTOR,
        )
    record = UsageRecord.objects.get(lease=lease)
    return reconcile_usage(record.pk, actor=ACTOR, now=record.ended_at + timedelta(seconds=1000))


def test_evidence_records_the_leases_devices_and_healthy_usage_is_not_flagged(gpu_node, client_user):
    lease = grant_gpu(client_user, gpu_node, "ok")
    reporter = GpuReporter(gpu_node)
    for t in (10, 20, 30):
        reporter.report(t, [lease])
    interval = EvidenceInterval.objects.get(lease=lease)
    device_id = lease.devices[0]["id"]
    assert interval.devices == [
        {"id": device_id, "type": "nvidia.com/gpu", "model": "NVIDIA H100 80GB HBM3", "health": "healthy",
         "worst": "healthy"}
    ]  # fmt: skip
    record = release_at(35, lease, client_user)
    assert record.state == UsageState.RECONCILED
    assert "device_fault" not in {f["code"] for f in record.findings}


def test_a_fault_the_lease_rides_out_is_in_its_evidence_and_flags_its_usage(gpu_node, client_user, owner):
    lease = grant_gpu(client_user, gpu_node, "tolerant", tolerations=[{"operator": "Exists"}])
    device_id = lease.devices[0]["id"]
    reporter = GpuReporter(gpu_node)
    reporter.report(10, [lease])
    reporter.report(20, [lease], bad=device_id)  # falls off the bus; the lease tolerates it
    reporter.report(30, [lease])
    assert Lease.objects.get(pk=lease.pk).state == "granted"
    (entry,) = EvidenceInterval.objects.get(lease=lease).devices
    assert (entry["id"], entry["health"], entry["worst"]) == (device_id, "unhealthy", "unhealthy")
    assert entry["faulted_at"] == at(20).isoformat()
    record = release_at(35, lease, client_user)
    # still paid for its evidenced time, but up for review
    assert record.state == UsageState.RECONCILED and record.billable_seconds == 20
    (finding,) = [f for f in record.findings if f["code"] == "device_fault"]
    assert device_id in finding["message"]
    statement = Statement.objects.get(owner=owner)
    with time_machine.travel(at(86400 * 40), tick=False):
        finalize_statement(statement_id=statement.pk, expected_version=statement.version, actor=Actor.system("t"))
    hold = PayoutHold.objects.get(statement=statement, reason=HoldReason.FLAGGED_LINE)
    assert hold.detail["lines"][0]["findings"] == ["device_fault"]


def test_a_fault_that_evicts_the_lease_flags_its_usage_through_the_fault_event(gpu_node, client_user):
    lease = grant_gpu(client_user, gpu_node, "evicted")
    device_id = lease.devices[0]["id"]
    reporter = GpuReporter(gpu_node)
    reporter.report(10, [lease])
    reporter.report(20, [lease])
    reporter.report(30, [lease], bad=device_id)  # NoExecute: revoked and requeued at once
    lease.refresh_from_db()
    assert lease.state == "revoked"
    # the interval closed before this report's evidence: its devices were healthy when last seen
    assert EvidenceInterval.objects.get(lease=lease).devices[0]["worst"] == "healthy"
    record = UsageRecord.objects.get(lease=lease)
    record = reconcile_usage(record.pk, actor=ACTOR, now=record.ended_at + timedelta(seconds=1000))
    assert [f["code"] for f in record.findings if f["code"] == "device_fault"] == ["device_fault"]
    assert record.billable_seconds == 10
