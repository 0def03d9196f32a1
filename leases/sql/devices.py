"""The device statements of leases: the grant's claim (leases.devices.claim) and the device
rules in SQL (placement's filter over a page of candidates, the 409 census' device reasons).

Requests and constraints are :mod:`leases.device_requests`' objects (``DeviceRequest``,
``Constraint``), read by attribute: that module sits above this one in the leases layers, so it
is not imported here; the words both read (attributes, colocation columns) are leases.choices'.
"""

from __future__ import annotations

import json
from uuid import UUID

from django.db import connection
from django.db.models import TextField, Value
from django.db.models.functions import Coalesce
from django.db.models.sql.constants import LOUTER
from django_cte import CTE, with_cte
from django_cte.raw import raw_cte_sql

from fleet.choices import Lifecycle
from fleet.models import Device, Node, NodeResource
from nodepool.db import insert_select, mark_inserted, prepared_cursor

from ..choices import ATTRIBUTES
from ..models import LeaseDevice
from .vendor import glob_match, is_postgresql, least_id, one_of, table_name

# The Device columns a device dict carries (leases.devices.node_devices, :func:`claim_view`):
# what leases.device_requests.choose reads.
DEVICE_FIELDS = (
    "id",
    "node_id",
    "device_id",
    "type",
    "index",
    "model",
    "memory_bytes",
    "mig_profile",
    "parent_device_id",
    "numa_node",
    "interconnect_group",
    "driver_version",
    "cuda_version",
    "pci_bus_id",
    "verified_at",
    "held",
    "health",
    "hard_tainted",
    "taints",
)


# --- the claim (leases.devices.claim) -------------------------------------------------------------
# The grant's statements on devices, as SQL text prepared on PostgreSQL (nodepool.db): building and
# compiling their querysets cost more than running them, on the path every device grant takes.
_CLAIM_VIEW = (
    'SELECT id, device_id, type, "index", model, memory_bytes, mig_profile, parent_device_id, numa_node, '
    "interconnect_group, driver_version, cuda_version, pci_bus_id, verified_at, held, health, hard_tainted, "
    "taints, claimed FROM fleet_device WHERE node_id = %s AND retired_at IS NULL"
)
_CLAIM_COLUMNS = (*[c for c in DEVICE_FIELDS if c != "node_id"], "claimed")


def claims_in_one_statement(requests: tuple, tolerates) -> bool:
    """Whether :func:`claim_plain` can decide the claim: PostgreSQL (a data-modifying CTE), one
    request without co-location or tolerations whose globs SQL matches as fnmatch does."""
    if not is_postgresql() or len(requests) != 1 or tolerates is not None:
        return False
    request = requests[0]
    return not request.colocate and all(c.operator != "glob" or "[" not in c.value for c in request.constraints)


