"""Placement's filters and the candidate search they run on (leases.placement's *filter* part).

What a node looks like to the filters (:class:`NodeView`, :func:`node_label_view`), the hard filters
(:func:`constraint_failure`, :func:`resource_failure`, the device rules on a page of candidates),
and the candidate SQL real grants page through (:func:`candidate_query`, compiled once per query
shape by :func:`_page_reader`, run by :func:`leases.sql.candidates.candidate_page_reader`).
Reads only. :mod:`leases.placement` re-exports these names.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.db import connection
from django.db.models import BigIntegerField, Exists, ExpressionWrapper, F, FilteredRelation, OuterRef, Q
from django.utils import timezone

from fleet.choices import SchedulingPolicy
from fleet.labelview import label_view
from fleet.models import Node, NodeCredential, NodeResource, Pool
from fleet.selectors import schedulable_q

from . import devices as lease_devices
from . import reliability as node_reliability
from .device_requests import choose
from .spec import PlacementSpec
from .sql import candidates as candidate_sql
from .sql import devices as device_sql

_SENTINEL_NOW = datetime(1971, 3, 4, 5, 6, 7, 89, tzinfo=UTC)
HARD_TAINT_EFFECTS = ("NoSchedule", "NoExecute")  # the effects that keep work off (PreferNoSchedule only scores)

UNTOLERATED_TAINT = "untolerated_taint"
NODE_SELECTOR_MISMATCH = "node_selector_mismatch"
NODE_AFFINITY_MISMATCH = "node_affinity_mismatch"
MISSING_FEATURE = "missing_feature"
ANTI_AFFINITY_CONFLICT = "anti_affinity_conflict"


def insufficient_code(resource: str) -> str:
    return "insufficient_" + re.sub(r"[^a-z0-9]+", "_", resource.lower()).strip("_")


# --- what a node looks like to the filters ---------------------------------------------------------
# Labels whose value is each node's own (node_label_view), and labels derived from a verified feature.
# (fleet.labelview holds them: the node list's label selector reads the same view.)


def reads_as_index(key: str) -> bool:
    """Whether Django's JSON key transforms would take ``key`` for an array index: they turn any
    key that ``int()`` parses (``"7"``, a valid label key) into ``-> 7`` / ``$[7]``, which never
    matches the object key ``"7"``. Such keys are read from the whole document instead."""
    try:
        int(key)
    except ValueError:
        return False
    return True


def node_label_view(node: Node, pool: Pool) -> dict[str, str]:
    """Labels placement matches on (:func:`fleet.labelview.label_view`): well-known labels, scalar
    verified features, pool labels, node-declared labels only when ``pool.trust_node_labels``, then
    platform labels (which win)."""
    cached = getattr(node, "_label_view", None)
    if cached is not None:
        return cached
    labels = label_view(pk=node.pk, hostname=node.hostname, pool_name=pool.name, pool_labels=pool.labels,
                        trust_node_labels=pool.trust_node_labels, node_labels=node.node_labels, labels=node.labels,
                        verified=node.verified)  # fmt: skip
    if isinstance(node, NodeView):
        node._label_view = labels  # filters and scores of one request read it several times
    return labels


def node_taints(node: Node, pool: Pool) -> list[dict]:
    return [t for t in [*(pool.taints or []), *(node.taints or [])] if isinstance(t, dict)]


def has_feature(node: Node, key: str, want: Any) -> bool:
    verified = node.verified or {}
    if key == "accelerator_model":
        return any(a.get("model") == want for a in verified.get("accelerators") or [] if isinstance(a, dict))
    have = (verified.get("features") or {}).get(key)
    if isinstance(have, list):
        return want in have
    return have is not None and str(have).lower() == str(want).lower()


def topology_domain(labels: dict[str, str], spec: PlacementSpec) -> str | None:
    for key in spec.topology_labels:
        if key in labels:
            return labels[key]
    return None


@dataclass
class GroupCounts:
    """Live leases of the spread group per topology domain (PodTopologySpread's counts)."""

    by_domain: Counter = field(default_factory=Counter)

    @property
    def max(self) -> int:
        return max(self.by_domain.values(), default=0)


# --- filters ---------------------------------------------------------------------------------------
def constraint_failure(node: Node, pool: Pool, spec: PlacementSpec, counts: GroupCounts) -> str | None:
    """The first non-resource filter ``node`` fails, as a reason code, or None."""
    for taint in node_taints(node, pool):
        if taint.get("effect") in HARD_TAINT_EFFECTS and not any(t.tolerates(taint) for t in spec.tolerations):
            return UNTOLERATED_TAINT
    # The label view only when a filter reads it: most requests select nothing, and their
    # candidates' label documents then stay undecoded (NodeView).
    labels = node_label_view(node, pool) if spec.node_selector or spec.required or spec.anti_affinity else {}
    if any(labels.get(k) != v for k, v in spec.node_selector.items()):
        return NODE_SELECTOR_MISMATCH
    if not all(req.matches(labels) for req in spec.required):
        return NODE_AFFINITY_MISMATCH
    if not all(has_feature(node, k, v) for k, v in spec.features.items()):
        return MISSING_FEATURE
    if spec.anti_affinity:
        domain = topology_domain(labels, spec)
        if domain is not None and counts.by_domain.get(domain, 0) > 0:
            return ANTI_AFFINITY_CONFLICT
    return None


def resource_failure(free: dict[str, int], spec: PlacementSpec) -> str | None:
    for name, amount in sorted(spec.resources.items()):
        if free.get(name, 0) < amount:
            return insufficient_code(name)
    return None


# --- candidate query -------------------------------------------------------------------------------
def _requalified(q, prefix: str):
    """``schedulable_q()`` re-rooted on a related model (the single source of truth, not a copy)."""
    clone = q.copy() if hasattr(q, "copy") else q
    clone.children = [
        _requalified(child, prefix)
        if hasattr(child, "children")
        else ((child[0] if child[0] == "has_valid_credential" else prefix + child[0]), child[1])
        for child in q.children
    ]
    return clone


def primary_resource(spec: PlacementSpec) -> str:
    """The resource the candidate SQL walks and orders by: an extended resource when asked for
    (``<domain>/<name>``, such as ``nvidia.com/gpu``; the first by name), else cpu when asked for,
    else the first by name.

    The walk passes over every node where the primary fits but another resource does not, so it
    starts from the scarce one. Driven by cpu, a binpack of 1-GPU leases kept the nodes whose GPUs
    it had filled at the head of the cpu order (each took only 100m of cpu per GPU), and every
    later grant read past them: 34 rows for a page of 16 after 150 grants on the device bench's
    fleet, a 0.4 ms longer candidate query than a count-only grant's, growing with every grant.
    Driven by the GPU, nodes without a free one are outside the index range, and binpack packs
    GPUs first, as GPU schedulers do to keep whole nodes free for large requests."""
    extended = sorted(name for name in spec.resources if "/" in name)
    if extended:
        return extended[0]
    return "cpu" if "cpu" in spec.resources else sorted(spec.resources)[0]


def node_taints_of_pool(pool: Pool) -> list[dict]:
    return [t for t in (pool.taints or []) if isinstance(t, dict)]


def candidate_fields(spec: PlacementSpec) -> tuple[str, ...]:
    """The columns of a candidate row: :data:`ROW_FIELDS`, then ``(allocatable, allocated)`` of
    every other requested resource in sorted order (``r<2i>_allocatable``, ``r<2i>_allocated``)."""
    others = len(spec.resources) - 1
    return (*ROW_FIELDS, *(f"r{2 * i}_{part}" for i in range(others) for part in ("allocatable", "allocated")))


def candidate_query(pool: Pool, spec: PlacementSpec, *, now=None, exclude_node_ids=(), node_constraint_values=None):
    """Schedulable nodes of ``pool`` where every requested resource fits, best-first for the policy.

    Driven from ``NodeResource`` through the ``noderesource_free`` index (``name``, free, walk key, node): the
    planner walks the index in order and stops at the page's LIMIT. Yields tuples in the order of
    :func:`candidate_fields`.
    """
    qs = candidate_rows(
        pool, spec, now=now, exclude_node_ids=exclude_node_ids, node_constraint_values=node_constraint_values
    )
    # Kubernetes' MostAllocated wants the fullest node; LeastAllocated the emptiest. Equal nodes
    # in the row's random walk_key order (fleet.models.NodeResource.walk_key), as Kubernetes
    # breaks a tie between equal scores at random; the node id makes the order total for paging.
    order = (
        ("free_amount", "walk_key", "node_id")
        if pool.scheduling_policy == SchedulingPolicy.BINPACK
        else ("-free_amount", "-walk_key", "-node_id")
    )
    return qs.order_by(*order).values_list(*candidate_fields(spec))


def candidate_rows(pool: Pool, spec: PlacementSpec, *, now=None, exclude_node_ids=(), node_constraint_values=None):
    """:func:`candidate_query`'s queryset before ordering and column selection (NodeResource rows of
    the primary resource, annotated with ``free_amount`` and the other resources' amounts).
    ``node_constraint_values``: sentinels in place of the node constraints' values (_page_reader)."""
    primary = primary_resource(spec)
    qs = (
        NodeResource.objects.alias(has_valid_credential=Exists(_credential_subquery(now)))
        # BigIntegerField, said out loud: Django types bigint - bigint as IntegerField, and on
        # PostgreSQL a lookup value beyond 2**31 (5 GiB of memory) then turns the whole query
        # into an EmptyResultSet instead of comparing.
        .annotate(free_amount=ExpressionWrapper(F("allocatable") - F("allocated"), output_field=BigIntegerField()))
        .filter(
            _requalified(schedulable_q(now), "node__"),
            name=primary,
            node__pool=pool,
            free_amount__gte=spec.resources[primary],
        )
    )
    if not spec.tolerations:
        # Without a toleration, a node with a NoSchedule or NoExecute taint takes nothing
        # (constraint_failure still decides). Left in, such nodes gather at the front of a binpack
        # walk as tolerating work fills them, and every plain request read past them, page after
        # page; the row's copy of the flag lets the walk take an index without them
        # (noderesource_free_untainted).
        qs = qs.filter(node_hard_tainted=False)
    others = [name for name in sorted(spec.resources) if name != primary]
    for index, name in enumerate(others):
        # One join per other resource (its row of the same node), not an EXISTS plus two scalar
        # subqueries: fewer relations for the planner, which cost more than running the query.
        alias = f"r{index}"
        qs = qs.alias(**{alias: FilteredRelation("node__resources", condition=Q(node__resources__name=name))})
        qs = qs.filter(**{f"{alias}__allocatable__gte": F(f"{alias}__allocated") + spec.resources[name]}).annotate(
            **{
                f"r{2 * index}_allocatable": F(f"{alias}__allocatable"),
                f"r{2 * index}_allocated": F(f"{alias}__allocated"),
            }
        )
    if spec.node_constraints:  # the stored score (leases.reliability): a column compare, no computation
        qs = qs.filter(node_reliability.candidate_filter(spec.node_constraints, values=node_constraint_values))
    if exclude_node_ids:
        qs = qs.exclude(node_id__in=list(exclude_node_ids))
    return qs


ROW_FIELDS = (
    "node_id", "node__hostname", "node__labels", "node__node_labels", "node__taints", "node__verified",
    "node__incarnation", "allocatable", "allocated",
)  # fmt: skip


class _JsonDocument:
    """A :class:`NodeView` attribute given as the database's JSON text or already decoded;
    decoded on first read and kept."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, node, owner=None):
        value = getattr(node, self.slot)
        if isinstance(value, str):
            value = json.loads(value)
            setattr(node, self.slot, value)
        return value


class NodeView:
    """The few node fields placement reads, without building a full ``Node`` (and its FSM state)
    for every row: model instantiation was most of the cost of a placement at 10,000 nodes.

    ``labels``, ``node_labels``, ``taints`` and ``verified`` may be given as the JSON text the
    database returned; each is decoded on first read, so a filter that never looks at a document
    (a request without selectors reads only the taints) does not pay for decoding it.
    """

    __slots__ = ("pk", "hostname", "_labels", "_node_labels", "_taints", "_verified", "incarnation", "_label_view")
    labels = _JsonDocument()
    node_labels = _JsonDocument()
    taints = _JsonDocument()
    verified = _JsonDocument()

    def __init__(self, pk, hostname: str, labels, node_labels, taints, verified, incarnation: int):
        self.pk, self.hostname, self.incarnation = pk, hostname, incarnation
        self._labels, self._node_labels, self._taints, self._verified = labels, node_labels, taints, verified
        self._label_view: dict | None = None

    def __str__(self) -> str:
        return self.hostname or str(self.pk)


# The compiled-queryset cache: per query shape (vendor, policy, resource names, primary resource,
# tolerations or not, node-constraint shape), the candidate SQL compiled with sentinel values, its
# parameters and which of them the request fills in (_page_reader).
_COMPILED: dict[tuple, tuple[str, list, dict[int, Any]]] = {}


def _page_reader(pool: Pool, spec: PlacementSpec, *, now=None, exclude_node_ids=()):
    """``read(offset, limit) -> rows`` (a list of row tuples) for :func:`candidate_query`; their JSON
    columns may still be text, which :class:`NodeView` decodes on first read.

    Building and compiling that queryset costs more than running it (several milliseconds of
    ORM work per request), so its SQL is compiled once per query shape — policy and requested
    resource names — with sentinel values that are swapped for the request's pool, amounts and
    time (a measured win: bench/placement.py's place and grant times). The ORM (and so
    ``fleet.selectors.schedulable_q``) stays the source of the SQL;
    :func:`leases.sql.candidates.candidate_page_reader` runs it (prepared on PostgreSQL).
    """

    now = now or timezone.now()
    if exclude_node_ids:  # drain dry-runs: rare, uncached
        query = candidate_query(pool, spec, now=now, exclude_node_ids=exclude_node_ids)
        return lambda offset, limit: list(query[offset : offset + limit])
    names = tuple(sorted(spec.resources))
    node_shape = node_reliability.shape_key(spec.node_constraints)
    key = (connection.vendor, pool.scheduling_policy, names, primary_resource(spec), bool(spec.tolerations), node_shape)
    if key not in _COMPILED:
        sentinels = {"pool": -7_340_001, "now": _SENTINEL_NOW}
        sentinels.update({f"r:{name}": 7_340_011 + 2 * i for i, name in enumerate(names)})
        sentinels.update(node_reliability.sentinels(spec.node_constraints))
        probe_pool = Pool(pk=sentinels["pool"], scheduling_policy=pool.scheduling_policy)
        probe_spec = dataclasses.replace(spec, resources={n: sentinels[f"r:{n}"] for n in names})
        probe_values = [sentinels[f"nc:{i}"] for i in range(len(spec.node_constraints))]
        queryset = candidate_query(probe_pool, probe_spec, now=_SENTINEL_NOW, node_constraint_values=probe_values)
        sql, params = queryset.query.sql_with_params()
        # Backends adapt parameters while compiling (SQLite turns datetimes into strings).
        by_value = {value: name for name, value in sentinels.items() if name != "now"}
        by_value[connection.ops.adapt_datetimefield_value(_SENTINEL_NOW)] = "now"
        slots = {i: by_value[p] for i, p in enumerate(params) if _hashable(p) and p in by_value}
        if set(slots.values()) != set(sentinels):  # a shape the probe cannot see through: no cache
            query = candidate_query(pool, spec, now=now)
            return lambda offset, limit: list(query[offset : offset + limit])
        _COMPILED[key] = (candidate_sql.paged(sql), list(params), slots)
    sql, template, slots = _COMPILED[key]
    values = {
        "pool": pool.pk,
        "now": connection.ops.adapt_datetimefield_value(now),
        **{f"r:{n}": a for n, a in spec.resources.items()},
        **{f"nc:{i}": c.value for i, c in enumerate(spec.node_constraints)},
    }
    params = list(template)
    pool_slot = 0
    for index, name in slots.items():
        params[index] = values[name]
        if name == "pool":
            pool_slot = index
    return candidate_sql.candidate_page_reader(sql, params, pool_slot=pool_slot, pool_id=pool.pk)


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _credential_subquery(now):

    now = now or timezone.now()
    return NodeCredential.objects.filter(node=OuterRef("node_id"), revoked_at__isnull=True, expires_at__gt=now)


@dataclass
class Candidate:
    node: NodeView
    score: dict
    inventory: dict[str, tuple[int, int]]


def feasible_rows(rows, pool: Pool, spec: PlacementSpec, counts: GroupCounts, *, limit: int) -> tuple[list, int]:
    """The first ``limit`` rows (in the given, best-first order) that pass every non-resource filter.

    ``rows`` are tuples in the order of :data:`ROW_FIELDS` plus ``(allocatable, allocated)`` of every
    other requested resource, as :func:`candidate_query` yields them; their resources already fit.
    Shared by real grants (:func:`find_candidates`, rows from SQL) and the placement preview
    (:mod:`leases.preview`, rows held in memory): one filter for both. Returns ``(candidates, examined)``.
    """
    primary = primary_resource(spec)
    others = [name for name in sorted(spec.resources) if name != primary]
    feasible: list[Candidate] = []
    examined = 0
    for row in rows:
        examined += 1
        node = NodeView(*row[:7])
        if constraint_failure(node, pool, spec, counts) is None:
            inventory = {primary: (row[7], row[8])}
            for index, name in enumerate(others):
                inventory[name] = (row[9 + 2 * index], row[10 + 2 * index])
            feasible.append(Candidate(node, {}, inventory))
            if len(feasible) >= limit:
                break
    return feasible, examined


def device_tolerance(spec: PlacementSpec):
    if not spec.tolerations:
        return None
    return lambda taint: any(t.tolerates(taint) for t in spec.tolerations)


def _with_devices(found: list, spec: PlacementSpec) -> list:
    """The candidates whose devices can meet ``spec.devices``: one query for the whole page that
    answers which nodes pass (leases.sql.devices.device_rule_sql) when the rules are decided in SQL,
    else two that read the page's devices for :func:`leases.device_requests.choose`."""

    if device_sql.decided_in_sql(spec):
        passing = device_sql.nodes_passing(spec, [c.node.pk for c in found])
        return [c for c in found if c.node.pk in passing]

    rows, taken = lease_devices.node_devices(
        [c.node.pk for c in found], lease_devices.device_types(spec.devices), usable_only=not spec.tolerations
    )
    tolerates = device_tolerance(spec)
    return [
        c for c in found if not choose(spec.devices, rows.get(c.node.pk, []), taken.get(c.node.pk, set()),
                                       tolerates=tolerates).reason
    ]  # fmt: skip
