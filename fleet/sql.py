"""Fleet's raw SQL, in one place: the named statements of its hot paths, each saying why it is SQL.

Everywhere else fleet uses the ORM. A statement is here when the ORM cannot say it (``UPDATE …
RETURNING``, ``UPDATE … FROM`` returning the joined table's columns, a data-modifying CTE, ``FOR
NO KEY UPDATE SKIP LOCKED`` inside an ``UPDATE``), or when building the queryset costs more than
running the statement on a path taken by every node every interval (compiling the heartbeat's
``update()`` cost a third of its CPU time; the credential lookup with its node and pool, more than
the rest of the heartbeat together).

Rules kept by every statement: identifiers come from the models' ``_meta`` (never from input),
every value is a bound parameter, values are prepared by their field (``get_db_prep_save``) and
rows read are converted by the ORM's own compiler (``nodepool.db.from_row``). The
PostgreSQL/SQLite differences are the first section (:func:`plus_seconds`, :func:`later_of`,
:func:`skip_locked`, the SQLite function registered on ``connection_created``); the statements
below ask for them instead of testing the vendor themselves where they can.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import connection
from django.db.backends.signals import connection_created

from nodepool.db import from_row, row_width, select_list

from .choices import Lifecycle, Liveness
from .models import Node, NodeCredential, NodeEvent, Pool

# --- PostgreSQL and SQLite: the differences -------------------------------------------------------

SQLITE_PLUS_MICROSECONDS = "fleet_plus_microseconds"


def plus_microseconds(stored: str | None, microseconds: int | None) -> str | None:
    """SQLite's ``fleet_plus_microseconds(text, n)``: a stored datetime plus ``n`` microseconds,
    written back in the form Django stores datetimes on SQLite (``str(datetime)``, naive UTC), so
    comparisons with stored values stay exact. NULL in, NULL out. (Django's private
    ``django_format_dtdelta`` did this before; tests check the two agree.)"""
    if stored is None or microseconds is None:
        return None
    return str(datetime.fromisoformat(stored) + timedelta(microseconds=microseconds))


def register_sqlite_functions(sender, connection, **kwargs) -> None:
    """``connection_created`` receiver (fleet.apps): the SQL functions fleet's statements call on SQLite."""
    if connection.vendor == "sqlite":
        connection.connection.create_function(SQLITE_PLUS_MICROSECONDS, 2, plus_microseconds, deterministic=True)


def connect_signals() -> None:
    connection_created.connect(register_sqlite_functions, dispatch_uid="fleet.sql.sqlite_functions")


def is_postgresql() -> bool:
    return connection.vendor == "postgresql"


def db_time(value: datetime | None):
    return None if value is None else connection.ops.adapt_datetimefield_value(value)


def plus_seconds(expression: str, seconds: float) -> tuple[str, list]:
    """SQL and parameters for the datetime ``expression`` plus ``seconds``."""
    if is_postgresql():
        return f"{expression} + %s * INTERVAL '1 second'", [seconds]
    return f"{SQLITE_PLUS_MICROSECONDS}({expression}, %s)", [round(seconds * 1_000_000)]


def later_of(column: str, value: datetime | None) -> tuple[str, list]:
    """SQL and parameters for the later of a datetime ``column`` and ``value`` (``column`` when
    ``value`` is None), NULL only when both are: PostgreSQL's ``GREATEST`` ignores a NULL
    argument, SQLite's two-argument ``MAX`` returns NULL if either is, so SQLite's NULL column
    is replaced by ``value`` first."""
    if value is None:
        return column, []
    if is_postgresql():
        return f"GREATEST({column}, %s)", [db_time(value)]
    return f"MAX(COALESCE({column}, %s), %s)", [db_time(value), db_time(value)]


def skip_locked(table: str, condition: str) -> str:
    """``condition`` narrowed to rows no other transaction holds, on PostgreSQL: a row another
    transaction holds is skipped, not waited for (it stays due; the next run moves it). SQLite has
    one writer at a time: ``condition`` as it is."""
    if not is_postgresql():
        return condition
    return f"id IN (SELECT id FROM {table} WHERE {condition} FOR NO KEY UPDATE SKIP LOCKED)"  # noqa: S608


