"""leases.sql: the raw statements of the grant and of placement (issue 28 step 7).

Only the leases.sql package builds SQL from strings in leases, and only leases.sql.vendor asks
which database it runs on; the capacity UPDATE takes all of a request or nothing; the fencing
upsert counts up per workload; the one-parameter hostname condition selects what
``hostname__in`` selects; the census' planner settings last for its statement only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.db import connection, transaction

from fleet.models import Node, NodeResource
from leases.sql import census as census_sql
from leases.sql import grant as grant_sql
from tests.factories import PoolFactory, make_schedulable_node

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.django_db


def test_leases_sql_is_the_only_leases_module_building_sql_from_strings():
    """Fewer modules suppress ruff's S608/S611 ("SQL built as a string", RawSQL): in leases only
    the modules of leases.sql do (leases.devices calls the device statements of leases.sql.devices)."""
    suppressing = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "leases").rglob("*.py")
        if "noqa: S608" in path.read_text() or "noqa: S611" in path.read_text()
    )
    assert suppressing, "no module suppresses S608/S611: the test no longer sees them"
    assert [path for path in suppressing if not path.startswith("leases/sql/")] == []


def test_no_leases_module_but_leases_sql_asks_which_database_it_runs_on():
    """The PostgreSQL/SQLite differences are leases.sql.vendor's (the candidate cache keys its
    compiled SQL by the backend that compiled it, asking nothing)."""
    asking = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "leases").rglob("*.py")
        if re.search(r"\bvendor\s*[!=]=", path.read_text())
    )
    assert asking == ["leases/sql/vendor.py"]


def test_take_capacity_takes_every_resource_or_none():
    node, _ = make_schedulable_node(PoolFactory(name="general"), resources={"cpu": 1000, "memory": 2**30})

    def allocated():
        return dict(NodeResource.objects.filter(node=node).values_list("name", "allocated"))

    with transaction.atomic():
        assert grant_sql.take_capacity(node.pk, {"cpu": 600, "memory": 2**29}) == 2
    assert allocated()["cpu"] == 600
    # cpu no longer fits: the memory row changes, the row count says one of two (the grant rolls back)
    with transaction.atomic():
        assert grant_sql.take_capacity(node.pk, {"cpu": 600, "memory": 2**29}) == 1
        transaction.set_rollback(True)
    assert allocated() == {"cpu": 600, "memory": 2**29}
    assert grant_sql.take_capacity(node.pk, {"cpu": 400}) == 1  # exactly allocatable fits
    assert grant_sql.take_capacity(node.pk, {"cpu": 1}) == 0


def test_the_fencing_token_counts_up_per_workload():
    with transaction.atomic():
        assert [grant_sql.next_fencing_token("job-a") for _ in range(3)] == [1, 2, 3]
        assert grant_sql.next_fencing_token("job-b") == 1


def test_the_node_gate_reads_the_nodes_schedulability_columns():
    node, _ = make_schedulable_node(PoolFactory(name="general"))
    with transaction.atomic():
        row = grant_sql.node_gate(node.pk)
    fresh = Node.objects.get(pk=node.pk)
    assert row == (
        fresh.lifecycle, fresh.liveness, fresh.ready, fresh.health, fresh.cordoned,
        fresh.status_report_overdue, fresh.instructions, fresh.incarnation,
    )  # fmt: skip
    assert grant_sql.node_gate("00000000-0000-0000-0000-000000000000") is None


def test_hostname_in_selects_what_hostname_in_selects():
    pool = PoolFactory(name="general")
    for i in range(5):
        make_schedulable_node(pool, hostname=f"host-{i}")
    wanted = {"host-1", "host-3", "host-9", "o'brien"}
    expected = set(Node.objects.filter(hostname__in=wanted).values_list("hostname", flat=True))
    assert set(Node.objects.filter(census_sql.hostname_in(wanted)).values_list("hostname", flat=True)) == expected
    assert expected == {"host-1", "host-3"}


@pytest.mark.skipif(connection.vendor != "postgresql", reason="planner settings are PostgreSQL's")
def test_the_census_planner_settings_last_for_its_statement_only():
    def setting(name):
        with connection.cursor() as cursor:
            cursor.execute(f"SHOW {name}")
            return cursor.fetchone()[0]

    names = ("enable_sort", "parallel_tuple_cost", "parallel_setup_cost", "jit")
    seen = {}

    class Probe:
        """A queryset stand-in that reads the settings the census runs under."""

        def __iter__(self):
            seen.update({name: setting(name) for name in names})
            return iter([])

    with transaction.atomic():
        before = [setting(name) for name in names]
        assert census_sql.census_rows(Probe()) == []
        assert [setting(name) for name in names] == before
    assert seen == {"enable_sort": "off", "parallel_tuple_cost": "0.02", "parallel_setup_cost": "100", "jit": "off"}
