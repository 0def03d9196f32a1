"""Leases' raw SQL, in one place: the named statements of the grant and of placement, each saying
why it is SQL.

Everywhere else leases uses the ORM. A statement is here when the ORM cannot say it (an upsert
``… ON CONFLICT … RETURNING``, a ``WITH … AS MATERIALIZED`` table ahead of a queryset, a planner
setting for one statement, a row lock ``FOR SHARE`` without loading a model), or when building
the queryset costs more than running the statement on a path every grant takes (the grant's three
statements, the candidate page: compiling them through the ORM cost more than running them).
The device statements of leases.devices stay there for now.

Rules kept by every statement: identifiers come from the models' ``_meta`` (never from input),
every value is a bound parameter. The PostgreSQL/SQLite differences are the first section; the
statements below ask for them instead of testing the vendor themselves.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django.db import connection, transaction
from django.db.models import BooleanField, TextField
from django.db.models.expressions import RawSQL

from fleet.models import Device, Node, NodeResource
from nodepool.db import prepared_cursor

from ..models import FencingSequence, LeaseDevice

# --- PostgreSQL and SQLite: the differences -------------------------------------------------------


def is_postgresql() -> bool:
    return connection.vendor == "postgresql"


def share_lock() -> str:
    """The suffix that holds a row read until COMMIT: ``FOR SHARE`` on PostgreSQL. SQLite runs one
    write transaction at a time, so its plain read is held already: no suffix."""
    return " FOR SHARE" if is_postgresql() else ""


def write_lock() -> str:
    """The suffix that locks the rows a read returns for an UPDATE of non-key columns until COMMIT:
    ``FOR NO KEY UPDATE`` on PostgreSQL (in the read's ORDER BY order). SQLite: none, as for
    :func:`share_lock`."""
    return " FOR NO KEY UPDATE" if is_postgresql() else ""


def skip_locked() -> str:
    """The suffix of a row lock that passes over rows another transaction holds: PostgreSQL's
    ``SKIP LOCKED``. SQLite has no row locks (and no suffix)."""
    return " SKIP LOCKED" if is_postgresql() else ""


def in_code_point_order(column: str) -> str:
    """``column`` for an ORDER BY in code-point order, as Python's ``sorted`` orders text:
    PostgreSQL's ``"C"`` collation; SQLite's default (BINARY) already is."""
    return f'{column} COLLATE "C"' if is_postgresql() else column


def materialized() -> str:
    """``MATERIALIZED`` for a ``WITH`` table computed once ahead of the query (PostgreSQL 12+ may
    inline a table read once); SQLite makes its own choice and says nothing."""
    return "MATERIALIZED " if is_postgresql() else ""


def sorted_concat(expression: str, separator: str, source: str) -> str:
    """The ``separator``-joined text of ``expression`` over the rows of ``source`` (a ``FROM …
    WHERE …`` clause), in sorted order. PostgreSQL's ``string_agg`` sorts in the aggregate; SQLite's
    ``group_concat`` (before 3.44) concatenates in its subquery's order, so that subquery sorts."""
    if is_postgresql():
        return f"(SELECT string_agg(x, '{separator}' ORDER BY x) FROM (SELECT {expression} AS x {source}) s)"  # noqa: S608
    return f"(SELECT group_concat(x, '{separator}') FROM (SELECT {expression} AS x {source} ORDER BY x) s)"  # noqa: S608


def one_of(column: str, values: list[str]) -> tuple[str, list]:
    """``column`` is one of ``values``, sent as one parameter however many values there are: an
    array on PostgreSQL (``= ANY(%s)``), a JSON array on SQLite (``IN (SELECT value FROM
    json_each(%s))``). 10,000 placeholders cost more to build, send and parse than the query."""
    if is_postgresql():
        return f"{column} = ANY(%s)", [values]
    return f"{column} IN (SELECT value FROM json_each(%s))", [json.dumps(values)]  # noqa: S608 (values bound)


@contextmanager
def planner_settings(**settings) -> Iterator[None]:
    """The statements run inside with these PostgreSQL planner settings, in their own
    (sub)transaction, then the settings back to the configured ones (``SET LOCAL … TO DEFAULT``):
    the rest of an enclosing transaction plans as configured. SQLite has no such settings: the
    statements run as they are."""
    if not is_postgresql():
        yield
        return
    with transaction.atomic(), connection.cursor() as cursor:
        for name, value in settings.items():
            cursor.execute(f"SET LOCAL {name} = {value}")
        yield
        for name in settings:
            cursor.execute(f"SET LOCAL {name} TO DEFAULT")


def reads_json_values_exactly() -> bool:
    """Whether a JSON key read out by the database (Django's ``KeyTransform``) keeps its JSON type:
    PostgreSQL's ``->`` does; SQLite's JSON extraction turns ``"true"`` into a boolean, so there
    the whole document is read and decoded in Python (leases.placement_score.group_counts)."""
    return is_postgresql()


def _quote(name: str) -> str:
    return connection.ops.quote_name(name)


def _table(model) -> str:
    return _quote(model._meta.db_table)


def _column(model, field: str) -> str:
    return _quote(model._meta.get_field(field).column)


# --- the grant (leases.grant._reserve) ------------------------------------------------------------
# Plain SQL, prepared on PostgreSQL (nodepool.db.prepared_cursor): the grant runs these three in
# every transaction that reserves a node, and the ORM spent more time building each than the
# database spent running it.


def next_fencing_token(workload_id: str) -> int:
    """Bump and return the workload's fencing token in one statement (an upsert that locks the
    row until commit, so grants of one workload are serialised and tokens strictly increase).
    SQL: the ORM has no ``INSERT … ON CONFLICT DO UPDATE … RETURNING``."""
    table = _table(FencingSequence)
    with prepared_cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (workload_id, last_token) VALUES (%s, 1) "  # noqa: S608 (the table name comes from the model, not input)
            f"ON CONFLICT (workload_id) DO UPDATE SET last_token = {table}.last_token + 1 RETURNING last_token",
            [workload_id],
        )
        return cursor.fetchone()[0]