def _quote(name: str) -> str:
    return connection.ops.quote_name(name)


def _table(model) -> str:
    return _quote(model._meta.db_table)


# --- event rows written inside a statement --------------------------------------------------------


def event_insert(source: str, from_source: dict[str, str], template: NodeEvent) -> tuple[str, list]:
    """``INSERT INTO <events> (…) SELECT … FROM <source>``: the columns named in ``from_source``
    (field attname -> SQL expression over ``source``) come from the statement; every other
    concrete field of NodeEvent takes ``template``'s value, prepared by its field as ``save``
    prepares it (Django sets no database defaults, so a column left out would be NULL). The
    column list is the model's: a field added to NodeEvent is written here too."""
    columns, select, params = [], [], []
    for field in NodeEvent._meta.concrete_fields:
        if field.primary_key:
            continue
        columns.append(_quote(field.column))
        if field.attname in from_source:
            select.append(from_source[field.attname])
        else:
            select.append("%s")
            params.append(field.get_db_prep_save(field.pre_save(template, False), connection))
    sql = f"INSERT INTO {_table(NodeEvent)} ({', '.join(columns)}) SELECT {', '.join(select)} FROM {source}"  # noqa: S608
    return sql, params


def node_events(ids: list, template: NodeEvent) -> tuple[str, list]:
    """One event per node in ``ids`` (not empty; node and pool from the node's row, every other
    column from ``template``, ``created_at`` included): what :func:`with_events` inserts, for
    SQLite, which has no data-modifying CTE. The events carry the sweep's time, as PostgreSQL's
    do, not the wall clock a model's ``auto_now_add`` would write."""
    insert, params = event_insert(
        f"{_table(Node)} WHERE id IN ({', '.join(['%s'] * len(ids))})",
        {"node_id": "id", "pool_id": "pool_id"},
        template,
    )
    return insert, [*params, *(Node._meta.pk.get_db_prep_value(i, connection) for i in ids)]


# --- the renewal (fleet.renewals) -----------------------------------------------------------------

_RENEWAL: dict[tuple[str, bool], str] = {}


def renewal(revive: bool) -> str:
    """The renewal: one conditional UPDATE that authenticates, orders, paces and applies
    (fleet.renewals says what each condition is for), returning the pending-instructions marker
    and the credential's lifetime. Named parameters (see ``fleet.renewals._try_statement``);
    ``revive`` also moves liveness back to alive (compare-and-swap on the liveness read) and
    stamps ``liveness_changed_at``.

    PostgreSQL joins the credential with ``UPDATE … FROM`` and returns its lifetime from the join
    (planned in a tenth of the time the subquery form takes; run prepared, planned once per
    connection: ``nodepool.db.prepared_cursor``). SQLite may not return columns of a ``FROM``
    table, so it checks the credential with ``EXISTS`` and reads its lifetime with scalar
    subqueries.
    """
    key = (connection.vendor, revive)
    if key not in _RENEWAL:
        node, cred = _table(Node), _table(NodeCredential)
        revival = ", liveness = %(alive)s, liveness_changed_at = %(now)s" if revive else ""
        # The stale deadline moves only when less than stale_after is left (fleet.renewals.deadline_slack):
        # most renewals then change no indexed column, and PostgreSQL updates the row in place (HOT).
        deadline = (
            "CASE WHEN n.next_liveness_check_at IS NULL OR n.next_liveness_check_at < %(keep_after)s "
            "THEN %(deadline)s ELSE n.next_liveness_check_at END"
        )
        if revive:
            deadline = "%(deadline)s"
        assignments = (
            f"sequence = %(sequence)s, last_heartbeat_at = %(now)s, next_liveness_check_at = {deadline}, "
            f"interval_given = %(interval)s, renewal_not_before = %(not_before)s{revival}"
        )
        row = (
            "n.id = %(id)s AND n.pool_id = %(pool)s AND n.incarnation = %(incarnation)s AND n.sequence < %(sequence)s "
            f"AND n.liveness = %(liveness)s AND n.lifecycle <> '{Lifecycle.RETIRED.value}' "
            "AND (n.renewal_not_before IS NULL OR n.renewal_not_before <= %(now)s OR n.interval_given IS NULL "
            "OR n.interval_given <> %(interval)s)"
        )
        credential = (
            "c.prefix = %(prefix)s AND c.node_id = n.id AND c.secret_hash = %(digest)s "
            "AND (c.revoked_at IS NULL OR c.revoked_at > %(now)s) AND c.expires_at > %(valid_at)s"
        )
        if is_postgresql():
            sql = (
                f"UPDATE {node} AS n SET {assignments} FROM {cred} AS c "  # noqa: S608
                f"WHERE {row} AND {credential} RETURNING n.instructions, c.issued_at, c.expires_at"
            )
        else:
            lifetime = f"SELECT {{}} FROM {cred} WHERE prefix = %(prefix)s"  # noqa: S608
            sql = (
                f"UPDATE {node} AS n SET {assignments} "  # noqa: S608
                f"WHERE {row} AND EXISTS (SELECT 1 FROM {cred} AS c WHERE {credential}) "
                f"RETURNING instructions, ({lifetime.format('issued_at')}), ({lifetime.format('expires_at')})"
            )
        _RENEWAL[key] = sql
    return _RENEWAL[key]


