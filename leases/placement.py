"""The scheduler: filter, score and explain. Reads only; reservation lives in services.

Shaped after the Kubernetes scheduling framework (pkg/scheduler/framework): hard filters in the
order NodeUnschedulable → TaintToleration → NodeAffinity (selector, required terms) → features →
NodeResourcesFit → anti-affinity, then scores (NodeResourcesFit Least/MostAllocated by pool
policy, PodTopologySpread, preferred NodeAffinity, PreferNoSchedule taints).

Speed: the fast path never scans the pool in Python. A SQL query returns schedulable nodes of the
pool whose free amount of the *primary* resource fits (``noderesource_free`` expression index on
``(name, allocatable - allocated)``), with every other requested resource checked by ``EXISTS``,
ordered by that free amount (ascending for binpack, descending for spread). The Python filters run
on pages of that stream until :data:`FEASIBLE_TARGET` feasible nodes are found — the same idea as
Kubernetes' ``percentageOfNodesToScore``, which also stops filtering once enough nodes fit. Only
when nothing fits does :func:`diagnose` look at every node of the pool, to explain why.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

from django.db import connection, transaction
from django.db.models import (
    BigIntegerField,
    BooleanField,
    Case,
    CharField,
    Count,
    Exists,
    ExpressionWrapper,
    F,
    FilteredRelation,
    Max,
    Min,
    OuterRef,
    Q,
    Sum,
    TextField,
    Value,
    When,
)
from django.db.models.expressions import RawSQL
from django.db.models.fields.json import KeyTransform
from django.db.models.functions import Cast, Coalesce, Greatest
from django.db.models.lookups import Exact
from django.utils import timezone

from fleet.choices import Lifecycle, SchedulingPolicy
from fleet.labels import HOSTNAME_LABEL
from fleet.labelview import FEATURE_LABELS, NODE_ID_LABEL, identity_labels, label_view
from fleet.models import Node, NodeCredential, NodeResource, Pool
from fleet.selectors import first_unschedulable_reason, schedulable_q, valid_credential_exists
from nodepool.db import prepared_cursor

from . import devices as lease_devices
from . import impossible
from . import reliability as node_reliability
from .choices import LIVE_LEASE_STATES, SpreadMode, UnschedulableCause
from .device_requests import choose, reason_phrase
from .models import Lease
from .spec import PlacementSpec

POLICY_VERSION = "placement/1"
_SENTINEL_NOW = datetime(1971, 3, 4, 5, 6, 7, 89, tzinfo=UTC)
HARD_TAINT_EFFECTS = ("NoSchedule", "NoExecute")  # the effects that keep work off (PreferNoSchedule only scores)
FEASIBLE_TARGET = 16  # feasible nodes to score per request (percentageOfNodesToScore's idea)
FIRST_PAGE_SIZE = 32  # most requests find enough feasible nodes in the first page
PAGE_SIZE = 1024
DEVICE_PAGE_SIZE = 64  # first page of a device-constrained request: its device rules pass fewer nodes

UNTOLERATED_TAINT = "untolerated_taint"
NODE_SELECTOR_MISMATCH = "node_selector_mismatch"
NODE_AFFINITY_MISMATCH = "node_affinity_mismatch"
MISSING_FEATURE = "missing_feature"
ANTI_AFFINITY_CONFLICT = "anti_affinity_conflict"
EXCLUDED = "excluded"
MEMBER = "\x1fmember"  # diagnose's group key for hosts that hold the spread group (no hostname looks like it)

# Kubernetes-style phrases for "0/N nodes are available: …".
PHRASES = {
    "lifecycle_not_ready": "node(s) were not in lifecycle ready",
    "cordoned": "node(s) were cordoned",
    "not_alive": "node(s) were not alive",
    "node_not_ready": "node(s) reported not ready",
    "ready_condition_false": "node(s) had condition Ready=False",
    "ready_condition_unknown": "node(s) had condition Ready=Unknown",
    "unhealthy": "node(s) were unhealthy",
    "no_valid_credential": "node(s) had no valid credential",
    "status_report_overdue": "node(s) had an overdue status report",
    UNTOLERATED_TAINT: "node(s) had untolerated taint",
    NODE_SELECTOR_MISMATCH: "node(s) didn't match the request's node selector",
    NODE_AFFINITY_MISMATCH: "node(s) didn't match the request's node affinity",
    MISSING_FEATURE: "node(s) lacked a required feature",
    ANTI_AFFINITY_CONFLICT: "node(s) didn't satisfy the group's anti-affinity rules",
    EXCLUDED: "node(s) were excluded",
}


def insufficient_code(resource: str) -> str:
    return "insufficient_" + re.sub(r"[^a-z0-9]+", "_", resource.lower()).strip("_")


def phrase(code: str, resources: dict[str, int], extra: dict[str, str] | None = None) -> str:
    if extra and code in extra:
        return extra[code]
    for name in resources:
        if insufficient_code(name) == code:
            return f"Insufficient {name}"
    return PHRASES.get(code, code.replace("_", " "))


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


def group_counts(spec: PlacementSpec, pool: Pool, *, exclude_lease_id=None) -> GroupCounts:
    """Live leases of ``spec``'s spread group per topology domain, across pools (the domain is the
    value of the first of ``spec.topology_labels`` in the lease's node's :func:`node_label_view`).

    One grouped query over the group's leases. It reads only what the label view needs for the
    topology keys: on PostgreSQL the keys' values out of the JSON documents (``->``/``#>``, exact
    JSON types), on SQLite the whole documents (whose JSON extraction turns ``"true"`` into a
    boolean), and the whole documents too for a key that :func:`reads_as_index`. A host-wide group
    of 10,000 leases then costs tens of milliseconds, not half a second of JSON decoding and label
    views per lease. A JSON ``null`` label value (which the API refuses) counts as absent here.
    """

    counts = GroupCounts()
    if not spec.spread_group:
        return counts
    leases = Lease.objects.filter(group=spec.spread_group, state__in=LIVE_LEASE_STATES)
    if exclude_lease_id:
        leases = leases.exclude(pk=exclude_lease_id)
    keys = spec.topology_labels
    identity = bool(set(keys) & {HOSTNAME_LABEL, NODE_ID_LABEL})
    columns: dict[str, Any] = {"pool_name": F("node__pool__name"), "trust": F("node__pool__trust_node_labels")}
    if identity:  # a node's own identity is its domain: one row per node
        columns.update(node_pk=F("node_id"), hostname=F("node__hostname"))
    extract = connection.vendor == "postgresql" and not any(map(reads_as_index, keys))
    extracted: list[tuple[str, str, str]] = []  # (column, document, key): the keys' values, read out
    if extract:
        documents = {"labels": "node__labels", "node_labels": "node__node_labels", "pool_labels": "node__pool__labels"}
        for i, key in enumerate(keys):
            for document, source in documents.items():
                extracted.append((f"{document}{i}", document, key))
                columns[f"{document}{i}"] = KeyTransform(key, source)
            for j, feature in enumerate(sorted({key, FEATURE_LABELS.get(key, key)})):  # arch → kubernetes.io/arch
                extracted.append((f"features{i}_{j}", "features", feature))
                columns[f"features{i}_{j}"] = KeyTransform(feature, KeyTransform("features", "node__verified"))
    else:
        columns.update(labels=F("node__labels"), node_labels=F("node__node_labels"), verified=F("node__verified"),
                       pool_labels=F("node__pool__labels"))  # fmt: skip
    pools: dict[tuple, Pool] = {}
    for row in leases.values(**columns).annotate(leases=Count("pk")).order_by():
        node_pk, hostname = row.get("node_pk"), row.get("hostname", "")
        if extract:
            found = [(document, key, row[column]) for column, document, key in extracted if row[column] is not None]
            docs: dict[str, dict] = {"labels": {}, "node_labels": {}, "pool_labels": {}, "features": {}}
            for document, key, value in found:
                docs[document][key] = value
            labels, declared, pool_labels = docs["labels"], docs["node_labels"], docs["pool_labels"]
            verified = {"features": docs["features"]}
        else:
            labels, declared, pool_labels = row["labels"], row["node_labels"], row["pool_labels"]
            verified = row["verified"]
        if extract and not found:  # no layer names a topology key: the node's identity decides
            view = identity_labels(node_pk, hostname, row["pool_name"])
        else:
            pool_key = (
                row["pool_name"],
                row["trust"],
                tuple(sorted((k, str(v)) for k, v in (pool_labels or {}).items())),
            )
            if pool_key not in pools:  # a model instance per row would be most of the cost
                pools[pool_key] = Pool(name=row["pool_name"], labels=pool_labels, trust_node_labels=row["trust"])
            view = node_label_view(NodeView(node_pk, hostname, labels, declared, [], verified, 0), pools[pool_key])
        domain = topology_domain(view, spec)
        if domain is not None:
            counts.by_domain[domain] += row["leases"]
    return counts


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


# --- scores ----------------------------------------------------------------------------------------
def score(
    node: Node, pool: Pool, spec: PlacementSpec, inventory: dict[str, tuple[int, int]], counts, extra_parts=None
) -> dict:
    """Score a feasible node, 0–100 per part. ``inventory`` is ``{resource: (allocatable, allocated)}``;
    ``extra_parts``: parts computed elsewhere (``reliability``: leases.reliability.preference_parts)."""
    fractions = []
    for name, amount in spec.resources.items():
        allocatable, allocated = inventory.get(name, (0, 0))
        fractions.append(min(1.0, (allocated + amount) / allocatable) if allocatable else 1.0)
    used = sum(fractions) / len(fractions) if fractions else 0.0
    # Kubernetes NodeResourcesFit: MostAllocated packs, LeastAllocated spreads.
    resources = used * 100 if pool.scheduling_policy == SchedulingPolicy.BINPACK else (1 - used) * 100
    parts = {"resources": round(resources, 2)}
    if spec.spread_group and spec.spread_mode == SpreadMode.SPREAD:
        domain = topology_domain(node_label_view(node, pool), spec)
        count = counts.by_domain.get(domain, 0) if domain is not None else counts.max
        parts["spread"] = round(100 * (1 - count / (counts.max + 1)), 2)
    if spec.preferred:
        total = sum(w for w, _ in spec.preferred)
        labels = node_label_view(node, pool)
        parts["affinity"] = round(100 * sum(w for w, req in spec.preferred if req.matches(labels)) / total, 2)
    prefer_no = [t for t in node_taints(node, pool) if t.get("effect") == "PreferNoSchedule"]
    if prefer_no:
        untolerated = sum(1 for t in prefer_no if not any(tol.tolerates(t) for tol in spec.tolerations))
        parts["taints"] = round(100 * (1 - untolerated / len(prefer_no)), 2)
    parts.update(extra_parts or {})
    # Spread weighs double: a group's resilience matters more than packing density.
    weights = {"resources": 1, "spread": 2, "affinity": 1, "taints": 1, "reliability": 1}
    total = sum(parts[k] * weights[k] for k in parts) / sum(weights[k] for k in parts)
    return {"score": round(total, 2), "parts": parts}


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
    """The resource the SQL orders by: cpu when asked for, else the largest relative ask."""
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

    Driven from ``NodeResource`` through the ``noderesource_free`` index (``name``, free, node): the
    planner walks the index in order and stops at the page's LIMIT. Yields tuples in the order of
    :func:`candidate_fields`.
    """
    qs = candidate_rows(
        pool, spec, now=now, exclude_node_ids=exclude_node_ids, node_constraint_values=node_constraint_values
    )
    # Kubernetes' MostAllocated wants the fullest node; LeastAllocated the emptiest.
    order = (
        ("free_amount", "node_id")
        if pool.scheduling_policy == SchedulingPolicy.BINPACK
        else ("-free_amount", "-node_id")
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


_COMPILED: dict[tuple, tuple[str, list, dict[int, Any]]] = {}


def _page_reader(pool: Pool, spec: PlacementSpec, *, now=None, exclude_node_ids=()):
    """``read(offset, limit) -> rows`` (a list of row tuples) for :func:`candidate_query`; their JSON
    columns may still be text, which :class:`NodeView` decodes on first read.

    Building and compiling that queryset costs more than running it (several milliseconds of
    ORM work per request), so its SQL is compiled once per query shape — policy and requested
    resource names — with sentinel values that are swapped for the request's pool, amounts and
    time. The ORM (and so ``fleet.selectors.schedulable_q``) stays the source of the SQL.
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
        _COMPILED[key] = (sql + " LIMIT %s OFFSET %s", list(params), slots)
    sql, template, slots = _COMPILED[key]
    values = {
        "pool": pool.pk,
        "now": connection.ops.adapt_datetimefield_value(now),
        **{f"r:{n}": a for n, a in spec.resources.items()},
        **{f"nc:{i}": c.value for i, c in enumerate(spec.node_constraints)},
    }
    params = list(template)
    for index, name in slots.items():
        params[index] = values[name]

    if connection.vendor == "postgresql":  # prepared: see _prepared_form
        sql, params = _prepared_form(sql, params, slots, pool.pk)

    def read(offset: int, limit: int) -> list[tuple]:
        with prepared_cursor() as cursor:
            cursor.execute(sql, [*params, limit, offset])
            rows = cursor.fetchall()
        if connection.vendor == "sqlite":  # UUIDs stored as 32 hex digits; JSON stays text (NodeView)
            rows = [(uuid.UUID(row[0]), *row[1:]) for row in rows]
        return rows

    return read


def _prepared_form(sql: str, params: list, slots: dict[int, str], pool_id) -> tuple[str, list]:
    """The candidate SQL for a prepared statement on PostgreSQL: the pool's id written into the
    text, the other values (amounts, time, page) left as parameters.

    Planning the candidate query costs more than running it (about 1 ms against 0.3 ms at 10,000
    nodes). A prepared statement under a generic plan is planned once per connection; the pool is
    written in so that each pool gets its own statement and plan, made with that pool's size in
    view (a plan for a 20-node pool in a 100,000-node fleet is not the plan for the big pool).
    """
    pool_index = next(index for index, name in slots.items() if name == "pool")
    parts = sql.split("%s")
    if len(parts) != len(params) + 3:  # + LIMIT, OFFSET
        raise RuntimeError("the candidate SQL has a literal %s")  # never: Django escapes it as %%
    text = "".join(
        part + ("" if index == len(parts) - 1 else (str(int(pool_id)) if index == pool_index else "%s"))
        for index, part in enumerate(parts)
    )
    return text, [value for index, value in enumerate(params) if index != pool_index]


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


def rank(feasible: list, pool: Pool, spec: PlacementSpec, counts: GroupCounts, *, shuffle_ties: bool = True) -> list:
    """Score ``feasible`` candidates and sort them best first (in place; also returned).

    Like Kubernetes' selectHost, real grants pick at random among the nodes that share the best
    score (``shuffle_ties``): racing clients then spread over equal nodes instead of queueing on one
    node's capacity rows. The preview keeps the stable order so that its answer is reproducible.
    """
    preferred = node_reliability.preference_parts(feasible, spec.node_preferences)
    for candidate in feasible:
        candidate.score = score(
            candidate.node, pool, spec, candidate.inventory, counts, preferred.get(candidate.node.pk)
        )
    feasible.sort(key=lambda c: -c.score["score"])
    best = [c for c in feasible if feasible[0].score["score"] - c.score["score"] < 1e-6]
    if shuffle_ties and len(best) > 1:
        random.shuffle(best)
        feasible[: len(best)] = best
    return feasible


class Search(NamedTuple):
    """What :func:`find_candidates` found.

    ``candidates``: feasible nodes, best score first (at most :data:`FEASIBLE_TARGET`); empty when
    nothing fits. ``examined``: rows the filters looked at. ``explanation``: :func:`diagnose`'s
    answer when the search already asked the census (nothing fits), else None; a caller that must
    explain an empty search uses it rather than running the census a second time.
    """

    candidates: list[Candidate]
    examined: int
    explanation: dict | None = None


def _first_page_size(pool: Pool, spec: PlacementSpec) -> int:
    """:data:`FEASIBLE_TARGET` rows when the candidate SQL applies every filter (no toleration, no
    hard pool taint, no selector, affinity, feature or anti-affinity): each row it returns is then
    a feasible node, and a larger page would only be read past. Else :data:`FIRST_PAGE_SIZE`, room
    for the rows the Python filters turn down."""
    sql_decides = (
        not spec.tolerations
        and not any(isinstance(t, dict) and t.get("effect") in HARD_TAINT_EFFECTS for t in pool.taints or [])
        and not (spec.node_selector or spec.required or spec.features)
        and not spec.anti_affinity
    )
    if spec.device_constrained:
        return DEVICE_PAGE_SIZE
    return FEASIBLE_TARGET if sql_decides else FIRST_PAGE_SIZE


def find_candidates(pool: Pool, spec: PlacementSpec, *, now=None, exclude_node_ids=(), exclude_lease_id=None) -> Search:
    """Feasible nodes of ``pool`` for ``spec``, best first, as a :class:`Search`. Reads only."""
    counts = group_counts(spec, pool, exclude_lease_id=exclude_lease_id)
    query = _page_reader(pool, spec, now=now, exclude_node_ids=exclude_node_ids)
    feasible: list[Candidate] = []
    examined, offset = 0, 0
    page_size = first_page = _first_page_size(pool, spec)
    while len(feasible) < FEASIBLE_TARGET:
        page = query(offset, page_size)
        offset += page_size
        if spec.device_constrained:
            # Device rules run on the whole page at once (two queries), not per 16 rows: a request
            # for one model skips about every other node, and small pages meant several rounds.
            found, seen = feasible_rows(page, pool, spec, counts, limit=len(page) + 1)
            found = _with_devices(found, spec)[: FEASIBLE_TARGET - len(feasible)] if found else found
        else:
            found, seen = feasible_rows(page, pool, spec, counts, limit=FEASIBLE_TARGET - len(feasible))
        feasible += found
        examined += seen
        if len(page) < page_size:
            break
        if not feasible and offset == first_page:
            # A full first page and not one feasible node: ask the set-based census (every node
            # counted under its first failed filter; the nodes that pass are the ones left). When
            # a constraint (a selector, a taint, anti-affinity) excludes every node, walking on
            # would be the whole pool in Python (about a second at 10,000 nodes, a minute at
            # 100,000); the census answers in a few grouped queries, and is the explanation too.
            explanation = diagnose(
                pool, spec, now=now, exclude_node_ids=exclude_node_ids, exclude_lease_id=exclude_lease_id, counts=counts
            )
            if sum(explanation["reasons"].values()) >= explanation["nodes_considered"]:
                return Search([], examined, explanation)
        # Size the next page from the pass rate seen so far, so a selective request needs one
        # more query rather than several.
        rate = max(len(feasible), 1) / examined
        page_size = min(PAGE_SIZE, max(FIRST_PAGE_SIZE, int((FEASIBLE_TARGET - len(feasible)) / rate * 1.5)))
    return Search(rank(feasible, pool, spec, counts), examined)


def device_tolerance(spec: PlacementSpec):
    if not spec.tolerations:
        return None
    return lambda taint: any(t.tolerates(taint) for t in spec.tolerations)


def _with_devices(found: list, spec: PlacementSpec) -> list:
    """The candidates whose devices can meet ``spec.devices``: one query for the whole page that
    answers which nodes pass (leases.devices.device_rule_sql) when the rules are decided in SQL,
    else two that read the page's devices for :func:`leases.device_requests.choose`."""

    if lease_devices.decided_in_sql(spec):
        passing = lease_devices.nodes_passing(spec, [c.node.pk for c in found])
        return [c for c in found if c.node.pk in passing]

    rows, taken = lease_devices.node_devices(
        [c.node.pk for c in found], lease_devices.device_types(spec.devices), usable_only=not spec.tolerations
    )
    tolerates = device_tolerance(spec)
    return [
        c for c in found if not choose(spec.devices, rows.get(c.node.pk, []), taken.get(c.node.pk, set()),
                                       tolerates=tolerates).reason
    ]  # fmt: skip


def _node_id_column() -> str:
    """``"fleet_node"."id"``, quoted for the connection: the node the device rules' SQL names."""
    return f"{connection.ops.quote_name(Node._meta.db_table)}.{connection.ops.quote_name('id')}"


def device_census(spec: PlacementSpec, groups: list[tuple[Any, int]]) -> tuple[Counter, dict[str, str]]:
    """Why nodes that pass every other filter cannot give ``spec.devices``: ``(reasons, phrases)``.

    ``groups``: ``[(representative node id, nodes)]``, nodes :func:`diagnose` grouped by
    :func:`device_fingerprint` (alike devices, as the request sees them). Each group counts under
    the first device rule its representative fails (leases.device_requests.choose); the "node(s)
    had …" phrase of each code as the request words it. Two queries whatever the number of nodes.
    """

    rows, taken = lease_devices.node_devices([pk for pk, _ in groups], lease_devices.device_types(spec.devices))
    tolerates = device_tolerance(spec)
    reasons: Counter = Counter()
    phrases: dict[str, str] = {}
    for pk, count in groups:
        choice = choose(spec.devices, rows.get(pk, []), taken.get(pk, set()), tolerates=tolerates)
        if choice.reason:
            reasons[choice.code] += count
            phrases.setdefault(choice.code, choice.reason)
    return reasons, phrases


# The columns of a device that leases.device_requests.choose reads (constraints, colocation,
# usability), in the order of device_fingerprint's text; JSON taints only when tolerations matter.
_FINGERPRINT_COLUMNS = (
    "type",
    "index",
    "model",
    "memory_bytes",
    "mig_profile",
    "numa_node",
    "interconnect_group",
    "driver_version",
    "cuda_version",
    "pci_bus_id",
    "held",
    "health",
    "hard_tainted",
)


def device_fingerprint(spec: PlacementSpec):
    """A correlated SQL expression over a ``fleet_node`` row: the text of its live devices of the
    requested types, each as the columns :func:`leases.device_requests.choose` reads plus whether
    it is verified and taken (held by a live lease, or the parent of a held MIG instance), sorted,
    so that two nodes whose devices the request cannot tell apart get the same text. NULL for a
    node without such devices. PostgreSQL and SQLite alike (``string_agg`` / ``group_concat``).
    """

    columns = [*_FINGERPRINT_COLUMNS, "taints"] if spec.tolerations else list(_FINGERPRINT_COLUMNS)
    parts = [f"COALESCE(CAST(d.\"{c}\" AS TEXT), '~')" for c in columns]
    parts.append("CASE WHEN d.verified_at IS NULL THEN 'u' ELSE 'v' END")
    # Uncorrelated, so each is read once (a hashed subplan), not probed per device: live holds
    # are few next to the fleet's devices.
    parts.append(
        "CASE WHEN d.id IN (SELECT ld.device_id FROM leases_leasedevice ld WHERE ld.live)"
        " OR (d.node_id, d.device_id) IN (SELECT c.node_id, c.parent_device_id FROM leases_leasedevice ld"
        " INNER JOIN fleet_device c ON c.id = ld.device_id WHERE ld.live AND c.parent_device_id <> '')"
        " THEN 't' ELSE 'f' END"
    )
    text = " || '¦' || ".join(parts)
    types = sorted({r.type for r in spec.devices})
    placeholders = ", ".join(["%s"] * len(types))
    where = f"d.node_id = fleet_node.id AND d.retired_at IS NULL AND d.type IN ({placeholders})"
    # string_agg sorts in the aggregate; SQLite (before 3.44) concatenates in the subquery's order.
    aggregate, order = (
        ("string_agg(x, '§' ORDER BY x)", "")
        if connection.vendor == "postgresql"
        else ("group_concat(x, '§')", " ORDER BY x")
    )
    sql = f"(SELECT {aggregate} FROM (SELECT {text} AS x FROM fleet_device d WHERE {where}{order}) s)"  # noqa: S608 (column names from the model; types bound)
    return RawSQL(sql, types, output_field=TextField())  # noqa: S611


# --- explanation -----------------------------------------------------------------------------------


def diagnose(
    pool: Pool, spec: PlacementSpec, *, now=None, exclude_node_ids=(), exclude_lease_id=None, counts=None
) -> dict:
    """Why nothing fits: every non-retired node of the pool counted once, under its first failed filter.

    ``counts``: the spread group's :func:`group_counts` when the caller has them already (the
    candidate search does), else they are read here.

    Returns ``{"reasons": {code: count}, "nodes_considered": N, "fragmented": bool, "cause": str,
    "pending_admission": int, "message": "0/N nodes are available: …", "too_large": dict | None}``.

    ``cause`` ``too_large``: no node of the pool (any lifecycle but rejected) nor node template
    could ever hold the request (:mod:`leases.impossible`, whose ``too_large`` object is returned).
    ``fragmented`` requires both that the free capacity of the schedulable nodes that pass the
    constraints would fit in total and that one of them could hold the request once freed.

    Set-based, so that a 409 stays cheap on a large pool (issue "machine traffic at fleet scale":
    p99 ≤ 50 ms at 10,000 nodes). Three queries whatever the pool's size:

    1. the spread group's live leases per topology domain (:func:`group_counts`);
    2. the pool's nodes grouped by their first unschedulable reason
       (``fleet.selectors.first_unschedulable_reason``), their lifecycle and what the request's
       constraint filters can tell apart (:func:`_signature`), with, per group, one representative
       node, the count of nodes whose first short resource is each requested resource (sorted by
       name, as :func:`resource_failure` checks them) and the sum of free capacity;
    3. the representative nodes of the schedulable groups.

    The constraint filters (:func:`constraint_failure`) then run once per group, on its
    representative, not once per node: a request's 409 costs about the same on 100 or 100,000
    alike nodes. A request for devices also groups the schedulable nodes by their device reason,
    decided in SQL per node (:func:`leases.devices.device_rule_sql`: one aggregate over the node's
    device rows in the same query) when :func:`leases.devices.decided_in_sql` holds; otherwise by
    :func:`device_fingerprint` (their devices as the request sees them), and the device rules run
    in Python once per group that passes every other filter (:func:`device_census`, two more
    queries).
    """

    if counts is None:
        counts = group_counts(spec, pool, exclude_lease_id=exclude_lease_id)
    excluded = [uuid.UUID(str(pk)) for pk in exclude_node_ids]
    first_reason = first_unschedulable_reason()
    if excluded:
        first_reason = Case(When(pk__in=excluded, then=Value(EXCLUDED)), default=first_reason)
    nodes = (
        Node.objects.filter(pool=pool)
        .exclude(lifecycle=Lifecycle.RETIRED)
        .alias(has_valid_credential=valid_credential_exists(now))
    )
    names = sorted(spec.resources)
    fits: list[Q] = []
    aggregates: dict[str, Any] = {"n": Count("pk"), "representative": Min(Cast("pk", CharField()))}
    holds: list[Q] = []  # the node's allocatable covers the whole request (it would fit once empty)
    for i, name in enumerate(names):
        nodes = nodes.alias(
            **{f"res{i}": FilteredRelation("resources", condition=Q(resources__name=name))}
        ).alias(
            **{f"free{i}": Coalesce(
                Greatest(F(f"res{i}__allocatable") - F(f"res{i}__allocated"), Value(0)),
                Value(0), output_field=BigIntegerField(),
            )}
        )  # fmt: skip
        nodes = nodes.alias(
            **{f"alloc{i}": Coalesce(F(f"res{i}__allocatable"), Value(0), output_field=BigIntegerField())}
        )
        short = Q(**{f"free{i}__lt": spec.resources[name]})
        aggregates[f"short{i}"] = Sum(Case(When(Q(*fits) & short, then=Value(1)), default=Value(0)))
        aggregates[f"free_sum{i}"] = Sum(f"free{i}")
        aggregates[f"largest{i}"] = Max(f"alloc{i}")
        fits.append(~short)
        holds.append(Q(**{f"alloc{i}__gte": spec.resources[name]}))
    aggregates["holds"] = Sum(Case(When(Q(*holds), then=Value(1)), default=Value(0)))
    signature = _signature(pool, spec, counts)
    if spec.node_constraints:
        signature[node_reliability.CENSUS_KEY] = node_reliability.census_reason(spec.node_constraints)
    devices_in_sql = bool(spec.devices) and lease_devices.decided_in_sql(spec)
    if devices_in_sql:
        # Each schedulable node's device reason (or ''), decided in SQL: nodes group by it.
        signature["g_devices"] = Case(
            When(Exact(first_reason, Value("")), then=lease_devices.device_reason_sets(spec, _node_id_column())),
            default=Value(None),
        )
    elif spec.devices:
        # Nodes with the same devices (as the request sees them) in one group, so that the device
        # rules run once per group below; computed for schedulable nodes only.
        signature["g_devices"] = Case(
            When(Exact(first_reason, Value("")), then=device_fingerprint(spec)), default=Value(None)
        )
    groups = _hash_grouped(
        nodes.values(g_reason=first_reason, g_lifecycle=F("lifecycle"), **signature).annotate(**aggregates).order_by(),
        with_table=(lease_devices.DEVICE_REASONS, *lease_devices.device_reasons_sql(spec.devices[0]))
        if devices_in_sql
        else None,
    )
    schedulable_groups = [g for g in groups if not g["g_reason"]]
    representatives = {
        row[0]: NodeView(*row)
        for row in Node.objects.filter(pk__in=[uuid.UUID(g["representative"]) for g in schedulable_groups]).values_list(
            "id", "hostname", "labels", "node_labels", "taints", "verified", "incarnation"
        )
    }
    reasons: Counter = Counter()
    pooled_free: Counter = Counter()
    a_candidate_holds = False  # a schedulable node passing the constraints would hold it once freed
    device_groups: list[tuple[uuid.UUID, int]] = []  # (representative, nodes passing every other filter)
    device_phrases: dict[str, str] = {}
    for row in groups:
        if row["g_reason"]:
            reasons[row["g_reason"]] += row["n"]
            continue
        representative = uuid.UUID(row["representative"])
        code = constraint_failure(representatives[representative], pool, spec, counts)
        code = code or row.get(node_reliability.CENSUS_KEY) or None  # after the label filters, before resources
        if code is not None:
            reasons[code] += row["n"]
            continue
        short = 0
        for i, name in enumerate(names):
            if row[f"short{i}"]:
                reasons[insufficient_code(name)] += row[f"short{i}"]
                short += row[f"short{i}"]
            pooled_free[name] += row[f"free_sum{i}"] or 0
        a_candidate_holds = a_candidate_holds or bool(row["holds"])
        if devices_in_sql and row["g_devices"] and row["n"] > short:
            reasons[row["g_devices"]] += row["n"] - short
            device_phrases[row["g_devices"]] = reason_phrase(spec.devices[0], row["g_devices"])
        elif spec.devices and not devices_in_sql and row["n"] > short:
            device_groups.append((representative, row["n"] - short))
    total = sum(g["n"] for g in groups)
    schedulable = sum(g["n"] for g in schedulable_groups)
    if device_groups:
        # Nodes that pass every other filter: counted under their first failed device rule, decided
        # once per device group on its representative's devices (two queries).
        device_reasons, device_phrases = device_census(spec, device_groups)
        reasons.update(device_reasons)
    pending = sum(g["n"] for g in groups if g["g_lifecycle"] in (Lifecycle.PENDING, Lifecycle.ADMITTING))

    insufficient = any(code.startswith("insufficient_") for code in reasons)
    fragmented = (
        insufficient and a_candidate_holds and all(pooled_free.get(n, 0) >= a for n, a in spec.resources.items())
    )
    too_large = _too_large(pool, spec, names, [g for g in groups if g["g_lifecycle"] != Lifecycle.REJECTED])
    if too_large is not None:
        cause = UnschedulableCause.TOO_LARGE
    elif not total:
        cause = UnschedulableCause.NO_NODES
    elif schedulable == 0:
        cause = UnschedulableCause.NO_READY_NODES
    elif fragmented:
        cause = UnschedulableCause.FRAGMENTED
    elif insufficient:
        cause = UnschedulableCause.INSUFFICIENT_CAPACITY
    else:
        cause = UnschedulableCause.CONSTRAINTS
    parts = [
        f"{count} {phrase(code, spec.resources, {**device_phrases, **node_reliability.phrases(spec.node_constraints)})}"
        for code, count in sorted(reasons.items(), key=lambda i: -i[1])
    ]
    message = f"0/{total} nodes are available: " + (", ".join(parts) if parts else "no nodes in the pool") + "."
    if cause == UnschedulableCause.NO_READY_NODES:
        message += f" No ready nodes ({pending} pending admission)."
    elif too_large is not None:
        message += f" {too_large.message[0].upper()}{too_large.message[1:]}: it could never be placed."
    elif fragmented:
        message += " The pool has enough free capacity in total, but it is fragmented: no single node fits now."
    return {
        "reasons": dict(reasons),
        "nodes_considered": total,
        "fragmented": fragmented,
        "cause": str(cause),
        "pending_admission": pending,
        "message": message,
        "too_large": too_large.detail() if too_large is not None else None,
    }


def _too_large(pool: Pool, spec: PlacementSpec, names: list[str], groups: list[dict]):
    """:func:`leases.impossible.summary_verdict` from diagnose's groups (nodes not rejected)."""
    if not spec.resources or any(row["holds"] for row in groups):
        return None  # the common case: one node holds it, no further lookup
    templates = impossible.growth_shapes(pool)
    if not groups and not templates:
        return None  # an empty pool that cannot grow: cause no_nodes says it better
    largest = {name: max((row[f"largest{i}"] or 0 for row in groups), default=0) for i, name in enumerate(names)}
    # A node still in admission has no inventory yet: what it declared (less the pool's
    # reservations) is what it may bring.
    admitting = (Lifecycle.PENDING, Lifecycle.ADMITTING)
    if any(row["g_lifecycle"] in admitting for row in groups):
        reserved = pool.reserved_totals()
        for declared in Node.objects.filter(pool=pool, lifecycle__in=admitting).values_list("declared", flat=True):
            shape = impossible.declared_allocatable(declared, reserved)
            if impossible.holds(shape, spec.resources):
                return None
            largest = {name: max(largest[name], shape.get(name, 0)) for name in names}
    return impossible.summary_verdict(
        pool.name,
        spec.resources,
        any_node_holds=False,
        node_largest=largest,
        nodes_considered=sum(row["n"] for row in groups),
        template_shapes=templates,
    )


def _hostname_in(values: set[str]):
    """A condition on the census' node rows: the hostname is one of ``values``, sent as one
    parameter however many values there are. A host-wide group names every host of the pool, and
    10,000 placeholders cost more to build, send and parse than the grouping itself."""

    # The SQL names only the model's own table and column; the values travel as a parameter.
    column = f"{connection.ops.quote_name(Node._meta.db_table)}.{connection.ops.quote_name('hostname')}"
    if connection.vendor == "postgresql":
        return RawSQL(f"{column} = ANY(%s)", (sorted(values),), output_field=BooleanField())  # noqa: S611
    sql = f"{column} IN (SELECT value FROM json_each(%s))"  # noqa: S608
    return RawSQL(sql, (json.dumps(sorted(values)),), output_field=BooleanField())  # noqa: S611


def _hash_grouped(queryset, with_table: tuple[str, str, list] | None = None) -> list[dict]:
    """Run the census' GROUP BY, on PostgreSQL as a hash aggregate.

    The planner cannot estimate how many groups a CASE over node columns and a few JSON keys
    make, so it assumes about one per node and sorts every node by those keys (JSON comparisons,
    an external merge sort at 100,000 nodes) before a GroupAggregate, whereas there are a handful
    of groups. ``enable_sort = off`` for this one statement, in its own (sub)transaction, lets it
    hash them instead: about 20 % faster at 10,000 nodes and 35 % at 100,000 (400-450 → 280-300
    ms for the selector kinds of bench/placement.py, run alone).
    More groups than fit in ``work_mem`` still work: a hash aggregate spills to disk since
    PostgreSQL 13. SQLite has no such planner setting and runs the query as it is.

    ``parallel_tuple_cost = 0.02`` (default 0.1) for the same statement: the aggregate cannot run
    below a Gather (the credential check in its group key is a hashed subplan, which only the
    leader runs), so a parallel plan sends every node row from the workers to the leader, and at
    the default price per row the planner kept the scans and the two resource joins serial. With
    them in parallel workers (``max_parallel_workers_per_gather``, 2 by default) the census of
    100,000 nodes took 220-255 ms instead of 345-370 (psql, this machine, nothing else running).
    Small pools stay serial: a table under ``min_parallel_table_scan_size`` is never split.

    ``with_table``: ``(name, sql, params)`` of a table the query reads, computed once before it
    (``WITH name AS MATERIALIZED (sql)``): the devices' reasons of every node, in one grouped pass
    over the device rows (leases.devices.device_reasons_sql), which the query's expressions look
    up by node.
    """

    if connection.vendor != "postgresql":
        return _with_table(queryset, with_table) if with_table else list(queryset)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_sort = off")
        cursor.execute("SET LOCAL parallel_tuple_cost = 0.02")
        rows = _with_table(queryset, with_table) if with_table else list(queryset)
        # The rest of an enclosing transaction plans as configured again.
        cursor.execute("SET LOCAL enable_sort TO DEFAULT")
        cursor.execute("SET LOCAL parallel_tuple_cost TO DEFAULT")
    return rows


def _with_table(queryset, with_table: tuple[str, str, list]) -> list[dict]:
    """The rows of a ``values()`` queryset run with a ``WITH`` table ahead of its SQL (the ORM
    cannot say one), converted as the ORM would convert them."""
    name, table_sql, table_params = with_table
    compiler = queryset.query.get_compiler(connection=connection)
    sql, params = compiler.as_sql()
    materialized = "MATERIALIZED " if connection.vendor == "postgresql" else ""  # SQLite: its choice
    with connection.cursor() as cursor:
        cursor.execute(f"WITH {name} AS {materialized}({table_sql}) {sql}", [*table_params, *params])
        names = [column[0] for column in cursor.description]
        rows = cursor.fetchall()
    converters = compiler.get_converters([expression for expression, _, _ in compiler.select])
    if converters:
        rows = compiler.apply_converters(rows, converters)
    return [dict(zip(names, row, strict=True)) for row in rows]


def _signature(pool: Pool, spec: PlacementSpec, counts: GroupCounts) -> dict[str, Any]:
    """Expressions that group nodes which :func:`constraint_failure` cannot tell apart for ``spec``.

    The filters read taints, the labels the request names (node selector, required affinity, the
    anti-affinity topology key) and the features it asks for, so the group key is the taints and
    those keys alone — of ``labels``, of ``node_labels`` when the pool trusts them, and of the
    verified features (which are labels too). A node's own identity (hostname, node id) matters
    only through the values the request names or the spread group holds: nodes whose identity is
    none of them fall in one group. A ``Gt``/``Lt`` requirement on an identity label compares
    numbers, so it makes every node its own group.
    """

    keys = set(spec.node_selector) | {req.key for req in spec.required}
    if spec.anti_affinity:
        keys |= set(spec.topology_labels)
    features = KeyTransform("features", "verified")

    def value_of(key: str, document):  # the whole document when the key would read as an index
        if reads_as_index(key):
            return document if isinstance(document, KeyTransform) else F(document)
        return KeyTransform(key, document)

    signature: dict[str, Any] = {"g_taints": F("taints")}
    for i, key in enumerate(sorted(keys)):
        signature[f"g_label{i}"] = value_of(key, "labels")
        if pool.trust_node_labels:
            signature[f"g_declared{i}"] = value_of(key, "node_labels")
        signature[f"g_feature_label{i}"] = value_of(FEATURE_LABELS.get(key, key), features)
    for i, key in enumerate(sorted(spec.features)):
        signature[f"g_feature{i}"] = (
            KeyTransform("accelerators", "verified") if key == "accelerator_model" else value_of(key, features)
        )
    identity_keys = keys & {HOSTNAME_LABEL, NODE_ID_LABEL}
    if not identity_keys:
        return signature
    if any(req.key in identity_keys and req.operator in ("Gt", "Lt") for req in spec.required):
        signature["g_node"] = F("pk")
        return signature
    named = {str(v) for v in spec.node_selector.values()} | {v for req in spec.required for v in req.values}
    # Hosts that hold the spread group (host topology): one group of all of them (the MEMBER
    # mark), not one per host. Alike otherwise, they fail or pass anti-affinity alike: a host's
    # domain is its hostname unless a label, declared label, pool label or feature overrides it,
    # and those are in the group key already. A node without hostname has its id as domain, and
    # a node-id topology names ids: both are told apart by g_node below.
    members = {value for value in counts.by_domain if value and value not in named}
    ids = []
    for value in named | set(counts.by_domain):
        try:
            ids.append(uuid.UUID(value))
        except ValueError:
            continue
    hostname_cases = [When(hostname__in=named, then=F("hostname"))]
    if members:
        hostname_cases.append(When(_hostname_in(members), then=Value(MEMBER)))
    signature["g_hostname"] = Case(*hostname_cases, default=Value(""))
    signature["g_node"] = Case(When(pk__in=ids, then=Cast("pk", CharField())), default=Value(""))
    return signature
