"""Database plumbing shared by the apps: a cursor for statements worth preparing.

Django binds parameters on the client (psycopg's ``ClientCursor``): every statement reaches
PostgreSQL as text and is planned again at each execution. For a statement that runs on every
request and costs more to plan than to run, :func:`prepared_cursor` gives a cursor that binds on
the server, so that psycopg prepares the statement after :data:`PREPARE_THRESHOLD` executions on a
connection and PostgreSQL plans it once per connection (the connection option
``plan_cache_mode=force_generic_plan``, set by ``nodepool.settings.postgres_options``). Django's
own cursors never prepare, so that option changes nothing else.

The cursor is wrapped like Django's: errors come out as ``django.db`` exceptions and
``connection.execute_wrapper`` hooks see the statement. While queries are logged (``DEBUG``, or a
test's ``CaptureQueriesContext``) it is Django's own cursor instead: Django reads a statement's
text back from psycopg, which keeps none for a prepared execution.

For a model row read or written on every request, :func:`fetch_rows` and :func:`insert_row` do
through :func:`prepared_cursor` what ``QuerySet.filter`` and ``Model.save`` do for one table: the
ORM builds the SQL again at every call, which cost 0.3-0.5 ms per statement on this machine
against about 0.1 ms for running the prepared statement.

A connection pooler in transaction mode (PgBouncer before 1.21, or without
``max_prepared_statements``) does not keep prepared statements: do not put one between nodepool
and PostgreSQL, or set ``max_prepared_statements`` (docs/foundation.md).
"""

from __future__ import annotations

import weakref

from django.db import DEFAULT_DB_ALIAS, connections, models
from django.db.backends.utils import CursorWrapper
from django.db.models.sql import Query

PREPARE_THRESHOLD = 5  # psycopg's default: executions of one statement before it is prepared


def prepared_cursor():
    """A Django cursor whose statements PostgreSQL prepares (see the module docstring).

    Use as ``with prepared_cursor() as cursor: cursor.execute(sql, params)``, with ``%s``
    placeholders as for any Django cursor. Values that pick the plan (a pool's id, say) belong in
    the SQL text rather than in ``params``: each text gets its own plan. On SQLite, or when the
    settings bind on the server already, it is a plain ``connection.cursor()``.
    """
    connection = connections[DEFAULT_DB_ALIAS]  # the thread's own, not the proxy: one lookup
    if (
        connection.vendor != "postgresql"
        or connection.settings_dict["OPTIONS"].get("server_side_binding")
        or connection.queries_logged
    ):
        return connection.cursor()
    import psycopg  # only here: a SQLite deployment need not install the PostgreSQL driver

    connection.ensure_connection()
    raw = connection.connection
    if raw.prepare_threshold is None:  # Django switches preparing off; only this cursor binds on the server
        raw.prepare_threshold = PREPARE_THRESHOLD
    return CursorWrapper(psycopg.Cursor(raw), connection)


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
    params = [f.get_db_prep_save(f.pre_save(instance, True), connection) for f in fields]
    can_return = connection.features.can_return_columns_from_insert
    if returning and can_return:
        sql += " RETURNING " + ", ".join(quote(f.column) for f in returning)
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        if returning:
            values = cursor.fetchone() if can_return else [cursor.lastrowid]
            for field, value in zip(returning, values, strict=True):
                setattr(instance, field.attname, value)
    instance._state.adding = False
    instance._state.db = connection.alias
    return instance
