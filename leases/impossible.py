""" "No node could ever take this": one family of answers for a request larger than any node (issue 33 item 3).

A request is *too large* for a pool when no node of the pool (any lifecycle but retired or
rejected, whatever it holds now) has an allocatable that covers every requested resource at once,
and no node the pool can grow (the node templates registered by a higher app, e.g. the autoscaler's)
would either. Waiting does not help; only a different request or a bigger node does. The same
answer is given alike by

* the synchronous ``409 unschedulable``: ``cause: "too_large"`` and a ``too_large`` object;
* the queued request's ``422 impossible_request``: ``cause: "too_large"`` and the same object;
* the preview (``POST /pools/{name}/placement-preview``): ``unschedulable.cause == "too_large"``;
* the scale-up preview of pool operations, which calls :func:`verdict` on its template.

The ``too_large`` object (canonical units, as every amount in the API)::

    {"requested": {"cpu": 64000}, "largest": {"cpu": 32000}, "exceeds": ["cpu"],
     "nodes_considered": 3, "templates_considered": 0}

``largest`` is, per requested resource, the largest allocatable of any one node or template;
``exceeds`` the resources no node nor template has as much of (empty when each resource fits on
some node but no node has them all together).

"Fragmented" (``cause: "fragmented"``) is the opposite case: the pool's free capacity would fit in
total *and* some schedulable node that passes the request's constraints has an allocatable large
enough, so that freeing it would let the request in (:func:`leases.placement.diagnose`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from humanunits import quantity

TOO_LARGE = "too_large"  # leases.choices.UnschedulableCause.TOO_LARGE
IMPOSSIBLE_REQUEST = "impossible_request"  # the 422 code of a queued request that could never be placed

# Higher apps register how their pool could grow: ``source(pool) -> [{resource: allocatable}]``, one
# mapping per node shape a pool may add (operations: the autoscaling template). Connected in the
# higher app's AppConfig.ready(), so leases never imports it.
GrowthSource = Callable[[object], Iterable[dict[str, int]]]
_growth_sources: dict[str, GrowthSource] = {}


def register_growth_source(name: str, source: GrowthSource) -> None:
    """Declare node shapes a pool can add (idempotent per ``name``)."""
    _growth_sources[name] = source


def growth_shapes(pool) -> list[dict[str, int]]:
    """Every registered source's shapes for ``pool`` (allocatable per resource, canonical units)."""
    shapes: list[dict[str, int]] = []
    for source in _growth_sources.values():
        shapes.extend(dict(shape) for shape in source(pool) or ())
    return shapes


def declared_allocatable(declared: dict | None, reserved: dict[str, int]) -> dict[str, int]:
    """What a node still in admission would offer: its declared resources less the pool's reservations."""
    resources = (declared or {}).get("resources") or {}
    return {
        name: max(0, int(amount) - reserved.get(name, 0))
        for name, amount in resources.items()
        if isinstance(amount, int | float) and not isinstance(amount, bool)
    }


def holds(allocatable: dict[str, int], requested: dict[str, int]) -> bool:
    """Would a node with ``allocatable`` hold ``requested`` once empty (every resource at once)?"""
    return all(allocatable.get(name, 0) >= amount for name, amount in requested.items())


@dataclass(frozen=True)
class TooLarge:
    """The answer for a request no node nor template can ever hold."""

    pool: str
    requested: dict[str, int]
    largest: dict[str, int]
    nodes_considered: int
    templates_considered: int = 0
    exceeds: list[str] = field(default_factory=list)

    def detail(self) -> dict:
        """The ``too_large`` object of the 409, the 422 and the preview (canonical units)."""
        return {
            "requested": dict(self.requested),
            "largest": dict(self.largest),
            "exceeds": list(self.exceeds),
            "nodes_considered": self.nodes_considered,
            "templates_considered": self.templates_considered,
        }

    @property
    def message(self) -> str:
        """For a person: ``no node in pool 'general' is that large: the largest allocatable cpu is 32 (…)``."""
        where = "no node" if not self.templates_considered else "no node nor node template"
        if not self.nodes_considered and not self.templates_considered:
            return f"no node in pool {self.pool!r} could hold this request: the pool has no nodes"
        if self.exceeds:
            largest = ", ".join(
                f"the largest allocatable {name} is {quantity(name, self.largest.get(name, 0))} "
                f"(requested {quantity(name, self.requested[name])})"
                for name in self.exceeds
            )
            return f"{where} in pool {self.pool!r} is that large: {largest}"
        together = " and ".join(f"{name} {quantity(name, amount)}" for name, amount in sorted(self.requested.items()))
        return f"{where} in pool {self.pool!r} has {together} allocatable together"


def verdict(
    pool_name: str,
    requested: dict[str, int],
    node_shapes: Iterable[dict[str, int]],
    template_shapes: Iterable[dict[str, int]] = (),
) -> TooLarge | None:
    """Pure: ``TooLarge`` when no shape holds ``requested``, else None.

    Args:
        pool_name: for the message.
        requested: ``{resource: canonical amount}``.
        node_shapes: each node's allocatable ``{resource: canonical}`` (what it holds when empty).
        template_shapes: the allocatable of each node shape the pool can add.
    """
    nodes, templates = list(node_shapes), list(template_shapes)
    shapes = nodes + templates
    if any(holds(shape, requested) for shape in shapes):
        return None
    largest = {name: max((shape.get(name, 0) for shape in shapes), default=0) for name in requested}
    return TooLarge(
        pool=pool_name,
        requested=dict(requested),
        largest=largest,
        nodes_considered=len(nodes),
        templates_considered=len(templates),
        exceeds=sorted(name for name, amount in requested.items() if largest[name] < amount),
    )


def summary_verdict(
    pool_name: str,
    requested: dict[str, int],
    *,
    any_node_holds: bool,
    node_largest: dict[str, int],
    nodes_considered: int,
    template_shapes: Iterable[dict[str, int]] = (),
) -> TooLarge | None:
    """:func:`verdict` from a set-based summary of the nodes (what :func:`leases.placement.diagnose`
    aggregates in SQL): whether any node holds the request, and the largest allocatable per resource."""
    templates = list(template_shapes)
    if any_node_holds or any(holds(shape, requested) for shape in templates):
        return None
    largest = {
        name: max([node_largest.get(name, 0) or 0, *(shape.get(name, 0) for shape in templates)]) for name in requested
    }
    return TooLarge(
        pool=pool_name,
        requested=dict(requested),
        largest=largest,
        nodes_considered=nodes_considered,
        templates_considered=len(templates),
        exceeds=sorted(name for name, amount in requested.items() if largest[name] < amount),
    )
