"""Database plumbing shared by the apps: a cursor for statements worth preparing.

Django binds parameters on the client (psycopg's ``ClientCursor``): every statement reaches
PostgreSQL as text and is planned again at each execution. For a statement that runs on every
request and costs more to plan than to run, :func:`prepared_cursor` gives a cursor that prepares
it with SQL's ``PREPARE`` at its first execution on a connection and runs it with ``EXECUTE``
after that, so that PostgreSQL plans it once per connection (the connection option
``plan_cache_mode=force_generic_plan``, set by ``nodepool.settings.postgres_options``). Django's
own statements are never prepared, so that option changes nothing else.

Why SQL's ``PREPARE`` and not psycopg's own preparing (server-side binding, which prepares a
statement after five executions): psycopg forgets every statement it prepared, and sends
``DEALLOCATE ALL``, at each rollback of the connection, a savepoint's included
(``psycopg._preparing``: the state is discarded on ``ROLLBACK``, in case the rollback undid an
object a statement named). A grant that loses a race rolls back, so under contention the hot
statements were unprepared most of the time: with two gunicorn workers granting at full speed,
half of the candidate queries were planned again (``pg_stat_statements``: plans/calls 0.5, the
device candidate query 2-3 ms to plan and 0.15 to run), and PostgreSQL spent 40 % of its time in
the planner. Statements made by ``PREPARE`` belong to the session: a rollback does not undo them
(PostgreSQL docs, PREPARE) and psycopg, which prepared nothing, has nothing to deallocate. The
statements nodepool prepares never name an object a rollback could drop (no DDL runs in a
request), and a plan whose table changed is re-planned by PostgreSQL itself.

The cursor is wrapped like Django's: errors come out as ``django.db`` exceptions and
``connection.execute_wrapper`` hooks see the statement's own text (not the ``EXECUTE``). While
queries are logged (``DEBUG``, or a test's ``CaptureQueriesContext``) it is Django's own cursor
instead, so that the log shows the statement.

For a model row read or written on every request, :func:`fetch_rows` and :func:`insert_row` do
through :func:`prepared_cursor` what ``QuerySet.filter`` and ``Model.save`` do for one table: the
ORM builds the SQL again at every call, which cost 0.3-0.5 ms per statement on this machine
against about 0.1 ms for running the prepared statement.

A connection pooler in transaction mode (PgBouncer, RDS Proxy) cannot keep a session's
prepared statements: put none between nodepool and PostgreSQL, or run it in session mode
(docs/foundation.md).
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections import OrderedDict
from decimal import Decimal

from django.db import DEFAULT_DB_ALIAS, connections, models
from django.db.backends.utils import CursorWrapper
from django.db.models.sql import Query

PREPARED_MAX = 128  # statements kept prepared per connection; the least recently used is deallocated


def prepared_cursor():
    """A Django cursor whose statements PostgreSQL prepares (see the module docstring).

    Use as ``with prepared_cursor() as cursor: cursor.execute(sql, params)``, with ``%s``
    placeholders as for any Django cursor. Values that pick the plan (a pool's id, say) belong in
    the SQL text rather than in ``params``: each text gets its own plan. On SQLite, or when the
    settings bind on the server, it is a plain ``connection.cursor()``.
    """
    connection = connections[DEFAULT_DB_ALIAS]  # the thread's own, not the proxy: one lookup
    if (
        connection.vendor != "postgresql"
        or connection.settings_dict["OPTIONS"].get("server_side_binding")
        or connection.queries_logged
    ):
        return connection.cursor()
    connection.ensure_connection()
    return _PreparingCursor(connection.connection.cursor(), connection)


# Per psycopg connection: {SQL text: (statement name, its parameters' keys in $n order)},
# least recently used first.
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NAMES = itertools.count()
_PLACEHOLDER = re.compile(r"%(?:\((\w+)\))?([%s])")  # %s, %(name)s and the escaped %%
_CAST = re.compile(r"::([a-z_][a-z0-9_ ]*(?:\[\])?)$")


class _PreparingCursor(CursorWrapper):
    """Django's cursor wrapper whose ``execute`` runs ``EXECUTE name(params)`` of the statement,
    prepared by ``PREPARE name (types) AS …`` on its first execution on the connection. Hooks
    and the error wrapping are Django's own (``_execute_with_wrappers``, ``wrap_database_errors``)."""

    def _execute(self, sql, params, *ignored_wrapper_args):
        self.db.validate_no_broken_transaction()
        with self.db.wrap_database_errors:
            name, params = self._statement(sql, params)
            try:
                if params:
                    return self.cursor.execute(f"EXECUTE {name}({', '.join(['%s'] * len(params))})", params)
                return self.cursor.execute(f"EXECUTE {name}")
            except Exception as exc:
                if getattr(exc, "sqlstate", None) == "26000":  # the session lost it (DISCARD ALL, say)
                    _PREPARED.pop(self.db.connection, None)  # prepared again from the next statement on
                raise

    def _statement(self, sql: str, params) -> tuple[str, list]:
        """``(name, values)``: the name of ``sql``'s prepared statement on this connection (prepared
        now if it is not yet) and ``params`` as a list in the order of its ``$n`` (named
        parameters, ``%(name)s``, in the order they first appear)."""
        statements = _PREPARED.setdefault(self.db.connection, OrderedDict())
        entry = statements.get(sql)
        if entry is None:
            names: list = []  # the $n in order: positions, or the names of named parameters

            def number(match) -> str:
                key, kind = match.groups()
                if kind == "%":
                    return "%"
                if key is None:  # positional: the next index of params
                    key = len(names)
                if key not in names:
                    names.append(key)
                return f"${names.index(key) + 1}"

            text = _PLACEHOLDER.sub(number, sql)
            values = [params[key] for key in names] if names else []
            types = f" ({', '.join(self._type(value) for value in values)})" if values else ""
            name = f"nodepool_{next(_NAMES)}"  # unique in the process, so on its connections
            self.cursor.execute(f"PREPARE {name}{types} AS {text}")  # no parameters: sent as it is
            statements[sql] = entry = (name, names)
            if len(statements) > PREPARED_MAX:
                self.cursor.execute(f"DEALLOCATE {statements.popitem(last=False)[1][0]}")
        else:
            statements.move_to_end(sql)
        name, names = entry
        return name, [params[key] for key in names]

    def _type(self, value) -> str:
        """The parameter's SQL type for PREPARE, as psycopg would have typed it when binding on the
        server: integers as bigint (numeric beyond it), the cast psycopg writes for the others
        (uuid, timestamptz, jsonb, arrays …), and ``unknown`` (inferred from where the parameter
        stands) for strings, NULL and an empty array."""
        if isinstance(value, bool):
            return "boolean"
        if isinstance(value, int):
            return "bigint" if -(2**63) <= value < 2**63 else "numeric"
        if isinstance(value, float):
            return "double precision"
        if isinstance(value, Decimal):
            return "numeric"
        if (
            isinstance(value, list | tuple)
            and value
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            return "bigint[]"
        cast = _CAST.search(self.cursor.mogrify("%s", [value]))
        return cast.group(1) if cast else "unknown"


# Per connection's operations object (one per thread): (model, fields) -> _Reader.
_READERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Reader:
    """How to read ``model``'s columns (all concrete ones, or those of ``fields``, in the model's
    field order: ``Model.from_db`` takes values in that order) and convert them: the converters
    are the ORM's own (``SQLCompiler.get_converters``: the backend's, e.g. SQLite's text to
    datetime, then each field's ``from_db_value``, e.g. JSON text to objects), applied by the
    ORM's own ``apply_converters``, as a queryset does."""

    __slots__ = ("columns", "names", "compiler", "converters")

    def __init__(self, connection, model: type[models.Model], fields: tuple[str, ...] | None):
        table = model._meta.db_table
        concrete = model._meta.concrete_fields
        if fields is not None:
            wanted = {model._meta.get_field(name).attname for name in fields}
            concrete = [f for f in concrete if f.attname in wanted]
        quote = connection.ops.quote_name
        self.columns = ", ".join(f"{quote(table)}.{quote(f.column)}" for f in concrete)
        self.names = [f.attname for f in concrete]
        self.compiler = Query(model).get_compiler(connection=connection)
        self.converters = self.compiler.get_converters([f.get_col(table) for f in concrete])


def _reader(connection, model: type[models.Model], fields: tuple[str, ...] | None = None) -> _Reader:
    readers = _READERS.setdefault(connection.ops, {})
    key = (model, fields)
    if key not in readers:
        readers[key] = _Reader(connection, model, fields)
    return readers[key]


def select_list(model: type[models.Model], fields: tuple[str, ...] | None = None) -> str:
    """Every concrete column of ``model`` (or those of ``fields``, names as for ``QuerySet.only``),
    qualified by its table (``"fleet_pool"."id", …``), in the order :func:`from_row` reads them:
    for a prepared ``SELECT`` that joins other tables."""
    return _reader(connections[DEFAULT_DB_ALIAS], model, fields).columns


def from_row(model: type[models.Model], values, fields: tuple[str, ...] | None = None) -> models.Model:
    """The instance of ``model`` read from ``values``, a row's values in :func:`select_list`'s
    order for the same ``fields`` (extra values after them are ignored: :func:`row_width` says
    where the next model's start), converted as the ORM converts them. Fields left out of
    ``fields`` are deferred, as after ``QuerySet.only``."""
    connection = connections[DEFAULT_DB_ALIAS]
    reader = _reader(connection, model, fields)
    (converted,) = reader.compiler.apply_converters([values[: len(reader.names)]], reader.converters)
    return model.from_db(connection.alias, reader.names, converted)


def row_width(model: type[models.Model], fields: tuple[str, ...] | None = None) -> int:
    """How many values of a row :func:`from_row` reads for ``model`` and ``fields``."""
    return len(_reader(connections[DEFAULT_DB_ALIAS], model, fields).names)


def fetch_rows(model: type[models.Model], column: str, value, *, limit: int | None = None) -> list[models.Model]:
    """The instances of ``model`` whose ``column`` (a concrete field's attribute name, e.g.
    ``"name"`` or ``"user_id"``) equals ``value``, read by one prepared ``SELECT`` of every
    concrete column: what ``model.objects.filter(column=value)[:limit]`` answers, with no
    ordering, no related objects and no deferred fields.

    ``value`` is prepared by the field as the ORM would (a UUID for a ``UUIDField``, say).

    Raises:
        django.db.DatabaseError (and subclasses): as any query would.
        django.core.exceptions.FieldDoesNotExist: ``column`` is not a field of ``model``.
    """
    connection = connections[DEFAULT_DB_ALIAS]
    quote = connection.ops.quote_name
    field = model._meta.get_field(column)
    table = quote(model._meta.db_table)
    sql = f"SELECT {select_list(model)} FROM {table} WHERE {table}.{quote(field.column)} = %s"  # noqa: S608
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    with prepared_cursor() as cursor:
        cursor.execute(sql, [field.get_db_prep_value(value, connection)])
        rows = cursor.fetchall()
    return [from_row(model, row) for row in rows]


def insert_row(instance: models.Model) -> models.Model:
    """INSERT the new ``instance`` by one prepared statement: what ``instance.save(force_insert=True)``
    does for a model of one table, without the ``pre_save``/``post_save`` signals (use it only
    for models nobody listens to). Fields are prepared as the ORM prepares them (``pre_save``,
    then ``get_db_prep_save``: ``auto_now_add`` stamps, JSON adaptation); an auto-increment
    primary key is read back (``RETURNING`` where the database has it) and set on ``instance``.

    Returns ``instance``, marked as saved.

    Raises:
        django.db.IntegrityError: a constraint refused the row (as ``save`` would).
    """
    connection = connections[DEFAULT_DB_ALIAS]
    meta = instance._meta
    returning = [f for f in meta.db_returning_fields if getattr(instance, f.attname) is None]
    fields = [f for f in meta.local_concrete_fields if f not in returning]
    quote = connection.ops.quote_name
    sql = (
        f"INSERT INTO {quote(meta.db_table)} ({', '.join(quote(f.column) for f in fields)}) "  # noqa: S608 (names from the model; values bound)
        f"VALUES ({', '.join(['%s'] * len(fields))})"
    )
    params = [_db_value(instance, f, connection) for f in fields]
    can_return = connection.features.can_return_columns_from_insert
    if returning and can_return:
        sql += " RETURNING " + ", ".join(quote(f.column) for f in returning)
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        if returning:
            values = cursor.fetchone() if can_return else [cursor.lastrowid]
            for field, value in zip(returning, values, strict=True):
                setattr(instance, field.attname, value)
    return mark_inserted(instance)


def insert_select(instance: models.Model, computed: dict[str, str]) -> tuple[str, str, list]:
    """The parts of an ``INSERT INTO table (columns) SELECT values …`` of the new ``instance``, for
    a statement that inserts it together with other work (PostgreSQL; a model whose primary key is
    set before the insert): ``(head, values, params)``, where ``head`` is ``INSERT INTO table
    (columns)``, ``values`` the select list and ``params`` its parameters. A field named in
    ``computed`` (attribute name → SQL expression without parameters) takes that expression; the
    others are prepared as :func:`insert_row` prepares them and each cast to its column's type
    (in a select list, unlike ``VALUES``, PostgreSQL does not type a parameter from its column).

    Raises:
        ValueError: the model has a field the database fills in (an automatic primary key unset).
    """
    connection = connections[DEFAULT_DB_ALIAS]
    meta = instance._meta
    if any(getattr(instance, f.attname) is None for f in meta.db_returning_fields):
        raise ValueError(f"{meta.label}: a field the database fills in is unset")
    key = (connection.vendor, meta.label, tuple(sorted(computed.items())))
    if key not in _INSERT_SELECTS:  # the text once per model and vendor (db_type is not cheap)
        quote = connection.ops.quote_name
        fields = meta.local_concrete_fields
        values = [computed[f.attname] if f.attname in computed else f"%s::{f.db_type(connection)}" for f in fields]
        bound = tuple(f for f in fields if f.attname not in computed)
        head = f"INSERT INTO {quote(meta.db_table)} ({', '.join(quote(f.column) for f in fields)})"
        _INSERT_SELECTS[key] = (head, ", ".join(values), bound)
    head, values, bound = _INSERT_SELECTS[key]
    return head, values, [_db_value(instance, field, connection) for field in bound]


_INSERT_SELECTS: dict[tuple, tuple[str, str, tuple]] = {}  # insert_select's text and bound fields


def _db_value(instance: models.Model, field, connection):
    """``field``'s value of the new ``instance`` as the ORM writes it: ``pre_save`` (``auto_now_add``
    stamps), then ``get_db_prep_save`` (JSON adaptation)."""
    return field.get_db_prep_save(field.pre_save(instance, True), connection)


def mark_inserted(instance: models.Model) -> models.Model:
    """Mark ``instance`` saved, as :func:`insert_row` does, after a statement that inserted it."""
    instance._state.adding = False
    instance._state.db = DEFAULT_DB_ALIAS
    return instance