def claim_plain(lease, node_id, request, *, insert_lease: bool = False) -> tuple[list[dict], int]:
    """The common claim as one statement (PostgreSQL): pick ``request.count`` free devices as
    :func:`~leases.device_requests.choose` does (usable, unclaimed, matching; lowest index first),
    hold them (LeaseDevice rows) and mark them ``claimed``. Returns ``(the lease's device list,
    available)``: ``available`` counts the devices the statement could have picked, locked ones
    included. The list is ``[]`` when the statement did nothing and :func:`leases.devices.claim`
    decides: the node has MIG instances (relatives to hold or mark with the pick: ``available`` is
    then 0), too few free devices, none of the type (an implicit request is then a plain count), or
    enough free but some locked by another transaction (``available >= count``). Raises
    IntegrityError when a racing grant held one of the devices first (the partial unique index
    stays the guard).

    ``SKIP LOCKED``: a device another grant is claiming right now (its row locked by that grant's
    ``marked``) is passed over for the next free one. Without it, concurrent grants to one node
    (binpack sends them all to the fullest) picked the same first free device, and the later one
    waited for the first to commit only to fail on the unique index and start over.

    ``insert_lease``: the statement also INSERTs ``lease`` (a new instance, its ``devices`` taken
    from the pick) when it picks, and marks it saved (``lease._state.adding`` becomes False): one
    round trip less on the path every device grant takes. The IntegrityError of a second live
    lease of the workload then comes from here too (its constraint names which).
    """
    matched, params = _constraints_sql(request)
    node_pk = Node._meta.pk.get_db_prep_value(node_id, connection)
    lease_pk = LeaseDevice._meta.get_field("lease").get_db_prep_save(lease.pk, connection)
    order = 'd."index", d.device_id COLLATE "C"'  # choose's (index, device_id), in code point order
    free = f"""
            FROM fleet_device d
            WHERE d.node_id = %s AND d.retired_at IS NULL AND d.type = %s AND {_USABLE} AND NOT d.claimed{matched}
              AND NOT EXISTS (SELECT 1 FROM fleet_device m
                              WHERE m.node_id = %s AND m.retired_at IS NULL AND m.parent_device_id <> '')
    """  # noqa: S608 (columns from the model; values bound)
    leased, lease_params = "", []
    if insert_lease:
        # The lease's device list, as the return value below says it, in the pick's order.
        listed = (
            "(SELECT jsonb_agg(jsonb_build_object('id', e.device_id, 'type', e.type, 'index', e.\"index\")"
            " ORDER BY e.position) FROM enough e)"
        )
        head, values, lease_params = insert_select(lease, {"devices": listed})
        leased = f", leased AS ({head} SELECT {values} WHERE EXISTS (SELECT 1 FROM enough))"  # noqa: S608 (names from the model; values bound)
    statement = f"""
        WITH locked AS (
            SELECT d.id, d.device_id, d."index", d.type {free} ORDER BY {order} LIMIT %s
            FOR NO KEY UPDATE OF d SKIP LOCKED
        ), picked AS (SELECT *, row_number() OVER (ORDER BY {order.replace("d.", "")}) - 1 AS position FROM locked),
        enough AS (SELECT * FROM picked WHERE (SELECT count(*) FROM picked) = %s),
        held AS (
            INSERT INTO leases_leasedevice (lease_id, device_id, implied, position, live)
            SELECT %s, id, false, position, true FROM enough
        ),
        marked AS (UPDATE fleet_device SET claimed = true WHERE id IN (SELECT id FROM enough)){leased}
        SELECT device_id, "index" FROM enough ORDER BY position
    """  # noqa: S608 (columns from the model; values bound)
    free_params = [node_pk, request.type, *params, node_pk]
    with prepared_cursor() as cursor:
        cursor.execute(statement, [*free_params, request.count, request.count, lease_pk, *lease_params])
        rows = cursor.fetchall()
        if rows:
            if insert_lease:
                mark_inserted(lease)
            return [{"id": device_id, "type": request.type, "index": index} for device_id, index in rows], len(rows)
        # Nothing picked (the rarer path): how many the pick could see, locked ones included.
        cursor.execute(f"SELECT count(*) {free}", free_params)
        return [], cursor.fetchone()[0]


def claim_view(node_id) -> list[dict]:
    """The node's live devices as :func:`leases.device_requests.choose` reads them, each with
    ``claimed`` (held by a live lease, or a whole GPU whose MIG instance is). One statement."""
    pk = Node._meta.pk.get_db_prep_value(node_id, connection)
    with prepared_cursor() as cursor:
        cursor.execute(_CLAIM_VIEW, [pk])
        rows = cursor.fetchall()
    out = []
    for values in rows:
        device = dict(zip(_CLAIM_COLUMNS, values, strict=True))
        if isinstance(device["taints"], str):  # SQLite's JSON text
            device["taints"] = json.loads(device["taints"])
        device["node_id"] = node_id
        out.append(device)
    return out


def insert_claims(rows: list[LeaseDevice]) -> None:
    """INSERT the grant's LeaseDevice rows in one prepared statement (``bulk_create`` without the
    ORM's compile). Raises IntegrityError when the partial unique index refuses one."""
    values = ", ".join(["(%s, %s, %s, %s, %s)"] * len(rows))
    lease_pk = LeaseDevice._meta.get_field("lease").get_db_prep_save(rows[0].lease_id, connection)
    params = [v for r in rows for v in (lease_pk, r.device_id, r.implied, r.position, True)]
    with prepared_cursor() as cursor:
        cursor.execute(
            f"INSERT INTO leases_leasedevice (lease_id, device_id, implied, position, live) VALUES {values}",  # noqa: S608 (placeholders only)
            params,
        )


