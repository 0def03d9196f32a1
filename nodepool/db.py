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

A connection pooler in transaction mode (PgBouncer before 1.21, or without
``max_prepared_statements``) does not keep prepared statements: do not put one between nodepool
and PostgreSQL, or set ``max_prepared_statements`` (docs/foundation.md).
"""

from __future__ import annotations

from django.db import connection
from django.db.backends.utils import CursorWrapper

PREPARE_THRESHOLD = 5  # psycopg's default: executions of one statement before it is prepared


def prepared_cursor():
    """A Django cursor whose statements PostgreSQL prepares (see the module docstring).

    Use as ``with prepared_cursor() as cursor: cursor.execute(sql, params)``, with ``%s``
    placeholders as for any Django cursor. Values that pick the plan (a pool's id, say) belong in
    the SQL text rather than in ``params``: each text gets its own plan. On SQLite, or when the
    settings bind on the server already, it is a plain ``connection.cursor()``.
    """
    if (
        connection.vendor != "postgresql"
        or connection.settings_dict["OPTIONS"].get("server_side_binding")
        or connection.queries_logged
    ):
        return connection.cursor()
    import psycopg

    connection.ensure_connection()
    raw = connection.connection
    if raw.prepare_threshold is None:  # Django switches preparing off; only this cursor binds on the server
        raw.prepare_threshold = PREPARE_THRESHOLD
    return CursorWrapper(psycopg.Cursor(raw), connection)
