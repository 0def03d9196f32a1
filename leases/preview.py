"""Placement previews: "how many of these would fit right now, and where" — a dry run that writes nothing.

One source of truth with real grants: the candidate rows come from :func:`placement.candidate_query`
(the SQL real grants page through), are filtered by :func:`placement.feasible_rows` and ranked by
:func:`placement.rank` — the functions :func:`placement.find_candidates` runs for every grant. Only
the reservation differs: instead of ``UPDATE … allocated = allocated + x`` the preview adds ``x`` to
an in-memory copy of the rows, then asks the same functions again for the next lease (greedy, like
a client granting one lease after another). Ties between equal scores, which real grants break at
random, are broken by the SQL order here, so a preview is reproducible.

Used by ``POST /api/v1/placement-previews``, the pool capacity page ("can serve N now"), the
``nodepool_pool_request_class_fits`` metric, and other apps (upgrades and autoscaling ask whether
a pool can still serve a request with some nodes taken out: ``exclude_node_ids``).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from typing import Any

from django.db.models import F, IntegerField, Q, Sum, Value
from django.db.models.functions import Least
from django.utils import timezone

from fleet.choices import SchedulingPolicy
from fleet.models import Pool
from nodepool.api.problems import Problem

from . import device_requests, placement
from . import devices as lease_devices
from .device_requests import choose
from .errors import INVALID_COUNT
from .models import Shape
from .services import resolve_pool, resolve_shape
from .spec import PlacementSpec, bad, device_requests_from_wire, parse_spec, with_device_counts

MAX_COUNT = 1000  # leases one preview simulates; "fits" is counted exactly beyond it
# Higher apps say how a pool can scale up (operations: its autoscaler's node template and max_nodes):
# ``source(pool, spec) -> None | {"max_nodes": M, "nodes_to_add": k, "allocatable": {res: n},
# "failure": None | reason code}`` (``failure``: why an empty template node would not hold
# ``spec``, the scheduler's code). Connected in the higher app's AppConfig.ready().
ScaleUpSource = Callable[[Pool, PlacementSpec], "dict | None"]
_scale_up_sources: dict[str, ScaleUpSource] = {}


def register_scale_up_source(name: str, source: ScaleUpSource) -> None:
    """Declare how pools can scale up, for :func:`after_scale_up` (idempotent per ``name``)."""
    _scale_up_sources[name] = source


MAX_NODES_LISTED = 100  # distinct nodes named in one pool's answer
PREVIEW_WORKLOAD = "placement-preview"


def preview_pool(
    pool: Pool, spec: PlacementSpec, *, count: int = 1, now=None, exclude_node_ids=(), explain: bool = True
) -> dict[str, Any]:
    """Simulate granting ``count`` leases of ``spec`` in ``pool``, one after another, writing nothing.

    Args:
        pool: the pool to place in (``spec.pool`` is ignored).
        spec: a resolved :class:`PlacementSpec` (``resources`` filled in, e.g. by
            ``leases.services.resolve_shape``); ``workload_id`` does not matter.
        count: leases to simulate, 1 to :data:`MAX_COUNT`.
        now: reference time for credential validity (default: now).
        exclude_node_ids: nodes treated as unavailable (a drain or an upgrade taking them out).
        explain: when nothing fits, add the 409 ``unschedulable`` explanation (``diagnose``).

    Returns:
        ``{"pool": name, "requested": count, "fits": N, "placeable": N >= count,
        "placements": [{"node_id", "hostname", "leases"}], "unschedulable": None | {"reasons":
        {code: count}, "nodes_considered", "fragmented", "cause", "message"}}``. ``fits`` is how
        many such leases fit now in total (exact, not capped by ``count``); ``placements`` lists
        the nodes the first ``min(count, fits)`` grants would take, in grant order, with the
        number of leases each would receive.

    Raises:
        ValueError: ``count`` outside 1..MAX_COUNT.
    """
    if not 1 <= count <= MAX_COUNT:
        raise ValueError(f"count must be 1..{MAX_COUNT}")
    now = now or timezone.now()
    rows = list(placement.candidate_query(pool, spec, now=now, exclude_node_ids=exclude_node_ids))
    counts = placement.group_counts(spec, pool)
    fits = fits_count(rows, pool, spec, counts)
    placements: list[dict[str, Any]] = []
    if fits:
        order = _simulate(rows, pool, spec, counts, min(count, fits))
        for node in order:
            if placements and placements[-1]["node_id"] == str(node.pk):
                placements[-1]["leases"] += 1
            elif len(placements) < MAX_NODES_LISTED:
                placements.append({"node_id": str(node.pk), "hostname": node.hostname, "leases": 1})
    result = {
        "pool": pool.name,
        "requested": count,
        "fits": fits,
        "placeable": fits >= count,
        "placements": placements,
        "unschedulable": None,
    }
    if fits == 0 and explain:
        explanation = placement.diagnose(pool, spec, now=now, exclude_node_ids=exclude_node_ids)
        explanation.pop("pending_admission", None)
        result["unschedulable"] = explanation
    return result


def after_scale_up(pool: Pool, spec: PlacementSpec, answer: dict[str, Any]) -> dict[str, Any] | None:
    """Would ``answer``'s request (a :func:`preview_pool` answer) fit once ``pool`` scaled up to its
    maximum with its node template? None when no registered source can grow the pool.

    Returns ``{"max_nodes": M, "nodes_to_add": k, "per_node": n, "fits": N, "placeable": bool,
    "cause": None | "too_large" | "constraints" | "insufficient_capacity", "reason": code | None,
    "message": str}``: ``fits`` is the leases that fit now plus ``k`` template nodes holding ``n``
    each (a hard anti-affinity group adds at most one: the template nodes share their labels).
    ``cause`` ``too_large`` — with the ``too_large`` object of :mod:`leases.impossible`, the family
    of the 409 and the queued request's ``422 impossible_request`` — when no node nor template
    could ever hold the request; otherwise, when it does not fit, whether the template fails a
    constraint (a taint, a selector: ``reason`` names it) or the pool runs out of room
    (``max_nodes``). Cluster-autoscaler answers the same question before scaling (will a new
    node of this group let the pending pod schedule?) by simulating the template node."""
    for source in _scale_up_sources.values():
        grow = source(pool, spec)
        if grow is not None:
            break
    else:
        return None
    added, allocatable, failure = grow["nodes_to_add"], grow["allocatable"], grow.get("failure")
    per_node = 0
    if failure is None and spec.resources:
        per_node = min(allocatable.get(name, 0) // amount for name, amount in spec.resources.items() if amount)
    extra = min(added, 1) * min(per_node, 1) if spec.anti_affinity else added * per_node
    fits = answer["fits"] + extra
    result = {
        "max_nodes": grow["max_nodes"],
        "nodes_to_add": added,
        "per_node": per_node,
        "fits": fits,
        "placeable": fits >= answer["requested"],
        "cause": None,
        "reason": failure,
        "message": f"{fits} would fit once {pool.name!r} adds {added} node(s) of its template",
    }
    if result["placeable"]:
        return result
    unschedulable = answer.get("unschedulable") or {}
    if unschedulable.get("cause") == "too_large":
        result.update(cause="too_large", too_large=unschedulable["too_large"], message=unschedulable["message"])
    elif failure and not failure.startswith("insufficient_"):
        result.update(cause="constraints", message=f"a node of {pool.name!r}'s template would not take it: {failure}")
    else:
        result.update(
            cause="insufficient_capacity",
            message=f"only {fits} of {answer['requested']} would fit once {pool.name!r} reached max_nodes "
            f"{grow['max_nodes']}",
        )
    return result


def fits_count(rows: list[tuple], pool: Pool, spec: PlacementSpec, counts) -> int:
    """How many leases of ``spec`` fit on ``rows`` (candidate rows whose resources fit once) now.

    Identical leases on distinct nodes do not compete, so without a hard anti-affinity the answer
    is the sum over feasible nodes of ``min(free // amount)`` over the requested resources. With
    anti-affinity, each topology domain not yet used by the group holds one (nodes without the
    topology label are unconstrained, as in :func:`placement.constraint_failure`).
    """
    feasible, _ = placement.feasible_rows(rows, pool, spec, counts, limit=len(rows) + 1)
    device_fits = _device_fits([c.node.pk for c in feasible], spec)
    anti = spec.anti_affinity
    total, domains = 0, set()
    for candidate in feasible:
        per_node = min(
            (allocatable - allocated) // spec.resources[name]
            for name, (allocatable, allocated) in candidate.inventory.items()
        )
        if device_fits is not None:
            per_node = min(per_node, device_fits.get(candidate.node.pk, 0))
        if per_node <= 0:
            continue
        if anti:
            domain = placement.topology_domain(placement.node_label_view(candidate.node, pool), spec)
            if domain is not None:
                domains.add(domain)
                continue
        total += per_node
    return total + len(domains)


def _device_fits(node_ids: list, spec: PlacementSpec, *, most: int = MAX_COUNT) -> dict | None:
    """``{node id: how many leases of spec's device requests its free devices can give}`` (at most
    ``most`` each), or None when ``spec`` asks for counts only (the count resource decides).

    The counts alone overstate it for a device-constrained request: 4 H100 and 4 A100 count as 8
    ``nvidia.com/gpu`` but give one ``model=H100*`` lease of 4, not two. Each node's answer picks
    with :func:`leases.device_requests.choose` (what the grant runs) again and again, taking what
    each pick took. Two queries for every node."""
    if not spec.device_constrained or not node_ids:
        return None

    rows, taken = lease_devices.node_devices(
        node_ids, lease_devices.device_types(spec.devices), usable_only=not spec.tolerations
    )
    tolerates = placement.device_tolerance(spec)
    fits: dict = {}
    for pk in node_ids:
        devices, used, n = rows.get(pk, []), set(taken.get(pk, set())), 0
        while n < most:
            choice = choose(spec.devices, devices, used, tolerates=tolerates)
            if choice.reason or not choice.picked:
                break
            used |= {d["id"] for d in choice.picked}
            # a whole GPU takes its MIG instances with it, as the grant's implied rows do
            picked = {d["device_id"] for d in choice.picked}
            used |= {d["id"] for d in devices if d["parent_device_id"] in picked}
            n += 1
        fits[pk] = n
    return fits


def _sort_key(pool: Pool):
    # The SQL's ORDER BY (placement.candidate_query): free primary ascending for binpack (then
    # node id), descending for spread (then node id descending).
    if pool.scheduling_policy == SchedulingPolicy.BINPACK:
        return lambda row: (row[7] - row[8], row[0])
    return lambda row: (-(row[7] - row[8]), _Reverse(row[0]))


@dataclasses.dataclass(frozen=True)
class _Reverse:
    value: Any

    def __lt__(self, other: _Reverse) -> bool:
        return self.value > other.value


def _simulate(rows: list[tuple], pool: Pool, spec: PlacementSpec, counts, count: int) -> list:
    """Grant ``count`` leases greedily on an in-memory copy of ``rows``; the chosen NodeViews in order."""
    primary = placement.primary_resource(spec)
    others = [name for name in sorted(spec.resources) if name != primary]
    key = _sort_key(pool)
    device_fits = _device_fits([row[0] for row in rows], spec, most=count)
    if device_fits is not None:  # a node gives no more leases than its matching free devices do
        rows = [row for row in rows if device_fits.get(row[0], 0) > 0]
    stream = sorted((list(row) for row in rows), key=key)
    counts = placement.GroupCounts(by_domain=counts.by_domain.copy())
    chosen = []
    for _ in range(count):
        candidates, _ = placement.feasible_rows(stream, pool, spec, counts, limit=placement.FEASIBLE_TARGET)
        if not candidates:
            break
        best = placement.rank(candidates, pool, spec, counts, shuffle_ties=False)[0]
        chosen.append(best.node)
        index = next(i for i, row in enumerate(stream) if row[0] == best.node.pk)
        row = stream.pop(index)
        # The reservation, in memory: what _reserve's UPDATE does to NodeResource.allocated.
        row[8] += spec.resources[primary]
        for position, name in enumerate(others):
            row[10 + 2 * position] += spec.resources[name]
        still_fits = row[7] - row[8] >= spec.resources[primary] and all(
            row[9 + 2 * p] - row[10 + 2 * p] >= spec.resources[n] for p, n in enumerate(others)
        )
        if device_fits is not None:
            device_fits[row[0]] -= 1
            still_fits = still_fits and device_fits[row[0]] > 0
        if still_fits:
            bisect.insort(stream, row, key=key)
        if spec.spread_group:
            domain = placement.topology_domain(placement.node_label_view(best.node, pool), spec)
            if domain is not None:
                counts.by_domain[domain] += 1
    return chosen


def lease_spec(lease) -> PlacementSpec:
    """The :class:`PlacementSpec` a live lease was granted for, with its resolved resources (its
    shape version, not the shape's latest), as :func:`leases.reconcile.simulate_placement` reads it."""
    try:
        spec = parse_spec(lease.spec)
    except Problem:  # granted before a validation rule tightened: placed by resources only
        spec = parse_spec({"workload_id": lease.workload_id, "pool": lease.pool.name, "resources": {"cpu": "1"}})
    return dataclasses.replace(spec, resources=dict(lease.resources or {}), pool=lease.pool.name)


def preview_leases(pool: Pool, leases: list, *, exclude_node_ids=(), now=None) -> dict[str, Any]:
    """Would every lease of ``leases`` (live leases, e.g. of a node being consolidated) fit on the
    pool's other nodes **together**? Simulated one after another, largest first, each taking what
    the previous ones took — the grant path's candidate query, filters and ranking, like
    :func:`preview_pool` — writing nothing. (Placing each alone, as a drain's dry run does, can
    count one free slot twice.)

    Returns ``{"placeable": bool, "placements": {lease id: node id}, "unplaced": lease id | None,
    "message": str}``.
    """
    now = now or timezone.now()
    taken: dict[Any, dict[str, int]] = {}
    placements: dict[str, str] = {}
    key = _sort_key(pool)
    for lease in sorted(leases, key=lambda item: -sum((item.resources or {}).values())):
        spec = lease_spec(lease)
        if not spec.resources:
            continue
        primary = placement.primary_resource(spec)
        others = [name for name in sorted(spec.resources) if name != primary]
        rows = []
        for row in placement.candidate_query(pool, spec, now=now, exclude_node_ids=exclude_node_ids):
            row, extra = list(row), taken.get(row[0], {})
            row[8] += extra.get(primary, 0)
            for position, name in enumerate(others):
                row[10 + 2 * position] += extra.get(name, 0)
            if row[7] - row[8] >= spec.resources[primary] and all(
                row[9 + 2 * p] - row[10 + 2 * p] >= spec.resources[n] for p, n in enumerate(others)
            ):
                rows.append(row)
        rows.sort(key=key)
        counts = placement.group_counts(spec, pool, exclude_lease_id=lease.pk)
        candidates, _ = placement.feasible_rows(rows, pool, spec, counts, limit=placement.FEASIBLE_TARGET)
        if not candidates:
            return {
                "placeable": False,
                "placements": placements,
                "unplaced": str(lease.pk),
                "message": f"lease {lease.pk} ({lease.workload_id}) would not fit on the other nodes",
            }
        best = placement.rank(candidates, pool, spec, counts, shuffle_ties=False)[0]
        used = taken.setdefault(best.node.pk, {})
        for name, amount in spec.resources.items():
            used[name] = used.get(name, 0) + amount
        placements[str(lease.pk)] = str(best.node.pk)
    return {"placeable": True, "placements": placements, "unplaced": None, "message": ""}


def placement_preview(*, data: Any, now=None) -> dict[str, Any]:
    """``POST /placement-previews``: validate a lease request (or a named shape) and preview every pool asked.

    ``data`` is a ``POST /node-leases`` body where ``workload_id`` and ``pool`` are optional (no
    pool: every pool), plus ``count`` (1 to :data:`MAX_COUNT`, default 1). Returns
    ``{"count": N, "pools": [preview_pool(...) + {"after_scale_up": after_scale_up(...)}], "fits":
    total}`` (``fits`` counts what fits now, not after a scale-up).

    Raises:
        Problem 400: bad input (the lease request's own rules, ``invalid_count``, ``unknown_pool``,
        ``unknown_shape``).
    """

    if not isinstance(data, dict):
        raise bad("", "the body must be a JSON object")
    body = dict(data)
    count = body.pop("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
        raise bad("count", f"must be an integer from 1 to {MAX_COUNT}", INVALID_COUNT)
    body.setdefault("workload_id", PREVIEW_WORKLOAD)
    pool_name = body.get("pool")
    if pool_name is None:
        body["pool"] = "*"
    spec = parse_spec(body)
    spec, _ = resolve_shape(spec)
    pools = list(Pool.objects.order_by("name")) if pool_name is None else [resolve_pool(spec.pool)]
    now = now or timezone.now()
    answers = []
    for pool in pools:
        answer = preview_pool(pool, spec, count=count, now=now)
        answer["after_scale_up"] = after_scale_up(pool, spec, answer)
        answers.append(answer)
    return {"count": count, "fits": sum(a["fits"] for a in answers), "pools": answers}


def request_class_spec(request_class: dict[str, Any]) -> PlacementSpec | None:
    """The :class:`PlacementSpec` of one of a pool's request classes (``Pool.request_classes``).

    None when the class names a shape that does not exist (reported as such, never an error:
    a metric scrape or a page must not fail because an operator deleted a shape). A shape's device
    requests come along (as ``resolve_shape`` takes them for a grant), so "can serve N now" of a
    class of 4 × H100 on one NVLink island counts what the devices give, not the GPU count.
    """

    resources = dict(request_class.get("resources") or {})
    features = dict(request_class.get("features") or {})
    explicit: tuple = ()
    if request_class.get("shape"):
        shape = Shape.objects.filter(name=request_class["shape"]).order_by("-version").first()
        if shape is None:
            return None
        try:
            explicit = device_requests_from_wire(shape.devices or None)
            resources = with_device_counts(dict(shape.resources), explicit)
        except Problem:  # stored before today's validation: reported as a class that cannot be judged
            return None
        features = {**(shape.features or {}), **features}
    if not resources:
        return None
    return PlacementSpec(
        workload_id=PREVIEW_WORKLOAD, pool="", resources=resources, features=features,
        devices=device_requests.combined(explicit, resources),
    )  # fmt: skip


def request_class_fits(pool: Pool, *, now=None) -> list[dict[str, Any]]:
    """For each of ``pool``'s request classes: ``{"name", "fits": N | None}`` — "can serve N now".

    ``fits`` is None when the class names a missing shape.
    """
    out = []
    for request_class in pool.request_classes or []:
        spec = request_class_spec(request_class)
        if spec is None:
            out.append({"name": request_class.get("name", ""), "fits": None})
            continue
        out.append({"name": request_class["name"], "fits": quick_fits(pool, spec, now=now)})
    return out


def quick_fits(pool: Pool, spec: PlacementSpec, *, now=None) -> int:
    """:func:`fits_count` for every schedulable node of ``pool``, cheaper for plain requests.

    A request with resources only (no selector, affinity, features or spread group) can fail a
    non-resource filter on one thing alone: a ``NoSchedule``/``NoExecute`` taint it does not
    tolerate. So the untainted nodes are counted in SQL (the sum over nodes of the smallest
    ``free // amount``, on the same candidate query real grants use), and only the tainted ones go
    through :func:`placement.feasible_rows` in Python. Anything else takes the full path. Both
    paths give the same number (tests/leases/test_placement_previews.py checks it).
    """

    plain = not (spec.node_selector or spec.required or spec.features or spec.spread_group or spec.device_constrained)
    pool_tainted = any(t.get("effect") in ("NoSchedule", "NoExecute") for t in placement.node_taints_of_pool(pool))
    counts = placement.group_counts(spec, pool)
    if not plain or pool_tainted:
        return fits_count(list(placement.candidate_query(pool, spec, now=now)), pool, spec, counts)
    tainted = Q(node__taints__icontains="NoSchedule") | Q(node__taints__icontains="NoExecute")
    base = placement.candidate_rows(pool, spec, now=now)
    rows = list(base.filter(tainted).values_list(*placement.candidate_fields(spec)))
    total = fits_count(rows, pool, spec, counts)
    primary = placement.primary_resource(spec)
    per_node = [(F("allocatable") - F("allocated")) / Value(spec.resources[primary])]
    for index, name in enumerate(n for n in sorted(spec.resources) if n != primary):
        per_node.append((F(f"r{2 * index}_allocatable") - F(f"r{2 * index}_allocated")) / Value(spec.resources[name]))
    fits = per_node[0] if len(per_node) == 1 else Least(*per_node)
    untainted = base.exclude(tainted).aggregate(n=Sum(fits, output_field=IntegerField()))["n"]
    return total + int(untainted or 0)


__all__ = [
    "MAX_COUNT",
    "after_scale_up",
    "fits_count",
    "lease_spec",
    "placement_preview",
    "preview_leases",
    "preview_pool",
    "refresh_request_class_fits",
    "register_scale_up_source",
    "request_class_fits",
]


def refresh_request_class_fits(*, now=None) -> int:
    """Recompute every pool's "can serve N now" into ``Pool.request_class_fits`` (beat, every 30 s).

    /metrics and the fleet overview read the stored answer: evaluating placement filters over a
    10,000-node fleet at every scrape of every web process would cost more than the scrape may.
    Each pool is one ``UPDATE``; a pool without request classes is cleared. Returns pools updated.
    """
    now = now or timezone.now()
    updated = 0
    for pool in Pool.objects.order_by("name"):
        fits = {entry["name"]: entry["fits"] for entry in request_class_fits(pool, now=now)}
        updated += Pool.objects.filter(pk=pool.pk).update(request_class_fits=fits, request_class_fits_at=now)
    return updated