def mark_claimed(pks: list[int]) -> None:
    with prepared_cursor() as cursor:
        cursor.execute(
            f"UPDATE fleet_device SET claimed = %s WHERE id IN ({', '.join(['%s'] * len(pks))})",  # noqa: S608 (placeholders only)
            [True, *pks],
        )


# --- device rules in SQL ---------------------------------------------------------------------------
# What leases.device_requests.choose decides for one request, written as SQL over a node's live
# device rows, so that placement filters candidates in the candidate query and the 409 counts its
# device reasons in the census' GROUP BY, instead of loading the devices of thousands of nodes into
# Python. Exact for a spec of one device request without tolerations whose globs use only ``*`` and
# ``?`` (:func:`decided_in_sql`); every other spec keeps the per-device path
# (leases.devices.node_devices, choose).
# tests/leases/test_device_sql.py checks the two agree on random fleets, on both databases.

_USABLE = "d.verified_at IS NOT NULL AND NOT d.held AND NOT d.hard_tainted AND d.health NOT IN ('unhealthy', 'missing')"
# Held by a live lease, or the whole GPU of a MIG instance a live lease holds: the device row's
# mirror of the holds (claim and release keep it), a column read rather than a probe of the live
# holds per device (which cost seconds at 10,000 nodes).
_TAKEN = "d.claimed"
_SQL_OPERATORS = {"=": "=", "!=": "<>", ">": ">", ">=": ">=", "<": "<", "<=": "<="}


def decided_in_sql(spec) -> bool:
    """Whether :func:`device_rule_sql` decides ``spec``'s devices exactly: one device request, no
    tolerations (a tolerated device taint is decided per taint, in Python), and glob patterns
    without ``[`` (character classes differ between fnmatch, SQLite's GLOB and SQL's LIKE)."""
    if len(spec.devices) != 1 or spec.tolerations:
        return False
    return all(c.operator != "glob" or "[" not in c.value for c in spec.devices[0].constraints)


def _quoted(column: str) -> str:
    return f"d.{connection.ops.quote_name(column)}"


def _constraints_sql(request) -> tuple[str, list]:
    """``request``'s constraints as ``" AND <constraint>"`` each (``""`` for none), and their parameters."""
    sql, params = "", []
    for constraint in request.constraints:
        condition, values = _constraint_sql(constraint)
        sql += f" AND {condition}"
        params += values
    return sql, params


def _constraint_sql(constraint) -> tuple[str, list]:
    column = _quoted(ATTRIBUTES[constraint.attribute])
    if constraint.comparison is not None:  # nodepool.comparison: False for a missing value
        value = constraint.comparison.value
        number = int(value) if value == value.to_integral_value() else float(value)
        return f"({column} IS NOT NULL AND {column} {_SQL_OPERATORS[constraint.operator]} %s)", [number]
    if constraint.operator == "glob":  # fnmatchcase with * and ? only (decided_in_sql)
        return glob_match(column, constraint.value)
    return f"{column} {_SQL_OPERATORS[constraint.operator]} %s", [str(constraint.value)]


def device_rule_sql(request, node_column: str) -> tuple[str, list]:
    """A scalar SQL expression for the node whose id is ``node_column``: ``''`` when ``request``
    (a :class:`~leases.device_requests.DeviceRequest`) can be met on the node, else the reason
    code :func:`~leases.device_requests.choose` gives — ``device_type_missing``,
    ``device_unmatched``, ``device_unhealthy``, ``device_not_free``, ``device_not_colocated``,
    checked in that order. An implicit request (a count resource) passes on a node without device
    rows of its type, as the count alone decides there. One correlated aggregate over the node's
    live devices of the type (index ``device_live_by_node``), plus a grouped one for colocation.
    """
    conditions, params = _constraints_sql(request)
    matched = f"1 = 1{conditions}"
    scope = f"d.node_id = {node_column} AND d.retired_at IS NULL AND d.type = %s"
    when = [
        f"WHEN count(*) = 0 THEN '{'' if request.implicit else 'device_type_missing'}'",
        f"WHEN sum(CASE WHEN {matched} THEN 1 ELSE 0 END) = 0 THEN 'device_unmatched'",
        f"WHEN sum(CASE WHEN {matched} AND {_USABLE} THEN 1 ELSE 0 END) = 0 THEN 'device_unhealthy'",
        f"WHEN sum(CASE WHEN {matched} AND {_USABLE} AND NOT {_TAKEN} THEN 1 ELSE 0 END) < %s THEN 'device_not_free'",
    ]
    when_params = [*params, *params, *params, request.count]
    if request.colocate:
        # A device whose host does not tell its group (NULL, or '' for the text column) is never
        # co-located (choose's rule).
        column = _quoted(request.colocate)
        told = f"{column} IS NOT NULL" + (f" AND {column} <> ''" if request.colocate == "interconnect_group" else "")
        free = f"{scope} AND {matched} AND {_USABLE} AND NOT {_TAKEN} AND {told}"
        group = f"SELECT 1 FROM fleet_device d WHERE {free} GROUP BY {column} HAVING count(*) >= %s"  # noqa: S608
        # The outer aggregate's rows are the node's devices, so the grouped check names the node
        # through the outer query again, not through ``d``.
        when.append(f"WHEN NOT EXISTS ({group}) THEN 'device_not_colocated'")
        when_params += [request.type, *params, request.count]
    sql = f"(SELECT CASE {' '.join(when)} ELSE '' END FROM fleet_device d WHERE {scope})"  # noqa: S608 (columns from the model; values bound)
    return sql, [*when_params, request.type]


