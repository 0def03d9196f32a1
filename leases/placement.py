"""The scheduler: filter, score and explain. Reads only; reservation lives in services.

Shaped after the Kubernetes scheduling framework (pkg/scheduler/framework): hard filters in the
order NodeUnschedulable → TaintToleration → NodeAffinity (selector, required terms) → features →
NodeResourcesFit → anti-affinity, then scores (NodeResourcesFit Least/MostAllocated by pool
policy, PodTopologySpread, preferred NodeAffinity, PreferNoSchedule taints).

Speed: the fast path never scans the pool in Python. A SQL query returns schedulable nodes of the
pool whose free amount of the *primary* resource fits (``noderesource_free`` expression index on
``(name, allocatable - allocated)``; an extended resource such as ``nvidia.com/gpu`` when asked
for, else cpu: :func:`primary_resource`), with every other requested resource checked by a join
to its row, ordered by that free amount (ascending for binpack, descending for spread). The Python filters run
on pages of that stream until :data:`FEASIBLE_TARGET` feasible nodes are found — the same idea as
Kubernetes' ``percentageOfNodesToScore``, which also stops filtering once enough nodes fit. Only
when nothing fits does :func:`diagnose` look at every node of the pool, to explain why.

The parts live in their own modules (issue 28 step 8), all re-exported here: filter
(:mod:`leases.placement_filter`: the node view, the hard filters, the candidate SQL and its
compiled-queryset cache), score (:mod:`leases.placement_score`: the spread group's counts,
scoring, ranking) and explain (:mod:`leases.placement_explain`: the 409 census). This module keeps
the candidate search that runs them, :func:`find_candidates`.
"""

from __future__ import annotations

from typing import NamedTuple

from fleet.models import Pool

from .placement_explain import (  # noqa: F401  (re-exported: callers, tests and docs name leases.placement.X)
    EXCLUDED,
    MEMBER,
    PHRASES,
    device_census,
    device_fingerprint,
    diagnose,
    phrase,
)
from .placement_filter import (  # noqa: F401  (re-exported, as above)
    ANTI_AFFINITY_CONFLICT,
    HARD_TAINT_EFFECTS,
    MISSING_FEATURE,
    NODE_AFFINITY_MISMATCH,
    NODE_SELECTOR_MISMATCH,
    ROW_FIELDS,
    UNTOLERATED_TAINT,
    Candidate,
    GroupCounts,
    NodeView,
    _page_reader,
    _with_devices,
    candidate_fields,
    candidate_query,
    candidate_rows,
    constraint_failure,
    device_tolerance,
    feasible_rows,
    has_feature,
    insufficient_code,
    node_label_view,
    node_taints,
    node_taints_of_pool,
    primary_resource,
    reads_as_index,
    resource_failure,
    topology_domain,
)
from .placement_score import group_counts, rank, score  # noqa: F401  (re-exported, as above)
from .spec import PlacementSpec

POLICY_VERSION = "placement/1"
FEASIBLE_TARGET = 16  # feasible nodes to score per request (percentageOfNodesToScore's idea)
FIRST_PAGE_SIZE = 32  # most requests find enough feasible nodes in the first page
PAGE_SIZE = 1024
DEVICE_PAGE_SIZE = 64  # first page of a device-constrained request: its device rules pass fewer nodes


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
