"""factory-boy factories: the named cast every test file shares."""

from __future__ import annotations

import factory
from django.utils import timezone

from fleet.choices import Health, Liveness
from fleet.models import Node, NodeResource, Pool


class PoolFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Pool
        django_get_or_create = ("name",)

    name = factory.Sequence(lambda n: f"pool-{n}")
    description = "a test pool"


class NodeFactory(factory.django.DjangoModelFactory):
    """A pending node; see :func:`make_schedulable_node` for one that can take work."""

    class Meta:
        model = Node

    pool = factory.SubFactory(PoolFactory)
    hostname = factory.Sequence(lambda n: f"node-{n}.example.test")
    agent_version = "1.0.0"
    declared = factory.LazyFunction(
        lambda: {
            "resources": {"cpu": 8000, "memory": 32 * 2**30, "ephemeral-storage": 100 * 2**30},
            "features": {"arch": "amd64", "os": "linux"},
        }
    )


def set_lifecycle(node: Node, state: str) -> Node:
    """Force the protected lifecycle field for a test fixture (bypasses transitions on purpose)."""
    Node.objects.filter(pk=node.pk).update(lifecycle=state)
    node.refresh_from_db()
    return node


def place_test_hold(node: Node, owner: str = "user:someone", reason: str = "test hold") -> Node:
    """Cordon ``node`` with a hold of ``owner`` through the holds service; returns the node refreshed."""
    from maintenance.holds import place_hold

    place_hold(node, owner, reason)
    node.refresh_from_db()
    return node


def set_capacity(node: Node, resources: dict[str, int], reserved: dict[str, int] | None = None) -> None:
    """Give ``node`` capacity (canonical units) in its inventory and as verified capability."""
    reserved = reserved or {}
    for name, amount in resources.items():
        r = reserved.get(name, 0)
        NodeResource.objects.update_or_create(
            node=node, name=name, defaults={"capacity": amount, "reserved": r, "allocatable": max(0, amount - r)}
        )
    Node.objects.filter(pk=node.pk).update(
        verified={"resources": resources, "features": node.declared.get("features", {})}
    )


def make_schedulable_node(
    pool: Pool | None = None, *, resources: dict[str, int] | None = None, labels=None, taints=None, **fields
) -> tuple[Node, str]:
    """A ready, alive, healthy node with a valid credential. Returns ``(node, credential_secret)``."""
    from fleet.credentials import issue_credential

    node = NodeFactory(
        pool=pool or PoolFactory(),
        labels=labels or {},
        taints=taints or [],
        ready=True,
        liveness=Liveness.ALIVE,
        health=Health.HEALTHY,
        last_heartbeat_at=timezone.now(),
        **fields,
    )
    set_lifecycle(node, "ready")
    set_capacity(node, resources or {"cpu": 8000, "memory": 32 * 2**30})
    _, secret = issue_credential(node=node, issuer="test")
    node.refresh_from_db()
    return node, secret
