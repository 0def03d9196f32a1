"""The 409 census' raw SQL (leases.placement_explain.diagnose): its hostname condition, the
devices' fingerprint and the planner settings of its GROUP BY.
"""

from __future__ import annotations

from django.db.models import BooleanField, TextField
from django.db.models.expressions import RawSQL

from fleet.device_counts import FINGERPRINT_COLUMNS
from fleet.models import Device, Node

from ..models import LeaseDevice
from .vendor import column_name, one_of, planner_settings, sorted_concat, table_name


def node_id_column() -> str:
    """``"fleet_node"."id"``, quoted for the connection: the node the device rules' SQL names."""
    return f"{table_name(Node)}.{column_name(Node, 'id')}"


def hostname_in(values: set[str]) -> RawSQL:
    """A condition on the census' node rows: the hostname is one of ``values`` (:func:`one_of`).
    A host-wide spread group names every host of the pool. SQL: the ORM's ``__in`` writes one
    placeholder per value."""
    condition, params = one_of(f"{table_name(Node)}.{column_name(Node, 'hostname')}", sorted(values))
    return RawSQL(condition, tuple(params), output_field=BooleanField())  # noqa: S611 (names from the model; values bound)


def device_fingerprint(types: list[str], *, with_taints: bool) -> RawSQL:
    """A correlated expression over a ``fleet_node`` row: the text of its live devices of
    ``types``, each as :data:`FINGERPRINT_COLUMNS` (and the JSON taints when ``with_taints``) plus
    whether it is verified and taken (held by a live lease, or the parent of a held MIG instance),
    sorted (:func:`sorted_concat`), so that two nodes whose devices a request cannot tell apart
    get the same text. NULL for a node without such devices (``leases.placement_explain
    .device_fingerprint``). SQL: the ORM has no ordered string aggregate on SQLite."""
    device, claim = table_name(Device), table_name(LeaseDevice)
    columns = [*FINGERPRINT_COLUMNS, "taints"] if with_taints else list(FINGERPRINT_COLUMNS)
    parts = [f"COALESCE(CAST(d.{column_name(Device, c)} AS TEXT), '~')" for c in columns]
    parts.append("CASE WHEN d.verified_at IS NULL THEN 'u' ELSE 'v' END")
    # Uncorrelated, so each is read once (a hashed subplan), not probed per device: live holds
    # are few next to the fleet's devices.
    parts.append(
        f"CASE WHEN d.id IN (SELECT ld.device_id FROM {claim} ld WHERE ld.live)"  # noqa: S608 (names from the models)
        f" OR (d.node_id, d.device_id) IN (SELECT c.node_id, c.parent_device_id FROM {claim} ld"
        f" INNER JOIN {device} c ON c.id = ld.device_id WHERE ld.live AND c.parent_device_id <> '')"
        " THEN 't' ELSE 'f' END"
    )
    text = " || '¦' || ".join(parts)
    placeholders = ", ".join(["%s"] * len(types))
    source = (
        f"FROM {device} d WHERE d.node_id = {node_id_column()} AND d.retired_at IS NULL AND d.type IN ({placeholders})"
    )
    return RawSQL(sorted_concat(text, "§", source), types, output_field=TextField())  # noqa: S611


def census_rows(queryset) -> list:
    """Run the census' GROUP BY (a ``values()`` queryset), on PostgreSQL as a hash aggregate.

    The planner cannot estimate how many groups a CASE over node columns and a few JSON keys
    make, so it assumes about one per node and sorts every node by those keys (JSON comparisons,
    an external merge sort at 100,000 nodes) before a GroupAggregate, whereas there are a handful
    of groups. ``enable_sort = off`` for this one statement (:func:`planner_settings`) lets it
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

    ``jit = off`` for the same statement: above ``jit_above_cost`` (a census of 10,000 nodes with
    device reasons is past it) PostgreSQL first compiles the query's expressions with LLVM, which
    took 45-57 ms of a 90 ms census here (``EXPLAIN ANALYZE``'s JIT timing, psql, this machine) and
    gave back less than that over one pass of the rows. PostgreSQL's own guidance (docs, "When to
    JIT?"): JIT pays off for long-running analytical queries, and its overhead exceeds what it
    saves on short ones.

    ``parallel_setup_cost = 100`` (default 1000) for the same statement: the device pass of a 409
    where it reads every node's devices (the ``WITH`` table; since device fingerprints, a busy
    pool, whose nodes with an allocation are each read on their own: 80,000 device rows at 10,000
    nodes of 8 GPUs) costs the planner about 6,000, under which a default setup price kept it
    serial. In two workers (Parallel Seq Scan, Partial HashAggregate, Gather) the whole 409 of
    bench/devices.py's two unmeetable kinds took 8-10 % less (p50 136 vs 147 ms and 110 vs 122 ms,
    alternating rounds in one process, machine loaded), and more where the second core is idle.

    ``random_page_cost = 1.1`` (default 4) for the same statement: the device reasons read the
    devices of a few nodes (leases.sql.devices.device_reasons_sql: a representative per device
    fingerprint, the nodes with anything allocated) through the index on the device's node, and at
    the default price of a random read (a disk's) the planner hashed all 80,000 device rows of a
    10,000-node fleet instead; a control plane's tables sit in memory, where 1.1 is the usual
    setting (PostgreSQL's docs on ``random_page_cost``: lower it when the data is cached). The
    409 of a model nobody has: 87 → 49 ms (``EXPLAIN ANALYZE``, psql, this machine).
    """
    with planner_settings(
        enable_sort="off", parallel_tuple_cost="0.02", parallel_setup_cost="100", jit="off", random_page_cost="1.1"
    ):
        return list(queryset)