def nodes_passing(spec, node_ids: list) -> set:
    """Which of ``node_ids`` can meet ``spec``'s one device request (:func:`decided_in_sql` must
    hold): placement's device filter over a page of candidates. One statement, its text the same
    for every page of a request shape (the ids travel as one parameter), prepared on PostgreSQL
    (nodepool.db): the ORM's compile of ``pk IN (64 ids)`` cost more than running it."""
    if not node_ids:
        return set()
    table = connection.ops.quote_name(Node._meta.db_table)
    rule, params = device_rule_sql(spec.devices[0], f"{table}.{connection.ops.quote_name('id')}")
    # The ids as the column stores them (SQLite: 32 hex digits), as one parameter.
    among, ids = one_of(f"{table}.id", [Node._meta.pk.get_db_prep_value(pk, connection) for pk in node_ids])
    sql = f"SELECT {table}.id FROM {table} WHERE {among} AND {rule} = ''"  # noqa: S608 (columns from the model; values bound)
    with prepared_cursor() as cursor:
        cursor.execute(sql, [*ids, *params])
        found = [row[0] for row in cursor.fetchall()]
    return {pk if isinstance(pk, UUID) else UUID(pk) for pk in found}


DEVICE_REASONS = "device_reasons"  # the name of device_reasons_sql's table in the census' WITH clause


