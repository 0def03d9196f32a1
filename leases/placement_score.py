"""Placement's scores (leases.placement's *score* part): the spread group's counts per topology
domain (:func:`group_counts`), a feasible node's score (:func:`score`: resources by pool policy,
spread, preferred affinity, PreferNoSchedule taints, reliability preferences) and the ranking that
chooses among the best (:func:`rank`). Reads only. :mod:`leases.placement` re-exports these names.
"""

from __future__ import annotations

import random
from typing import Any

from django.db.models import Count, F
from django.db.models.fields.json import KeyTransform

from fleet.choices import SchedulingPolicy
from fleet.labels import HOSTNAME_LABEL
from fleet.labelview import FEATURE_LABELS, NODE_ID_LABEL, identity_labels
from fleet.models import Node, Pool

from . import reliability as node_reliability
from .choices import LIVE_LEASE_STATES, SpreadMode
from .models import Lease
from .placement_filter import GroupCounts, NodeView, node_label_view, node_taints, reads_as_index, topology_domain
from .spec import PlacementSpec
from .sql import vendor as sql_vendor


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
    extract = sql_vendor.reads_json_values_exactly() and not any(map(reads_as_index, keys))
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
