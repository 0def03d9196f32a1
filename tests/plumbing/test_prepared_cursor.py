"""nodepool.db.prepared_cursor on PostgreSQL: statements prepared by SQL's PREPARE at their first
execution, kept across rollbacks (psycopg's own preparing forgot them at each one), typed as psycopg
would bind them, with named parameters and escaped percent signs, a bounded number per connection,
and prepared again after the session lost them."""

from __future__ import annotations

import uuid

import pytest
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from nodepool import db

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="prepared statements are PostgreSQL's"),
]


def prepared(fragment: str) -> list[tuple]:
    """(statement, generic_plans, custom_plans) of the session's prepared statements containing ``fragment``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
            [f"%{fragment}%"],
        )
        return cursor.fetchall()


def forget_every_statement():
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    db._PREPARED.pop(connection.connection, None)


def run(sql: str, params=None):
    with db.prepared_cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def test_a_statement_survives_rollbacks_and_is_planned_once():
    sql = "SELECT %s::int + 1 AS survives_rollbacks"
    assert run(sql, [1]) == [(2,)]
    with pytest.raises(ZeroDivisionError), transaction.atomic():  # the whole transaction rolls back
        assert run(sql, [2]) == [(3,)]
        raise ZeroDivisionError
    with transaction.atomic():
        try:
            with transaction.atomic():  # a savepoint rolled back (ROLLBACK TO SAVEPOINT)
                run("SELECT 1/0")
        except DatabaseError:
            pass
        assert run(sql, [3]) == [(4,)]

    (statement,) = prepared("survives_rollbacks")  # one PREPARE for all three executions
    assert statement[1] == 3 and statement[2] == 0  # three runs of the generic plan, never a custom one


def test_parameters_are_typed_as_psycopg_binds_them():
    """Without the types, PostgreSQL would take the uuid for text (INSERT … SELECT) and the CASE's
    numbers for text (bigint + text has no operator)."""
    lease_id, now = uuid.uuid4(), timezone.now()
    rows = run(
        "SELECT %s AS typed_id, 40 + CASE %s WHEN 'a' THEN %s ELSE %s END, %s, %s = ANY(%s), %s, %s",
        [lease_id, "a", 2, 3, now, lease_id, [lease_id, uuid.uuid4()], [1, 70000], True],
    )
    assert rows == [(lease_id, 42, now, True, [1, 70000], True)]
    (statement,) = prepared("typed_id")
    assert statement[0].startswith("PREPARE nodepool_")
    assert "(uuid, unknown, bigint, bigint, timestamptz" in statement[0]


def test_named_parameters_and_escaped_percent_signs():
    sql = "SELECT %(a)s::int + %(b)s::int + %(a)s::int AS named, 'x' LIKE 'x%%' AS escaped"
    for a in range(3):
        assert run(sql, {"b": 10, "a": a}) == [(10 + 2 * a, True)]
    (statement,) = prepared("AS named")
    assert "$1::int + $2::int + $1::int" in statement[0] and "LIKE 'x%'" in statement[0]


def test_the_least_recently_used_statement_is_deallocated_beyond_the_bound(monkeypatch):
    monkeypatch.setattr(db, "PREPARED_MAX", 3)
    forget_every_statement()
    for i in range(5):
        run(f"SELECT {i} AS bounded_{i}")
    run("SELECT 2 AS bounded_2")  # used again: the most recent
    run("SELECT 5 AS bounded_5")
    kept = sorted(int(s[0].rsplit("_", 1)[1]) for s in prepared("AS bounded_"))
    assert kept == [2, 4, 5]


def test_a_statement_the_session_lost_is_prepared_again():
    sql = "SELECT %s::int AS lost_and_found"
    assert run(sql, [1]) == [(1,)]
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")  # as a pooler or an operator's DISCARD ALL would
    with pytest.raises(DatabaseError), transaction.atomic():  # that execution fails (it could not retry …
        run(sql, [2])  # … inside a transaction), …
    assert run(sql, [3]) == [(3,)]  # … and the next one prepares it again
    assert len(prepared("lost_and_found")) == 1