def device_reasons_sql(request, pool_pk) -> tuple[str, list]:
    """:func:`device_rule_sql`'s rules for every node of the pool ``pool_pk`` at once (retired ones
    aside): ``SELECT node_id, reason`` with one row per node that has live devices of
    ``request.type`` (reason ``''`` when the request can be met there).

    Decided once per device fingerprint (Node.device_fingerprint, fleet.device_counts): nodes
    with the same fingerprint and nothing allocated have the same devices as the rules read them,
    none taken, so one of them (the fingerprint's representative) answers for all. Read on their
    own devices: the representatives, the nodes with anything allocated (``held``: a device hold
    always comes with an allocation, as a grant reserves the count resource of each device type it
    claims, leases.spec.with_device_counts, and the release frees both in one transaction; a node
    running CPU-only work is read on its own too, which costs time, never a wrong answer) and the
    nodes without a fingerprint (no devices, or written past sync_counts). A pool of alike, idle
    nodes thus reads a few hundred device rows instead of all of them; the one grouped pass over
    every device row it replaced was most of a 10,000-node 409 (docs/leases.md). ``held`` reads the
    resource rows, not the live holds: those would be joined to all device rows for their node.

    For the 409's census, as its ``WITH`` table :data:`DEVICE_REASONS` (joined by
    :func:`join_device_reasons`). tests/leases/test_device_sql.py checks it against choose.
    """
    conditions, params = _constraints_sql(request)
    matched = f"1 = 1{conditions}"
    node, device = table_name(Node), table_name(Device)
    # Each device's level, one CASE a row: 0 unmatched, 1 matched but not usable, 2 usable but
    # taken, 3 free; then per node the highest level and the free count decide the reason.
    level = f"CASE WHEN NOT ({matched}) THEN 0 WHEN NOT ({_USABLE}) THEN 1 WHEN {_TAKEN} THEN 2 ELSE 3 END AS lvl"
    rows = f"FROM scope s INNER JOIN {device} d ON d.node_id = s.id WHERE d.retired_at IS NULL AND d.type = %s"
    top, free = "max(lvl)", "sum(CASE WHEN lvl = 3 THEN 1 ELSE 0 END)"
    if request.colocate:
        # Per (node, group) first, then per node; a device whose host does not tell its group
        # (NULL, or '' for the text column) is never co-located (choose's rule), so only told
        # groups count there.
        told = "grp IS NOT NULL" + (" AND grp <> ''" if request.colocate == "interconnect_group" else "")
        devices = f"SELECT d.node_id, {_quoted(request.colocate)} AS grp, {level} {rows}"
        source = f"(SELECT node_id, grp, {top} AS top, {free} AS f FROM ({devices}) l GROUP BY node_id, grp)"  # noqa: S608
        top, free = "max(top)", "sum(f)"
        colocated = f"WHEN max(CASE WHEN {told} THEN f ELSE 0 END) < %s THEN 'device_not_colocated' "
    else:  # one level: the node's aggregates straight over its devices
        source, colocated = f"(SELECT d.node_id, {level} {rows})", ""
    reason = (
        f"CASE WHEN {top} = 0 THEN 'device_unmatched' WHEN {top} = 1 THEN 'device_unhealthy' "
        f"WHEN {free} < %s THEN 'device_not_free' {colocated}ELSE '' END"
    )
    reason_params = [request.count, request.count] if colocated else [request.count]
    in_pool = "n.pool_id = %s AND n.lifecycle <> %s"
    pool = [pool_pk, Lifecycle.RETIRED]
    sql = f"""
        WITH held AS (SELECT r.node_id FROM {table_name(NodeResource)} r WHERE r.allocated > 0), reps AS (
            SELECT n.device_fingerprint AS fp, {least_id("n.id")} AS rep FROM {node} n
            WHERE {in_pool} AND n.device_fingerprint <> '' AND n.id NOT IN (SELECT node_id FROM held)
            GROUP BY n.device_fingerprint
        ), scope AS (
            SELECT rep AS id FROM reps
            UNION ALL SELECT n.id FROM {node} n WHERE {in_pool} AND n.device_fingerprint = ''
            UNION ALL SELECT n.id FROM {node} n
            WHERE {in_pool} AND n.device_fingerprint <> '' AND n.id IN (SELECT node_id FROM held)
        ), decided AS (
            SELECT node_id, {reason} AS reason FROM {source} g GROUP BY node_id
        )
        SELECT n.id AS node_id, r.reason FROM {node} n
        INNER JOIN reps ON reps.fp = n.device_fingerprint INNER JOIN decided r ON r.node_id = reps.rep
        WHERE {in_pool} AND n.id NOT IN (SELECT node_id FROM held)
        UNION ALL SELECT r.node_id, r.reason FROM decided r WHERE r.node_id NOT IN (SELECT rep FROM reps)
    """  # noqa: S608 (names from the models; values bound)
    return sql, [*pool, *pool, *pool, *reason_params, *params, request.type, *pool]


def join_device_reasons(nodes, request, pool_pk):
    """``(nodes, reason)``: the ``fleet_node`` queryset ``nodes`` (of the pool ``pool_pk``) LEFT
    JOINed to :func:`device_reasons_sql`'s table for ``request`` (a ``WITH`` table named
    :data:`DEVICE_REASONS`, through django-cte), and the reason code of each node from it:
    ``device_type_missing`` (``''`` for an implicit request) when the node has no devices of the type.

    One hash join of the nodes to the table: the five hashed ``IN`` sets that read it before (one
    per reason code) cost 5-15 % more of a 10,000-node 409 (alternating runs, psql, this machine).
    """
    sql, params = device_reasons_sql(request, pool_pk)
    refs = {"node_id": Node._meta.pk, "reason": TextField()}
    table = CTE(raw_cte_sql(sql, params, refs), name=DEVICE_REASONS)
    joined = with_cte(table, select=table.join(nodes, id=table.col.node_id, _join_type=LOUTER))
    missing = "" if request.implicit else "device_type_missing"
    return joined, Coalesce(table.col.reason, Value(missing), output_field=TextField())
