"""fleet.sql: the raw statements of fleet's hot paths (issue 28 step 7).

The SQLite function the sweep's deadlines use writes the same text as Django's private
``django_format_dtdelta`` it replaces; it is registered on ``connection_created``; the event rows a
statement inserts cover every column of NodeEvent (the list comes from the model); and the
statement of a sweep writes the same event the ORM path writes.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.db.backends.sqlite3._functions import _sqlite_format_dtdelta

from fleet import event_types, sql
from fleet.events import Actor, event_row
from fleet.models import Node, NodeEvent

ROOT = Path(__file__).resolve().parents[2]


def stored(value: datetime) -> str:
    """A datetime as Django stores it on SQLite (naive UTC text)."""
    return str(value.astimezone(UTC).replace(tzinfo=None))


def test_plus_microseconds_writes_what_django_format_dtdelta_wrote():
    rng = random.Random(28)
    base = datetime(2026, 12, 3, 5, 0, tzinfo=UTC)
    samples = [(base, 0), (base, 1), (base, -1), (base, 1_500_000), (base.replace(microsecond=999_999), 1)]
    for _ in range(2000):
        moment = base + timedelta(seconds=rng.uniform(-1e7, 1e7), microseconds=rng.choice([0, rng.randrange(10**6)]))
        samples.append((moment, rng.choice([0, rng.randrange(-(10**10), 10**10), round(rng.uniform(0, 3600) * 1e6)])))
    for moment, microseconds in samples:
        text = stored(moment)
        assert sql.plus_microseconds(text, microseconds) == _sqlite_format_dtdelta("+", text, microseconds)
    assert sql.plus_microseconds(None, 5) is None and sql.plus_microseconds("2026-12-03 05:00:00", None) is None


@pytest.mark.django_db
def test_the_sqlite_function_is_registered_on_every_connection():
    if connection.vendor != "sqlite":
        pytest.skip("the function is SQLite's; PostgreSQL has interval arithmetic")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {sql.SQLITE_PLUS_MICROSECONDS}(%s, %s)", ["2026-12-03 05:00:00", 2_500_000])
        assert cursor.fetchone()[0] == "2026-12-03 05:00:02.500000"


def test_no_fleet_module_calls_djangos_private_sqlite_functions():
    for path in (ROOT / "fleet").rglob("*.py"):
        assert "django_format_dtdelta(" not in path.read_text(), path


@pytest.mark.django_db
def test_the_event_insert_lists_every_column_of_the_model_and_takes_the_template_values():
    now = datetime(2026, 12, 3, 5, 0, tzinfo=UTC)
    template = event_row(None, event_types.LIVENESS, Actor.system("fleet.sweep_liveness"), from_state="alive")
    template.created_at = now
    statement, params = sql.event_insert("moved", {"node_id": "id", "pool_id": "pool_id"}, template)
    columns = statement.split("(", 1)[1].split(")", 1)[0]
    expected = [connection.ops.quote_name(f.column) for f in NodeEvent._meta.concrete_fields if not f.primary_key]
    assert [c.strip() for c in columns.split(",")] == expected
    # node and pool from the statement; every other column bound from the template, as save() prepares it
    assert len(params) == len(expected) - 2
    created = NodeEvent._meta.get_field("created_at")
    assert created.get_db_prep_save(now, connection) in params


def test_fleet_sql_is_the_only_fleet_module_building_sql_from_strings():
    """Fewer modules suppress ruff's S608 ("SQL built as a string"): in fleet only fleet.sql and
    fleet.fleet_state (a read of the overview, not on a hot path) do."""
    suppressing = sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "fleet").rglob("*.py") if "noqa: S608" in path.read_text()
    )
    assert suppressing == ["fleet/fleet_state.py", "fleet/sql.py"]


@pytest.mark.django_db
def test_later_of_is_null_only_when_both_are_null_on_either_database():
    """PostgreSQL's ``GREATEST`` ignores a NULL argument; SQLite's ``MAX(a, b)`` is NULL when
    either is. later_of gives PostgreSQL's answer on both: a node never heard from (no
    ``last_heartbeat_at``) gets the reference, not a NULL deadline."""
    from tests.factories import NodeFactory

    heard = datetime(2026, 12, 3, 5, 0, tzinfo=UTC)
    reference = heard + timedelta(minutes=5)
    silent, beating = NodeFactory(last_heartbeat_at=None), NodeFactory(last_heartbeat_at=heard)

    def later(node, value):
        expression, params = sql.later_of("last_heartbeat_at", value)
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT {expression} FROM fleet_node WHERE id = %s",
                [*params, Node._meta.pk.get_db_prep_value(node.pk, connection)],
            )
            raw = cursor.fetchone()[0]
        if isinstance(raw, str):  # SQLite: the text Django stores, naive UTC
            raw = datetime.fromisoformat(raw)
        return raw if raw is None or raw.tzinfo else raw.replace(tzinfo=UTC)

    assert later(silent, reference) == reference
    assert later(silent, None) is None
    assert later(beating, reference) == reference
    assert later(beating, heard - timedelta(minutes=5)) == heard
    assert later(beating, None) == heard