def node_gate(node_id) -> tuple | None:
    """The node's ``(lifecycle, liveness, ready, health, cordoned, status_report_overdue,
    instructions, incarnation)``, read under :func:`share_lock` until COMMIT
    (``leases.grant._hold_schedulable_node`` says what the hold is for); None when there is no
    such node. SQL: a tuple read, not a model (``select_for_update`` has no ``FOR SHARE``)."""
    with prepared_cursor() as cursor:
        cursor.execute(
            f"SELECT lifecycle, liveness, ready, health, cordoned, status_report_overdue, instructions, "  # noqa: S608
            f"incarnation FROM {_table(Node)} WHERE id = %s{share_lock()}",
            [Node._meta.pk.get_db_prep_value(node_id, connection)],
        )
        return cursor.fetchone()


def take_capacity(node_id, resources: dict[str, int], *, wait: bool = True) -> int:
    """``allocated += amount`` on the node's row of each resource in ``resources`` (name → amount,
    canonical units) where it stays within ``allocatable``; returns the number of rows changed.

    One statement for every resource: the row count proves all of them fitted (the caller rolls
    back otherwise). ``WHERE allocated + x <= allocatable`` is the whole race guard: PostgreSQL
    re-evaluates the WHERE on the newest row version after waiting for a competing writer, SQLite
    runs one writer at a time, so a slot is never given twice. SQL: the ORM's ``CASE`` expression
    for per-row amounts cost more to build than the statement costs to run.

    The rows are locked first, in name order (the sub-select's ``ORDER BY name … FOR NO KEY
    UPDATE``, code-point order as Python's ``sorted``; a hashed subplan, run whole before the first
    row is updated), the order a lease's end gives them back in
    (leases.lifecycle.return_capacity). A bare multi-row UPDATE locks them in its plan's scan
    order, which for this table (a non-HOT update moves a row: ``allocated`` is in the free-capacity
    index) is not stable: two grants on one node, or a grant and an end, then locked cpu and memory
    in opposite orders and PostgreSQL broke the deadlock by failing one (2 in 480 grants of six
    threads on one fleet, bench/devices.py's fleet).

    ``wait=False``: a row another transaction holds locked (another grant on this node, between
    its UPDATE and its COMMIT) is skipped (``SKIP LOCKED``), so fewer rows change and the caller
    tries its next candidate instead of queueing behind that grant's COMMIT. SQLite: one writer at
    a time, nothing is ever locked by another.
    """
    table = _table(NodeResource)
    amount = "CASE name " + " ".join("WHEN %s THEN %s" for _ in resources) + " END"
    pairs = [value for item in resources.items() for value in item]
    names = ", ".join(["%s"] * len(resources))
    with prepared_cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET allocated = allocated + {amount} "  # noqa: S608 (names from the model; values bound)
            f"WHERE id IN (SELECT id FROM {table} WHERE node_id = %s AND name IN ({names}) "
            f"ORDER BY {in_code_point_order('name')}{write_lock()}{'' if wait else skip_locked()}) "
            f"AND allocated + {amount} <= allocatable",
            [*pairs, Node._meta.pk.get_db_prep_value(node_id, connection), *resources, *pairs],
        )
        return cursor.rowcount


# --- the candidate page (leases.placement_filter._page_reader) ------------------------------------


def paged(sql: str) -> str:
    """``sql`` with a page's ``LIMIT %s OFFSET %s`` (the two last parameters)."""
    return sql + " LIMIT %s OFFSET %s"


