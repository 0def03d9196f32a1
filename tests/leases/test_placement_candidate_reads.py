"""The grant's candidate read (leases.placement._page_reader): the cached SQL, prepared on PostgreSQL
(nodepool.db.prepared_cursor), answers exactly what the ORM's candidate query answers."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from fleet.choices import SchedulingPolicy
from fleet.models import NodeResource
from leases import placement
from leases.spec import PlacementSpec, parse_spec
from tests.factories import PoolFactory, make_schedulable_node

GiB = 2**30
RUNS = 6  # executions of one statement on one connection: the first prepares it
pytestmark = pytest.mark.django_db
on_postgresql = pytest.mark.skipif(connection.vendor != "postgresql", reason="prepared statements are PostgreSQL's")

SHAPES = (
    {"cpu": 1000},
    {"cpu": 500, "memory": 2 * GiB},
    {"cpu": 500, "memory": GiB, "example.com/fpga": 1},  # two joined resources: r0_* and r2_* columns
    {"memory": 6 * GiB},  # no cpu: the first resource by name leads
)


@pytest.fixture
def pools():
    """Two pools, one per policy, whose nodes differ in free capacity so that order matters."""
    made = []
    for name, policy in (("packed", SchedulingPolicy.BINPACK), ("spread", SchedulingPolicy.SPREAD)):
        pool = PoolFactory(name=name, scheduling_policy=policy)
        for i, (cpu, memory, fpga) in enumerate(((8000, 32, 2), (4000, 8, 0), (2000, 4, 1), (6000, 16, 1))):
            node, _ = make_schedulable_node(
                pool, hostname=f"{name}-{i}", resources={"cpu": cpu, "memory": memory * GiB, "example.com/fpga": fpga}
            )
            NodeResource.objects.filter(node=node, name="cpu").update(allocated=cpu // (i + 2))
        made.append(pool)
    return made


def orm_rows(pool, spec):
    return [row[:1] + row[7:] for row in placement.candidate_query(pool, spec)]


def read_rows(pool, spec):
    return [row[:1] + row[7:] for row in placement._page_reader(pool, spec)(0, 100)]


def test_the_page_reader_answers_what_the_candidate_query_answers_for_every_shape_pool_and_policy(pools):
    for _ in range(RUNS + 2):  # on PostgreSQL the later rounds run the prepared statements
        for pool in pools:
            for resources in SHAPES:
                spec = PlacementSpec(workload_id="w", pool=pool.name, resources=resources)
                expected = orm_rows(pool, spec)
                assert read_rows(pool, spec) == expected, (pool.name, resources)
                assert expected, (pool.name, resources)  # every shape fits somewhere: the check can fail


def test_a_prepared_read_sees_capacity_taken_after_it_was_prepared(pools):
    pool = pools[0]
    spec = PlacementSpec(workload_id="w", pool=pool.name, resources={"cpu": 3000, "memory": GiB})
    for _ in range(RUNS + 1):
        before = read_rows(pool, spec)
    first = before[0][0]
    NodeResource.objects.filter(node_id=first, name="cpu").update(allocated=7_999)

    after = read_rows(pool, spec)

    assert first not in [row[0] for row in after]
    assert after == orm_rows(pool, spec)


@on_postgresql
def test_each_pool_gets_its_own_prepared_statement_with_a_generic_plan(pools):
    spec_for = {pool.pk: PlacementSpec(workload_id="w", pool=pool.name, resources={"cpu": 1000}) for pool in pools}
    for _ in range(RUNS + 2):
        for pool in pools:
            read_rows(pool, spec_for[pool.pk])

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
            ['%"fleet_noderesource"."node_id"%'],
        )
        statements = cursor.fetchall()
    for pool in pools:
        mine = [row for row in statements if re.search(rf'"fleet_node"\."pool_id" = {pool.pk}\b', row[0])]
        assert len(mine) == 1, (pool.name, [row[0][-300:] for row in statements])
        assert mine[0][1] >= 1 and mine[0][2] == 0  # planned once, generically, never per execution


@on_postgresql
def test_the_prepared_read_goes_through_djangos_cursor_wrapper(pools):
    """execute_wrapper hooks see it, and its errors are django.db's (callers catch DatabaseError)."""
    from django.db import DatabaseError

    spec = PlacementSpec(workload_id="w", pool=pools[0].name, resources={"cpu": 1000})
    seen = []

    def hook(execute, sql, params, many, context):
        seen.append(sql)
        if len(seen) > RUNS + 1:
            return execute("SELECT 1/0", (), many, context)  # fails inside psycopg, as a timeout would
        return execute(sql, params, many, context)

    with connection.execute_wrapper(hook):
        for _ in range(RUNS + 1):
            read_rows(pools[0], spec)
        with pytest.raises(DatabaseError):
            read_rows(pools[0], spec)
    assert all('"fleet_noderesource"."node_id"' in sql for sql in seen)


def test_a_query_capture_records_the_candidate_read_with_its_text(pools):
    spec = PlacementSpec(workload_id="w", pool=pools[0].name, resources={"cpu": 1000})
    with CaptureQueriesContext(connection) as queries:
        for _ in range(RUNS + 1):
            read_rows(pools[0], spec)
    texts = [query["sql"] for query in queries.captured_queries]
    assert len(texts) == RUNS + 1 and all('"fleet_noderesource"' in text for text in texts)