# --- the status report (fleet.heartbeats, fleet.api.heartbeat_views) -----------------------------


def status_report_update(*, node: Node, report_incarnation: int, report_sequence: int, values: dict[str, Any]):
    """The status report's compare-and-swap (``fleet.heartbeats._conditional_update`` says what it
    checks): ``(sql, params)``. ``values``: Node attname -> new value, each prepared by its field;
    ``restart_count`` is counted in SQL (no lost update even if two restarts raced). SQL rather
    than a queryset ``update()``: the ORM has no ``UPDATE … RETURNING``, and compiling the queryset
    cost a third of the heartbeat's CPU time."""
    assignments, params = [], []
    for name, value in values.items():
        field = Node._meta.get_field(name)
        column = _quote(field.column)
        if name == "restart_count":
            assignments.append(f"{column} = {column} + 1")
            continue
        assignments.append(f"{column} = %s")
        params.append(field.get_db_prep_save(value, connection))
    params += [
        Node._meta.pk.get_db_prep_value(node.pk, connection),
        node.incarnation,
        node.sequence,
        node.liveness,
        node.status_report_overdue,
        Lifecycle.RETIRED,
        report_incarnation,
        report_incarnation,
        report_sequence,
    ]
    sql = (
        f"UPDATE {_table(Node)} SET {', '.join(assignments)} "  # noqa: S608
        "WHERE id = %s AND incarnation = %s AND sequence = %s AND liveness = %s AND status_report_overdue = %s "
        "AND lifecycle <> %s "
        "AND (incarnation < %s OR (incarnation = %s AND sequence < %s)) RETURNING version"
    )
    return sql, params


# The status report's credential lookup loads only the columns a heartbeat reads (every other
# field is deferred: Django loads it with one query on access, so callees stay correct).
CREDENTIAL_FIELDS = ("id", "node", "prefix", "secret_hash", "issued_at", "expires_at", "revoked_at")
NODE_FIELDS = (
    "id", "pool", "lifecycle", "liveness", "liveness_changed_at", "last_heartbeat_at", "next_liveness_check_at",
    "ready", "ready_reason", "conditions", "health", "health_reasons", "incarnation", "sequence",
    "restart_count", "agent_version", "usage", "version", "instructions", "interval_given",
    "status_report_not_before", "status_report_overdue",
)  # fmt: skip
POOL_FIELDS = (
    "id", "name", "heartbeat_interval", "status_report_interval", "heartbeat_grace", "loss_threshold",
    "unhealthy_conditions", "degraded_conditions", "trust_node_labels", "allowed_agent_versions",
    "allowed_undeclared_resources",
)  # fmt: skip
_CREDENTIAL_LOOKUP: dict = {}


