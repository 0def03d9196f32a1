"""Helpers for the marketplace tests: a priced pool, an owner's node, leases and status reports
at chosen times (time-machine moves the clock; heartbeats go through the real service)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import time_machine

from fleet.events import Actor
from fleet.models import Node
from leases.services import lease_create
from tests.factories import PoolFactory, make_schedulable_node
from tests.heartbeat_support import send

ACTOR = Actor.system("test")
# Monday 2 November 2026, 10:00 UTC: inside one calendar month and one ISO week.
T0 = datetime(2026, 11, 2, 10, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def priced_pool(name: str = "market", *, cpu: str = "0.60", memory: str = "0.01", currency: str = "EUR"):
    """A pool with 10 s heartbeats, 40 s grace, 300 s loss threshold, and prices from before T0."""
    from marketplace.pricing import set_price

    pool = PoolFactory(name=name)
    set_price(
        pool=pool, resource="cpu", unit_price=Decimal(cpu), currency=currency, effective_from=T0 - timedelta(days=30)
    )
    set_price(
        pool=pool,
        resource="memory",
        unit_price=Decimal(memory),
        currency=currency,
        effective_from=T0 - timedelta(days=30),
    )
    return pool


def owned_node(pool, owner, name: str = "", **fields):
    """A schedulable node of ``owner``, labelled ``name=<name>`` so leases can be placed on it."""
    node, secret = make_schedulable_node(pool, labels={"name": name or f"n{Node.objects.count()}"}, **fields)
    Node.objects.filter(pk=node.pk).update(owner=owner)
    node.refresh_from_db()
    return node, secret


def grant_at(seconds: float, client_user, pool, workload_id: str, *, cpu="2", memory="1Gi", ttl=86400, node=None):
    """A lease granted at ``T0 + seconds`` (on ``node`` when given: by its ``name`` label)."""
    with time_machine.travel(at(seconds), tick=False):
        body = {
            "workload_id": workload_id,
            "pool": pool.name,
            "resources": {"cpu": cpu, "memory": memory},
            "command": ["sleep", "3600"],
            "ttl_seconds": ttl,
        }
        if node is not None:
            body["node_selector"] = {"name": node.labels["name"]}
        lease, status = lease_create(data=body, client=client_user, actor=ACTOR)
    assert status == 201, lease
    return lease


class Reporter:
    """Sends a node's status reports (heartbeats) at chosen times, keeping its sequence."""

    def __init__(self, node, incarnation: int = 1):
        self.node = node
        self.incarnation = incarnation
        self.sequence = Node.objects.get(pk=node.pk).sequence

    def report(self, seconds: float, leases, *, usage=None, incarnation: int | None = None, token=None):
        if incarnation is not None:
            self.incarnation = incarnation
        self.sequence += 1
        listed = [
            {
                "lease_id": str(lease.pk),
                "fencing_token": token if token is not None else lease.fencing_token,
                "state": "running",
            }
            for lease in leases
        ]
        with time_machine.travel(at(seconds), tick=False):
            return send(
                self.node,
                self.sequence,
                self.incarnation,
                leases=listed,
                usage=usage if usage is not None else {"cpu": 2500, "memory": 2**30},
            )

    def every(self, start: float, end: float, leases, step: float = 10, **kwargs):
        """Reports at start, start+step, … up to and including end."""
        t = start
        while t <= end:
            self.report(t, leases, **kwargs)
            t += step