@pytest.fixture
def tainted_front():
    """A binpack pool whose fullest nodes carry a NoSchedule taint: 40 tainted, nearly full nodes
    sort before 3 untainted ones (one with a PreferNoSchedule taint, which only lowers a score)."""
    pool = PoolFactory(name="packed", scheduling_policy=SchedulingPolicy.BINPACK)
    for i in range(40):
        node, _ = make_schedulable_node(
            pool, hostname=f"gpu-{i:02d}", resources={"cpu": 8000}, taints=[{"key": "gpu", "effect": "NoSchedule"}]
        )
        NodeResource.objects.filter(node=node).update(allocated=7000)
    plain = {make_schedulable_node(pool, hostname=f"cpu-{i}", resources={"cpu": 8000})[0].pk for i in range(2)}
    soft, _ = make_schedulable_node(
        pool, hostname="soft", resources={"cpu": 8000}, taints=[{"key": "spot", "effect": "PreferNoSchedule"}]
    )
    return pool, plain | {soft.pk}


def test_a_request_without_tolerations_finds_the_untainted_nodes_behind_a_tainted_front(tainted_front, monkeypatch):
    pool, untainted = tainted_front
    if connection.vendor == "postgresql":  # the SQL leaves the tainted nodes out: no census, no long walk
        monkeypatch.setattr(placement, "diagnose", lambda *a, **k: pytest.fail("the census ran"))

    search = placement.find_candidates(pool, PlacementSpec(workload_id="w", pool=pool.name, resources={"cpu": 500}))

    assert {c.node.pk for c in search.candidates} == untainted
    if connection.vendor == "postgresql":
        assert search.examined == len(untainted)


def test_a_tolerating_request_still_gets_the_tainted_nodes_first_under_binpack(tainted_front):
    from leases.spec import Toleration

    pool, untainted = tainted_front
    spec = PlacementSpec(
        workload_id="w", pool=pool.name, resources={"cpu": 500}, tolerations=(Toleration(key="gpu", operator="Exists"),)
    )

    search = placement.find_candidates(pool, spec)

    assert search.candidates and all(c.node.hostname.startswith("gpu-") for c in search.candidates)


def test_node_views_of_read_rows_decode_to_the_orms_documents(pools):
    """The page reader leaves JSON columns as the database's text; NodeView decodes each on first
    read to what the ORM's JSONField gives."""
    pool = pools[0]
    node = pool.nodes.first()
    node.labels, node.node_labels = {"zone": "a", "7": "x"}, {"disk": "ssd"}
    node.taints = [{"key": "k", "value": "v", "effect": "PreferNoSchedule"}]
    node.save(update_fields=["labels", "node_labels", "taints"])
    spec = PlacementSpec(workload_id="w", pool=pool.name, resources={"cpu": 100})
    expected = {row[0]: row[2:6] for row in placement.candidate_query(pool, spec)}
    for row in placement._page_reader(pool, spec)(0, 100):
        view = placement.NodeView(*row[:7])
        assert (view.labels, view.node_labels, view.taints, view.verified) == expected[view.pk]


def test_a_request_without_selectors_leaves_its_candidates_label_documents_undecoded(pools):
    """Decoding every candidate's labels was a tenth of a grant's CPU; only the filters and scores
    that read labels decode them."""
    pool = pools[0]
    plain = placement.find_candidates(pool, PlacementSpec(workload_id="w", pool=pool.name, resources={"cpu": 100}))
    assert plain.candidates
    assert all(isinstance(c.node._labels, str) for c in plain.candidates)
    assert all(c.node._label_view is None for c in plain.candidates)
    selecting = PlacementSpec(
        workload_id="w", pool=pool.name, resources={"cpu": 100}, node_selector={"kubernetes.io/hostname": "packed-0"}
    )
    [chosen] = placement.find_candidates(pool, selecting).candidates
    assert chosen.node.hostname == "packed-0" and chosen.node._label_view["kubernetes.io/hostname"] == "packed-0"


def test_the_first_page_is_the_feasible_target_only_when_the_sql_applies_every_filter():
    pool = PoolFactory(name="plain")
    for i in range(placement.FEASIBLE_TARGET + 4):
        make_schedulable_node(pool, hostname=f"plain-{i}", resources={"cpu": 8000})
    plain = PlacementSpec(workload_id="w", pool=pool.name, resources={"cpu": 100})
    assert placement._first_page_size(pool, plain) == placement.FEASIBLE_TARGET
    search = placement.find_candidates(pool, plain)
    assert len(search.candidates) == placement.FEASIBLE_TARGET and search.examined == placement.FEASIBLE_TARGET
    # Anything a Python filter may turn down reads the larger page.
    for spec in (
        PlacementSpec(workload_id="w", pool=pool.name, resources={"cpu": 100}, node_selector={"zone": "a"}),
        parse_spec(
            {
                "workload_id": "w",
                "pool": pool.name,
                "resources": {"cpu": "100m"},
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
            }
        ),  # fmt: skip
    ):
        assert placement._first_page_size(pool, spec) == placement.FIRST_PAGE_SIZE
    pool.taints = [{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]
    assert placement._first_page_size(pool, plain) == placement.FIRST_PAGE_SIZE
