"""The PostgreSQL/SQLite differences of leases' raw SQL, in one place: the other modules of
leases.sql ask these instead of testing the vendor themselves. And the names of tables and
columns, taken from the models' ``_meta`` (never from input) and quoted for the connection.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, transaction


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


def sorted_concat(expression: str, separator: str, source: str) -> str:
    """The ``separator``-joined text of ``expression`` over the rows of ``source`` (a ``FROM …
    WHERE …`` clause), in sorted order. PostgreSQL's ``string_agg`` sorts in the aggregate; SQLite's
    ``group_concat`` (before 3.44) concatenates in its subquery's order, so that subquery sorts."""
    if is_postgresql():
        return f"(SELECT string_agg(x, '{separator}' ORDER BY x) FROM (SELECT {expression} AS x {source}) s)"  # noqa: S608
    return f"(SELECT group_concat(x, '{separator}') FROM (SELECT {expression} AS x {source} ORDER BY x) s)"  # noqa: S608


def least_id(column: str) -> str:
    """An aggregate: one UUID of ``column``'s group, the same each time (the least, as text).
    PostgreSQL has no ``min(uuid)``: the least text form, cast back; SQLite stores a UUID as 32
    hex digits, whose ``MIN`` already is."""
    return f"CAST(MIN(CAST({column} AS TEXT)) AS uuid)" if is_postgresql() else f"MIN({column})"


def one_of(column: str, values: list) -> tuple[str, list]:
    """``column`` is one of ``values``, sent as one parameter however many values there are: an
    array on PostgreSQL (``= ANY(%s)``), a JSON array on SQLite (``IN (SELECT value FROM
    json_each(%s))``). 10,000 placeholders cost more to build, send and parse than the query."""
    if is_postgresql():
        return f"{column} = ANY(%s)", [values]
    return f"{column} IN (SELECT value FROM json_each(%s))", [json.dumps(values)]  # noqa: S608 (values bound)


def glob_match(column: str, pattern: str) -> tuple[str, list]:
    """``column`` matches the shell pattern ``pattern`` as :func:`fnmatch.fnmatchcase` does, for a
    pattern whose wildcards are ``*`` and ``?`` only (``[…]`` classes differ between fnmatch,
    SQLite's GLOB and SQL's LIKE: leases.sql.devices.decided_in_sql keeps them in Python). SQLite's
    GLOB is case-sensitive with fnmatch's ``*`` and ``?``; PostgreSQL's LIKE is case-sensitive, with
    the pattern's ``\\``, ``%`` and ``_`` escaped and ``*``/``?`` written as ``%``/``_``."""
    if not is_postgresql():
        return f"{column} GLOB %s", [pattern]
    escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"{column} LIKE %s ESCAPE '\\'", [escaped.replace("*", "%").replace("?", "_")]


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


# --- names, from the models and quoted for the connection -----------------------------------------


def _quote(name: str) -> str:
    return connection.ops.quote_name(name)


def table_name(model) -> str:
    return _quote(model._meta.db_table)


def column_name(model, field: str) -> str:
    return _quote(model._meta.get_field(field).column)
