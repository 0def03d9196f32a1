"""The grant's raw statements (leases.grant._reserve): the fencing upsert, the node's hold, the
capacity UPDATE.

Plain SQL, prepared on PostgreSQL (nodepool.db.prepared_cursor): the grant runs these three in
every transaction that reserves a node, and the ORM spent more time building each than the
database spent running it.
"""

from __future__ import annotations

from django.db import connection

from fleet.models import Node, NodeResource
from nodepool.db import prepared_cursor

from ..models import FencingSequence
from .vendor import in_code_point_order, share_lock, skip_locked, table_name, write_lock


def next_fencing_token(workload_id: str) -> int:
    """Bump and return the workload's fencing token in one statement (an upsert that locks the
    row until commit, so grants of one workload are serialised and tokens strictly increase).
    SQL: the ORM has no ``INSERT … ON CONFLICT DO UPDATE … RETURNING``."""
    table = table_name(FencingSequence)
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
            f"incarnation FROM {table_name(Node)} WHERE id = %s{share_lock()}",
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
    table = table_name(NodeResource)
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