def credential_with_node_and_pool(prefix: str) -> NodeCredential | None:
    """The credential ``prefix`` with its node and pool cached on it, in one fixed statement
    (``NodeCredential.objects.select_related("node__pool").only(…).filter(prefix=…)``, without
    compiling that queryset on every heartbeat, which cost more CPU than the rest of the heartbeat
    together). None when no credential has that prefix."""
    parts = ((NodeCredential, CREDENTIAL_FIELDS), (Node, NODE_FIELDS), (Pool, POOL_FIELDS))
    key = connection.vendor
    if key not in _CREDENTIAL_LOOKUP:
        columns = ", ".join(select_list(model, fields) for model, fields in parts)
        cred, node, pool = _table(NodeCredential), _table(Node), _table(Pool)
        _CREDENTIAL_LOOKUP[key] = (
            f"SELECT {columns} FROM {cred} "  # noqa: S608
            f"JOIN {node} ON {node}.{_quote('id')} = {cred}.{_quote('node_id')} "
            f"JOIN {pool} ON {pool}.{_quote('id')} = {node}.{_quote('pool_id')} "
            f"WHERE {cred}.{_quote('prefix')} = %s"
        )
    with connection.cursor() as cursor:
        cursor.execute(_CREDENTIAL_LOOKUP[key], [prefix])
        row = cursor.fetchone()
    if row is None:
        return None
    instances, offset = [], 0
    for model, fields in parts:
        instances.append(from_row(model, row[offset:], fields))
        offset += row_width(model, fields)
    credential, node, pool = instances
    Node._meta.get_field("pool").set_cached_value(node, pool)
    NodeCredential._meta.get_field("node").set_cached_value(credential, node)
    return credential


# --- the liveness sweep (fleet.liveness_sweep) ---------------------------------------------------


def liveness_move(
    *,
    pool_id: int,
    from_state: str,
    to_state: str,
    now: datetime,
    cutoff: datetime | None,
    next_offset: float | None,
    reference: datetime | None,
    ids: list | None,
    keep_deadline: bool,
) -> tuple[str, list]:
    """One pool's due nodes from ``from_state`` to ``to_state`` (``fleet.liveness_moves.move``
    says what the conditions are for): ``UPDATE … RETURNING id, pool_id`` with the
    compare-and-swap in its WHERE, skipping rows another transaction holds. SQL rather than a
    queryset ``update()``: the ORM has no ``UPDATE … RETURNING`` nor ``SKIP LOCKED`` in one.

    The next deadline is ``max(last_heartbeat_at, reference) + next_offset`` seconds, NULL when
    ``next_offset`` is None; ``keep_deadline`` leaves it as it is. ``ids`` (not empty) narrows
    the move to those nodes."""
    table = _table(Node)
    where = [
        "pool_id = %s",
        "liveness = %s",
        "next_liveness_check_at IS NOT NULL",
        "next_liveness_check_at <= %s",
        "lifecycle <> %s",
    ]
    params: list = [pool_id, from_state, db_time(now), Lifecycle.RETIRED]
    if cutoff is not None:
        where.append("last_heartbeat_at <= %s")
        params.append(db_time(cutoff))
    if ids is not None:
        where.append("id IN (" + ", ".join(["%s"] * len(ids)) + ")")
        params.extend(Node._meta.pk.get_db_prep_value(i, connection) for i in ids)
    deadline, deadline_params = "", []
    if not keep_deadline:
        if next_offset is None:
            deadline = ", next_liveness_check_at = NULL"
        else:
            base, base_params = later_of("last_heartbeat_at", reference)
            next_sql, next_params = plus_seconds(base, next_offset)
            deadline, deadline_params = f", next_liveness_check_at = {next_sql}", [*base_params, *next_params]
    sql = (
        f"UPDATE {table} SET liveness = %s, liveness_changed_at = %s{deadline} "  # noqa: S608
        f"WHERE {skip_locked(table, ' AND '.join(where))} RETURNING id, pool_id"
    )
    return sql, [to_state, db_time(now), *deadline_params, *params]


