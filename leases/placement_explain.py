"""Placement's *explain* part (re-exported by leases.placement): why nothing fits — :func:`diagnose`,
the set-based 409 census under each node's first failed filter, its reasons and their phrases, and
the device reasons (leases.sql.devices' ``WITH`` table, or :func:`device_census`). Reads only; its
raw SQL (the census' planner settings and ``WITH`` table, the hostname and device-fingerprint
expressions, the device reasons) is :mod:`leases.sql.census`'s and :mod:`leases.sql.devices`'.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

from django.db.models import (
    BigIntegerField,
    Case,
    CharField,
    Count,
    F,
    FilteredRelation,
    Max,
    Min,
    Q,
    Sum,
    Value,
    When,
)
from django.db.models.fields.json import KeyTransform
from django.db.models.functions import Cast, Coalesce, Greatest
from django.db.models.lookups import Exact

from fleet.choices import Lifecycle
from fleet.labels import HOSTNAME_LABEL
from fleet.labelview import FEATURE_LABELS, NODE_ID_LABEL
from fleet.models import Node, Pool
from fleet.selectors import first_unschedulable_reason, valid_credential_exists

from . import devices as lease_devices
from . import impossible
from . import reliability as node_reliability
from .choices import UnschedulableCause
from .device_requests import LASTING_DEVICE_CODES, choose, reason_phrase
from .placement_filter import (
    ANTI_AFFINITY_CONFLICT,
    MISSING_FEATURE,
    NODE_AFFINITY_MISMATCH,
    NODE_SELECTOR_MISMATCH,
    UNTOLERATED_TAINT,
    GroupCounts,
    NodeView,
    constraint_failure,
    device_tolerance,
    insufficient_code,
    reads_as_index,
)
from .placement_score import group_counts
from .spec import PlacementSpec
from .sql import census as census_sql
from .sql import devices as device_sql

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


def phrase(code: str, resources: dict[str, int], extra: dict[str, str] | None = None) -> str:
    if extra and code in extra:
        return extra[code]
    for name in resources:
        if insufficient_code(name) == code:
            return f"Insufficient {name}"
    return PHRASES.get(code, code.replace("_", " "))


def device_census(spec: PlacementSpec, representatives: list) -> dict[Any, tuple[str, str]]:
    """Why nodes cannot give ``spec.devices``: ``{representative: (code, phrase)}``, ``("", "")``
    where they can.

    ``representatives``: one node id per group of nodes :func:`diagnose` grouped by
    :func:`device_fingerprint` (alike devices, as the request sees them). Each group answers with
    the first device rule its representative fails (leases.device_requests.choose) and that
    code's "node(s) had …" phrase as the request words it. Two queries whatever the number of nodes.
    """

    rows, taken = lease_devices.node_devices(list(representatives), lease_devices.device_types(spec.devices))
    tolerates = device_tolerance(spec)
    verdicts = {}
    for pk in representatives:
        choice = choose(spec.devices, rows.get(pk, []), taken.get(pk, set()), tolerates=tolerates)
        verdicts[pk] = (choice.code, choice.reason) if choice.reason else ("", "")
    return verdicts


def device_fingerprint(spec: PlacementSpec):
    """A correlated SQL expression over a ``fleet_node`` row: the text of its live devices of the
    requested types, each as the columns :func:`leases.device_requests.choose` reads plus whether
    it is verified and taken (held by a live lease, or the parent of a held MIG instance), sorted,
    so that two nodes whose devices the request cannot tell apart get the same text. NULL for a
    node without such devices. PostgreSQL and SQLite alike
    (:func:`leases.sql.census.device_fingerprint`).
    """
    return census_sql.device_fingerprint(sorted({r.type for r in spec.devices}), with_taints=bool(spec.tolerations))


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
    decided in SQL for every node at once (:func:`leases.sql.devices.device_reasons_sql`: one
    grouped pass over the device rows, the census' ``WITH`` table) when
    :func:`leases.sql.devices.decided_in_sql` holds; otherwise by :func:`device_fingerprint` (their
    devices as the request sees them), and the device rules run in Python once per group that
    passes every other filter (:func:`device_census`, two more queries). ``fragmented`` leaves
    out nodes whose devices freeing would not cure (``LASTING_DEVICE_CODES``: none of the type,
    none matching, only unhealthy ones): their capacity could never serve the request.
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
    devices_in_sql = bool(spec.devices) and device_sql.decided_in_sql(spec)
    if devices_in_sql:
        # Each node's device reason (or ''), decided in SQL: nodes group by it. Read for every node,
        # the unschedulable too (whose groups ignore it below): one hash join a node costs less
        # than a second evaluation of the first-reason CASE, credential probe included.
        nodes, signature["g_devices"] = device_sql.join_device_reasons(nodes, spec.devices[0], pool.pk)
    elif spec.devices:
        # Nodes with the same devices (as the request sees them) in one group, so that the device
        # rules run once per group below; computed for schedulable nodes only.
        signature["g_devices"] = Case(
            When(Exact(first_reason, Value("")), then=device_fingerprint(spec)), default=Value(None)
        )
    groups = census_sql.census_rows(
        nodes.values(g_reason=first_reason, g_lifecycle=F("lifecycle"), **signature).annotate(**aggregates).order_by()
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
    short_of_capacity = False  # such a node is short of a resource (and its devices could serve)
    device_phrases: dict[str, str] = {}
    candidates = []  # (group, its representative): schedulable, passing the constraint filters
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
        candidates.append((row, representative))
    # Each candidate group's device verdict (code, phrase): decided in SQL per node (the group key),
    # else on the group's representative, once per group of alike devices (two queries).
    if devices_in_sql:
        verdicts = {
            rep: (row["g_devices"], reason_phrase(spec.devices[0], row["g_devices"]) if row["g_devices"] else "")
            for row, rep in candidates
        }
    elif spec.devices and candidates:
        verdicts = device_census(spec, [rep for _, rep in candidates])
    else:
        verdicts = {}
    for row, representative in candidates:
        device_code, device_phrase = verdicts.get(representative, ("", ""))
        short = 0
        for i, name in enumerate(names):
            if row[f"short{i}"]:
                reasons[insufficient_code(name)] += row[f"short{i}"]
                short += row[f"short{i}"]
        if device_code not in LASTING_DEVICE_CODES:
            # Capacity is what stands in the way here, and freed capacity could place the request:
            # what makes the cause "insufficient capacity" or "fragmented". Nodes whose devices can
            # never serve the request (none of the type, none matching, only unhealthy ones) count
            # neither for that nor for holding it or for the pool's free capacity.
            short_of_capacity = short_of_capacity or short > 0
            for i, name in enumerate(names):
                pooled_free[name] += row[f"free_sum{i}"] or 0
            a_candidate_holds = a_candidate_holds or bool(row["holds"])
        if device_code and row["n"] > short:
            reasons[device_code] += row["n"] - short
            device_phrases[device_code] = device_phrase
    total = sum(g["n"] for g in groups)
    schedulable = sum(g["n"] for g in schedulable_groups)
    pending = sum(g["n"] for g in groups if g["g_lifecycle"] in (Lifecycle.PENDING, Lifecycle.ADMITTING))

    fragmented = (
        short_of_capacity and a_candidate_holds and all(pooled_free.get(n, 0) >= a for n, a in spec.resources.items())
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
    elif short_of_capacity:
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
        hostname_cases.append(When(census_sql.hostname_in(members), then=Value(MEMBER)))
    signature["g_hostname"] = Case(*hostname_cases, default=Value(""))
    signature["g_node"] = Case(When(pk__in=ids, then=Cast("pk", CharField())), default=Value(""))
    return signature
