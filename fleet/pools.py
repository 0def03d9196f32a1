"""Pools (writes): create, update (labels, taints and reservations reach the member nodes),
delete; the capacity inventory each member node derives from its pool's reservations.

Each service runs ``atomic()`` → lock or compare-and-swap → check version → change → save →
:func:`fleet.events.record_event`, and raises :class:`nodepool.api.problems.Problem` subclasses
with stable codes (split from fleet.services, issue 28 step 8).
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F, Value
from django.db.models.functions import Greatest
from django.utils import timezone

from nodepool.api.problems import Conflict, NotFound, Problem
from nodepool.api.versioning import check_version

from . import event_types
from . import taints as taint_times
from .capability import CapabilityError
from .errors import (
    INVALID_POOL_POLICY,
    POOL_EXISTS,
    POOL_HAS_NODES,
    POOL_NOT_FOUND,
)
from .events import Actor, event_row, record_event
from .models import Node, NodeEvent, NodeResource, Pool
from .policy import check_pool

# --- pools -----------------------------------------------------------------------------------


def _validate_pool(pool: Pool) -> None:
    try:
        check_pool({f.attname: getattr(pool, f.attname) for f in Pool._meta.concrete_fields})
    except CapabilityError as exc:
        raise Problem(exc.message, INVALID_POOL_POLICY, errors=[{"field": exc.field, "message": exc.message}]) from exc


def pool_create(*, values: dict[str, Any]) -> Pool:
    """Create a pool from already parsed values (canonical units). Raises 400 ``invalid_pool_policy``."""
    pool = Pool(**values)
    _validate_pool(pool)
    if Pool.objects.filter(name=pool.name).exists():
        raise Conflict(f"A pool named {pool.name!r} exists.", POOL_EXISTS)
    pool.save()
    return pool


def pool_update(*, pool_id: int, expected_version: int, changes: dict[str, Any], actor: Actor) -> Pool:
    """Change pool policy with optimistic concurrency; reservation changes recompute allocatable.

    Raises:
        NotFound (404), PreconditionFailed (412 ``version_mismatch``), Problem (400 ``invalid_pool_policy``).
    """
    with transaction.atomic():
        # FOR NO KEY UPDATE: a node action or a grant inserting a row that names the pool (an
        # event, a lease) takes FOR KEY SHARE on it while it holds its node; FOR UPDATE would make
        # it wait here while this waits for its node below (a deadlock).
        pool = Pool.objects.select_for_update(no_key=True).filter(pk=pool_id).first()
        if pool is None:
            raise NotFound("No such pool.", POOL_NOT_FOUND)
        check_version(pool.version, expected_version)
        old_reservations, old_labels, old_taints = pool.reservations, pool.labels, pool.taints
        for name, value in changes.items():
            setattr(pool, name, value)
        _validate_pool(pool)
        pool.version += 1
        pool.save(update_fields=[*changes, "version", "updated_at"])
        reservations_changed = "reservations" in changes and changes["reservations"] != old_reservations
        if reservations_changed or pool.labels != old_labels or pool.taints != old_taints:
            # Every member node before any of its rows, in one order: a grant holds its node, then
            # updates the node's resources; recomputing them first would be the opposite order.
            lock_members(pool)
        if reservations_changed:
            node_resources_recompute(pool=pool, actor=actor)
        if pool.labels != old_labels or pool.taints != old_taints:
            nodes_apply_pool_labels(pool=pool, old_labels=old_labels, old_taints=old_taints, actor=actor)
    return pool


def lock_members(pool: Pool) -> None:
    """Lock every node of ``pool`` (``FOR NO KEY UPDATE``, in primary-key order, as every
    multi-node lock does). Call inside a transaction, before touching rows that hang off them."""
    list(Node.objects.select_for_update(no_key=True).filter(pool=pool).order_by("pk").values_list("pk", flat=True))


def nodes_apply_pool_labels(*, pool: Pool, old_labels: dict, old_taints: list, actor: Actor) -> int:
    """Carry a change of the pool's labels and taints to every member's platform labels and taints.

    A label or taint the pool used to apply is removed from a node only where the node still has
    the pool's old value (an operator's own change on that node is kept); the pool's new labels and
    taints are then applied. Row by row (JSON merge), one ``policy`` event per node changed.
    Returns the number of nodes changed. Call inside the transaction that changed the pool.
    """
    changed = 0
    now = timezone.now()
    nodes = (
        Node.objects.select_for_update(no_key=True)
        .filter(pool=pool)
        .order_by("pk")
        .only("pk", "labels", "taints", "taints_added_at", "version")
    )
    for node in nodes:
        labels = {k: v for k, v in (node.labels or {}).items() if old_labels.get(k) != v or k in pool.labels}
        labels.update(pool.labels or {})
        taints = [t for t in (node.taints or []) if t not in old_taints and t not in pool.taints]
        taints = [*pool.taints, *taints]
        if labels == node.labels and taints == node.taints:
            continue
        Node.objects.filter(pk=node.pk).update(
            labels=labels, taints=taints, taints_added_at=taint_times.stamp(node.taints_added_at, taints, now),
            version=F("version") + 1,
        )  # fmt: skip
        record_event(node, event_types.POLICY, actor, reason="pool labels or taints changed",
                     data={"labels": labels, "taints": taints})  # fmt: skip
        changed += 1
    return changed


def pool_delete(*, pool_id: int, expected_version: int) -> None:
    """Delete an empty pool. Raises 404, 412, or 409 ``pool_has_nodes``."""
    with transaction.atomic():
        pool = Pool.objects.select_for_update().filter(pk=pool_id).first()
        if pool is None:
            raise NotFound("No such pool.", POOL_NOT_FOUND)
        check_version(pool.version, expected_version)
        if pool.nodes.exists():
            raise Conflict("The pool still has nodes; retire and remove them first.", POOL_HAS_NODES)
        pool.delete()


def node_resources_recompute(*, pool: Pool, actor: Actor | None = None) -> int:
    """Apply ``pool``'s reservations to every node's inventory: ``allocatable = max(0, capacity - reserved)``.

    Set-based: one UPDATE per reserved resource plus one for the rest; ``allocated`` is untouched
    (a node whose allocatable drops below allocated shows as overcommitted, its leases stay).
    Records one ``policy`` event per node in the pool. Returns the number of inventory rows changed.
    Call inside the transaction that changed the reservations.
    """
    actor = actor or Actor.system("fleet.node_resources_recompute")
    totals = pool.reserved_totals()
    rows = NodeResource.objects.filter(node__pool=pool)
    changed = rows.exclude(name__in=list(totals)).update(reserved=0, allocatable=F("capacity"))
    for name, reserved in totals.items():
        changed += rows.filter(name=name).update(
            reserved=reserved, allocatable=Greatest(F("capacity") - Value(reserved), Value(0))
        )
    node_ids = list(pool.nodes.values_list("pk", flat=True))
    Node.objects.filter(pk__in=node_ids).update(version=F("version") + 1)
    NodeEvent.objects.bulk_create(
        [
            event_row(node_id, event_types.POLICY, actor, reason="pool reservations changed", data={"reserved": totals})
            for node_id in node_ids
        ]
    )
    return changed


def node_inventory_set(*, node: Node, resources: dict[str, int]) -> None:
    """Set the capacity inventory of ``node`` from ``resources`` (verified, canonical ints).

    Reserved comes from the pool's reservations; ``allocated`` of existing rows is kept (a node
    returning from maintenance may still hold accounting from leases being reconciled); a resource
    no longer verified keeps its row at capacity 0 so that its allocation stays visible.
    """
    reserved = node.pool.reserved_totals()
    existing = {r.name: r for r in NodeResource.objects.filter(node=node)}
    for name, capacity in resources.items():
        r = reserved.get(name, 0)
        row = existing.pop(name, None) or NodeResource(node=node, name=name)
        row.capacity, row.reserved, row.allocatable = capacity, r, max(0, capacity - r)
        row.save()
    for row in existing.values():
        row.capacity, row.allocatable = 0, 0
        row.save(update_fields=["capacity", "allocatable"])