def with_events(update: tuple[str, list], template: NodeEvent) -> tuple[str, list]:
    """An ``UPDATE … RETURNING id, pool_id`` and one event per moved row (``template`` gives every
    other column) in one statement, a data-modifying CTE (PostgreSQL only): 100,000 transitions
    cost one round trip. Returns the moved nodes' ids."""
    insert, insert_params = event_insert("moved", {"node_id": "id", "pool_id": "pool_id"}, template)
    return f"WITH moved AS ({update[0]}) {insert} RETURNING node_id", [*update[1], *insert_params]


def liveness_degrade(plans: list, *, now: datetime, template: NodeEvent) -> tuple[str, list]:
    """Every due node of every pool in ``plans`` (``fleet.liveness_moves.Degrade``) to
    ``unreachable`` or ``stale`` with its event, in **one statement** (PostgreSQL only;
    ``fleet.liveness_moves.degrade`` says how it stays a compare-and-swap); returns
    ``(pool_id, from_state, to_state, count)`` rows. The plans are a ``VALUES`` list joined to the
    due nodes; ``template`` gives the event's columns other than node, pool, states and reason."""
    nodes = _table(Node)
    row = "(%s::bigint, %s::timestamptz, %s::boolean, %s::double precision, %s::timestamptz, %s::text, %s::text)"
    values_params: list = []
    for plan in plans:
        values_params += [
            plan.pool_id, plan.unreachable_cutoff, plan.to_stale, plan.lost_after, plan.since,
            plan.unreachable_reason, plan.stale_reason,
        ]  # fmt: skip
    alive, stale, unreachable = Liveness.ALIVE, Liveness.STALE, Liveness.UNREACHABLE
    insert, insert_params = event_insert(
        "moved",
        {"node_id": "id", "pool_id": "pool_id", "from_state": "from_state", "to_state": "to_state", "reason": "reason"},
        template,
    )
    sql = (
        "WITH plan (pool_id, cutoff, to_stale, lost_after, since, unreachable_reason, stale_reason) AS "  # noqa: S608
        f"(VALUES {', '.join([row] * len(plans))}), "
        "due AS (SELECT n.id, n.liveness AS from_state, "
        "CASE WHEN plan.cutoff IS NOT NULL AND n.last_heartbeat_at <= plan.cutoff THEN %s ELSE %s END AS to_state "
        f"FROM {nodes} n JOIN plan ON plan.pool_id = n.pool_id "
        "WHERE n.next_liveness_check_at IS NOT NULL AND n.next_liveness_check_at <= %s AND n.lifecycle <> %s "
        "AND ((n.liveness IN (%s, %s) AND plan.cutoff IS NOT NULL AND n.last_heartbeat_at <= plan.cutoff) "
        "OR (n.liveness = %s AND plan.to_stale)) "
        "FOR NO KEY UPDATE OF n SKIP LOCKED), "
        f"moved AS (UPDATE {nodes} n SET liveness = due.to_state, liveness_changed_at = %s, "
        "next_liveness_check_at = CASE WHEN due.to_state = %s "
        "THEN GREATEST(n.last_heartbeat_at, plan.since) + plan.lost_after * INTERVAL '1 second' "
        "ELSE n.next_liveness_check_at END "
        "FROM due, plan WHERE n.id = due.id AND plan.pool_id = n.pool_id "
        "RETURNING n.id, n.pool_id, due.from_state, due.to_state, "
        "CASE WHEN due.to_state = %s THEN plan.unreachable_reason ELSE plan.stale_reason END AS reason), "
        f"written AS ({insert} RETURNING pool_id, from_state, to_state) "
        "SELECT pool_id, from_state, to_state, count(*) FROM written GROUP BY pool_id, from_state, to_state"
    )
    params = [
        *values_params,
        unreachable, stale, db_time(now), Lifecycle.RETIRED, alive, stale, alive,
        db_time(now), unreachable, unreachable,
        *insert_params,
    ]  # fmt: skip
    return sql, params
