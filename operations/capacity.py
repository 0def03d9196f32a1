"""Capacity readings pool operations need: schedulable counts, the Ready ratio against the pool's
objective (``Pool.ready_ratio_objective``, the observability SLO), and whether a node made from
a template would fit a request (the autoscaler's bin count; the public dry run of placement is
``leases.preview``, over existing nodes).
"""

from __future__ import annotations

from django.db.models import Q, Sum

from fleet.choices import Lifecycle, Liveness
from fleet.models import Node, NodeResource, Pool
from fleet.selectors import IN_SERVICE_LIFECYCLES, SCHEDULABLE_HEALTH
from leases import placement
from leases.spec import PlacementSpec

from .models import PoolOperations

# Schedulable but for the credential check (fleet.selectors.schedulable_q): ready, no cordon hold,
# alive, reporting ready, healthy.
AVAILABLE = Q(
    lifecycle=Lifecycle.READY, cordoned=False, liveness=Liveness.ALIVE, ready=True, health__in=SCHEDULABLE_HEALTH
)


def member_nodes(pool: Pool):
    """Nodes that count as the pool's members (everything but retired)."""
    return Node.objects.filter(pool=pool).exclude(lifecycle=Lifecycle.RETIRED)


def ready_ratio(pool: Pool, *, exclude_node_ids=()) -> float | None:
    """The Node Ready SLI of ``pool`` (the rule of ``fleet.selectors.pool_capacity`` and of the
    exported ``nodepool_nodes_ready / nodepool_nodes_in_service``): in-service nodes (lifecycle
    ready — cordoned or not — or draining) that are alive and report ready, over in-service nodes;
    leaving out ``exclude_node_ids`` (nodes an operation took out on purpose). None for a pool
    with no node in service.

    Cordons (by people or by other operations' holds) do not lower it: an upgrade's Ready gate
    pausing on one operator cordon in a small pool was a bug (issue #34).
    """
    in_service = Node.objects.filter(pool=pool, lifecycle__in=IN_SERVICE_LIFECYCLES).exclude(
        pk__in=list(exclude_node_ids)
    )
    total = in_service.count()
    if not total:
        return None
    return in_service.filter(liveness=Liveness.ALIVE, ready=True).count() / total


def ready_ratio_objective(pool: Pool) -> float | None:
    """The pool's Ready SLO (fraction 0..1), or None when the pool has none."""
    value = pool.ready_ratio_objective
    return float(value) if value is not None else None


def allocatable_by_node(pool: Pool, node_ids) -> dict[str, dict[str, int]]:
    """``{node_id: {resource: allocatable}}`` for ``node_ids``."""
    result: dict[str, dict[str, int]] = {}
    for node_id, name, amount in NodeResource.objects.filter(node__pool=pool, node_id__in=list(node_ids)).values_list(
        "node_id", "name", "allocatable"
    ):
        result.setdefault(str(node_id), {})[name] = amount
    return result


def pool_allocatable(pool: Pool) -> dict[str, int]:
    """Total allocatable of the pool's available nodes, per resource."""
    rows = NodeResource.objects.filter(node__in=member_nodes(pool).filter(AVAILABLE)).values("name")
    return {row["name"]: row["total"] for row in rows.annotate(total=Sum("allocatable"))}


def template_allocatable(pool: Pool, template: dict) -> dict[str, int]:
    """What a node made from ``template`` would offer: capacity minus the pool's reservations."""
    reserved = pool.reserved_totals()
    return {
        name: max(0, int(amount) - reserved.get(name, 0))
        for name, amount in ((template or {}).get("resources") or {}).items()
    }


def template_shapes(pool: Pool) -> list[dict[str, int]]:
    """The allocatable of the node the pool's autoscaler can add (``[]`` when it adds none): the
    growth source leases' "too large" verdict counts beside the pool's nodes (``leases.impossible``)."""
    ops = PoolOperations.objects.filter(pool=pool).first()
    if ops is None or not ops.provider or not ops.max_nodes or not (ops.node_template or {}).get("resources"):
        return []
    return [template_allocatable(pool, ops.node_template)]


def template_preview(pool: Pool, template: dict, spec: PlacementSpec) -> str | None:
    """Would an empty node made from ``template`` hold ``spec``? None if yes, else the reason code
    placement would give (untolerated taint, selector mismatch, insufficient_<resource>…).

    Uses the scheduler's own filters (:func:`leases.placement.constraint_failure` and
    :func:`leases.placement.resource_failure`) on an unsaved node.
    """
    template = template or {}
    features = dict(template.get("features") or {})
    node = Node(
        pool=pool,
        hostname="template",
        labels={**(pool.labels or {}), **(template.get("labels") or {})},
        taints=list(template.get("taints") or []),
        verified={"resources": dict(template.get("resources") or {}), "features": features},
    )
    # The group's live leases count: a template node in a topology domain an anti-affinity group
    # already holds would be launched for a request it could never take.
    counts = placement.group_counts(spec, pool) if spec.anti_affinity else placement.GroupCounts()
    failure = placement.constraint_failure(node, pool, spec, counts)
    if failure:
        return failure
    return placement.resource_failure(template_allocatable(pool, template), spec)


def scale_up_view(pool: Pool, spec: PlacementSpec) -> dict | None:
    """How ``pool`` can scale up for ``spec`` (the scale-up source of :mod:`leases.preview`): None
    when it does not autoscale (no provider, ``max_nodes`` 0, or no template resources); else
    ``{"max_nodes", "nodes_to_add": max_nodes − members (never below 0), "allocatable": a template
    node's, "failure": None | why an empty template node would not hold spec}``."""
    ops = PoolOperations.objects.filter(pool=pool).first()
    if ops is None or not ops.provider or not ops.max_nodes or not (ops.node_template or {}).get("resources"):
        return None
    return {
        "max_nodes": ops.max_nodes,
        "nodes_to_add": max(0, ops.max_nodes - member_nodes(pool).count()),
        "allocatable": template_allocatable(pool, ops.node_template),
        "failure": template_preview(pool, ops.node_template, spec),
    }