def candidate_page_reader(sql: str, params: list, *, pool_slot: int, pool_id) -> Callable[[int, int], list[tuple]]:
    """``read(offset, limit) -> rows`` running the candidate SQL (``sql`` as :func:`paged` made it,
    ``params`` the request's values, ``params[pool_slot]`` its pool): the SQL is the ORM's
    (``leases.placement_filter.candidate_query``), compiled once per query shape there; here it
    is only run. On PostgreSQL it runs prepared (:func:`_prepared_form`); on SQLite the node ids
    come back as 32 hex digits and are made UUIDs. JSON columns stay text (NodeView decodes them).
    """
    if is_postgresql():
        sql, params = _prepared_form(sql, params, pool_slot, pool_id)
        sqlite = False
    else:
        sqlite = True

    def read(offset: int, limit: int) -> list[tuple]:
        with prepared_cursor() as cursor:
            cursor.execute(sql, [*params, limit, offset])
            rows = cursor.fetchall()
        if sqlite:  # UUIDs stored as 32 hex digits; JSON stays text (NodeView)
            rows = [(uuid.UUID(row[0]), *row[1:]) for row in rows]
        return rows

    return read


def _prepared_form(sql: str, params: list, pool_slot: int, pool_id) -> tuple[str, list]:
    """The candidate SQL for a prepared statement on PostgreSQL: the pool's id written into the
    text, the other values (amounts, time, page) left as parameters.

    Planning the candidate query costs more than running it (about 1 ms against 0.3 ms at 10,000
    nodes). A prepared statement under a generic plan is planned once per connection; the pool is
    written in so that each pool gets its own statement and plan, made with that pool's size in
    view (a plan for a 20-node pool in a 100,000-node fleet is not the plan for the big pool).
    """
    parts = sql.split("%s")
    if len(parts) != len(params) + 3:  # + LIMIT, OFFSET
        raise RuntimeError("the candidate SQL has a literal %s")  # never: Django escapes it as %%
    text = "".join(
        part + ("" if index == len(parts) - 1 else (str(int(pool_id)) if index == pool_slot else "%s"))
        for index, part in enumerate(parts)
    )
    return text, [value for index, value in enumerate(params) if index != pool_slot]


# --- the 409 census (leases.placement_explain.diagnose) -------------------------------------------


def node_id_column() -> str:
    """``"fleet_node"."id"``, quoted for the connection: the node the device rules' SQL names."""
    return f"{_table(Node)}.{_column(Node, 'id')}"


def hostname_in(values: set[str]) -> RawSQL:
    """A condition on the census' node rows: the hostname is one of ``values`` (:func:`one_of`).
    A host-wide spread group names every host of the pool. SQL: the ORM's ``__in`` writes one
    placeholder per value."""
    condition, params = one_of(f"{_table(Node)}.{_column(Node, 'hostname')}", sorted(values))
    return RawSQL(condition, tuple(params), output_field=BooleanField())  # noqa: S611 (names from the model; values bound)


# The columns of a device that leases.device_requests.choose reads (constraints, colocation,
# usability), in the order of device_fingerprint's text; JSON taints only when tolerations matter.
FINGERPRINT_COLUMNS = (
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


def device_fingerprint(types: list[str], *, with_taints: bool) -> RawSQL:
    """A correlated expression over a ``fleet_node`` row: the text of its live devices of
    ``types``, each as :data:`FINGERPRINT_COLUMNS` (and the JSON taints when ``with_taints``) plus
    whether it is verified and taken (held by a live lease, or the parent of a held MIG instance),
    sorted (:func:`sorted_concat`), so that two nodes whose devices a request cannot tell apart
    get the same text. NULL for a node without such devices (``leases.placement_explain
    .device_fingerprint``). SQL: the ORM has no ordered string aggregate on SQLite."""
    device, claim = _table(Device), _table(LeaseDevice)
    columns = [*FINGERPRINT_COLUMNS, "taints"] if with_taints else list(FINGERPRINT_COLUMNS)
    parts = [f"COALESCE(CAST(d.{_column(Device, c)} AS TEXT), '~')" for c in columns]
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


def census_rows(queryset, with_table: tuple[str, str, list] | None = None) -> list:
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

    ``with_table``: ``(name, sql, params)`` of a table the query reads, computed once before it
    (:func:`rows_with_table`).
    """
    with planner_settings(enable_sort="off", parallel_tuple_cost="0.02", jit="off"):
        return rows_with_table(queryset, with_table) if with_table else list(queryset)


def rows_with_table(queryset, with_table: tuple[str, str, list]) -> list[dict]:
    """The rows of a ``values()`` queryset run with a ``WITH name AS MATERIALIZED (sql)`` table
    ahead of its SQL, converted as the ORM would convert them (its compiler's own converters).
    SQL: the ORM cannot say a ``WITH`` table. The census uses it for the devices' reasons of every
    node, in one grouped pass over the device rows (leases.devices.device_reasons_sql), which the
    query's expressions look up by node."""
    name, table_sql, table_params = with_table
    compiler = queryset.query.get_compiler(connection=connection)
    sql, params = compiler.as_sql()
    with connection.cursor() as cursor:
        cursor.execute(f"WITH {name} AS {materialized()}({table_sql}) {sql}", [*table_params, *params])
        names = [column[0] for column in cursor.description]
        rows = cursor.fetchall()
    converters = compiler.get_converters([expression for expression, _, _ in compiler.select])
    if converters:
        rows = compiler.apply_converters(rows, converters)
    return [dict(zip(names, row, strict=True)) for row in rows]
