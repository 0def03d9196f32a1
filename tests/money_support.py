"""Helpers for the marketplace money tests (pool periods, payouts, holds, line appeals): usage
records settled as reconciliation would leave them, and availability evidence, at chosen times."""

from __future__ import annotations

from datetime import datetime

import time_machine

from leases.fencing import lease_release
from leases.services import lease_create
from marketplace import statements
from marketplace.models import NodeAvailability, OwnerSettings, PoolSettlement, UsageRecord
from tests.marketplace_support import ACTOR


def settled_usage(
    client_user,
    pool,
    node,
    start: datetime,
    end: datetime,
    *,
    billable: list[tuple[datetime, datetime]] | None = None,
    cpu: str = "2",
    memory: str = "1Gi",
    state: str = "reconciled",
    findings: list[dict] | None = None,
    adjustment: dict | None = None,
) -> UsageRecord:
    """A lease on ``node`` granted at ``start`` and released at ``end``, whose usage record is then
    settled to ``state`` with ``billable`` intervals (default: the whole lease), and its line refreshed."""
    with time_machine.travel(start, tick=False):
        body = {
            "workload_id": f"job-{node.labels['name']}-{start:%d%H%M%S}",
            "pool": pool.name,
            "resources": {"cpu": cpu, "memory": memory},
            "command": ["sleep", "3600"],
            "ttl_seconds": 86400 * 3,
            "node_selector": {"name": node.labels["name"]},
        }
        lease, status = lease_create(data=body, client=client_user, actor=ACTOR)
    assert status == 201, lease
    with time_machine.travel(end, tick=False):
        lease_release(
            lease_id=lease.pk,
            data={"fencing_token": lease.fencing_token, "node_incarnation": 1, "outcome": "succeeded"},
            user=client_user,
            actor=ACTOR,
        )
    record = UsageRecord.objects.get(lease_id=lease.pk)
    intervals = billable or [(start, end)]
    seconds = sum((b - a).total_seconds() for a, b in intervals)
    UsageRecord.objects.filter(pk=record.pk).update(
        state=state,
        billable_intervals=[[a.isoformat(), b.isoformat()] for a, b in intervals],
        billable_seconds=seconds,
        allocated_seconds=(end - start).total_seconds(),
        evidenced_seconds=seconds,
        findings=findings or [],
        adjustment=adjustment or {},
        reconciled_at=end,
    )
    record = UsageRecord.objects.select_related("pool").get(pk=record.pk)
    statements.refresh_line(record)
    return record


def offered(node, start: datetime, end: datetime, allocatable: dict | None = None) -> NodeAvailability:
    """A closed availability interval ``[start, end]`` of ``node`` (as status reports would leave it)."""
    return NodeAvailability.objects.create(
        node=node,
        pool_id=node.pool_id,
        owner_id=node.owner_id,
        incarnation=1,
        node_version=node.version,
        allocatable=allocatable or {"cpu": 8000, "memory": 32 * 2**30},
        started_at=start,
        last_seen_at=end,
        ended_at=end,
        end_reason="cut",
    )


def daily(pool, *owners, idle_paid: bool = False) -> None:
    """Day periods for ``pool`` and day statements for ``owners``."""
    PoolSettlement.objects.update_or_create(pool=pool, defaults={"period": "day", "idle_paid": idle_paid})
    for owner in owners:
        OwnerSettings.objects.update_or_create(owner=owner, defaults={"statement_period": "day"})
