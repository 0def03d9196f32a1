"""The 409 explanation is set-based (a few grouped queries), and it must say exactly what a node-by-node
walk of the same filters says: every non-retired node counted once, under its first failed filter.

The reference below is that walk (the explanation's former implementation): ``unschedulable_reasons``
per node, then the constraint filters, then the first short resource. Hypothesis builds small pools
that mix every kind of node the explanation tells apart, and requests that mix every filter,
including the ones keyed on a node's own identity (hostname, node id).
"""

from __future__ import annotations

from collections import Counter

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet import health
from fleet.choices import Health, Lifecycle, Liveness
from fleet.models import Node, NodeCredential, NodeResource
from fleet.selectors import unschedulable_reasons, valid_credential_exists
from leases import placement
from leases.spec import parse_spec
from tests.factories import PoolFactory, make_schedulable_node
from tests.maintenance_support import make_lease

pytestmark = pytest.mark.django_db

STATES = (
    "ok", "degraded", "pending", "admitting", "retired", "cordoned", "stale", "not_ready",
    "ready_false", "ready_unknown", "memory_pressure", "overdue", "no_credential",
)  # fmt: skip
CONDITIONS = {
    "degraded": [{"type": "DiskPressure", "status": "True"}],
    "ready_false": [{"type": "Ready", "status": "False", "reason": "KubeletNotReady"}],
    "ready_unknown": [{"type": "Ready", "status": "Unknown"}],
    "memory_pressure": [{"type": "Ready", "status": "True"}, {"type": "MemoryPressure", "status": "True"}],
}

nodes_strategy = st.lists(
    st.fixed_dictionaries(
        {
            # Half the nodes schedulable, so that the constraint and resource filters get work too.
            "state": st.one_of(st.sampled_from(("ok", "degraded")), st.sampled_from(STATES)),
            "zone": st.sampled_from(("a", "b")),
            "arch": st.sampled_from(("amd64", "arm64")),
            "taint": st.sampled_from((None, "NoSchedule", "PreferNoSchedule", "NoExecute")),
            "hostname": st.sampled_from(("", "h1", "h2", "h3")),
            "hostname_label": st.booleans(),
            "declared_zone": st.sampled_from((None, "a", "b")),
            "cpu": st.sampled_from((1000, 4000)),
            "cpu_used": st.sampled_from((0, 500, 3000)),
            "memory_gib": st.sampled_from((0, 1, 4)),
            "lease_in_group": st.booleans(),
        }
    ),
    min_size=0,
    max_size=7,
)

request_strategy = st.fixed_dictionaries(
    {
        "cpu": st.sampled_from(("500m", "2", "5")),
        "memory": st.sampled_from((None, "2Gi")),
        "trust_node_labels": st.booleans(),
        "selector": st.sampled_from((None, "zone", "declared", "hostname", "node-id")),
        "required": st.sampled_from((None, "arch", "hostname-notin")),
        "tolerate": st.booleans(),
        "feature": st.sampled_from((None, "amd64")),
        "spread": st.sampled_from((None, "host", "zone", "node-id")),
        "exclude_first": st.booleans(),
    }
)


def build(pool, descriptions) -> list[Node]:
    nodes = []
    for i, d in enumerate(descriptions):
        labels = {"zone": d["zone"]}
        if d["hostname_label"]:
            labels["kubernetes.io/hostname"] = f"label-{i % 2}"
        taints = [{"key": "gpu", "value": "true", "effect": d["taint"]}] if d["taint"] else []
        resources = {"cpu": d["cpu"]}
        if d["memory_gib"]:
            resources["memory"] = d["memory_gib"] * 2**30
        node, _ = make_schedulable_node(pool, resources=resources, labels=labels, taints=taints, hostname=d["hostname"])
        if d["declared_zone"]:  # node-declared labels count only in a pool that trusts them
            Node.objects.filter(pk=node.pk).update(node_labels={"zone": d["declared_zone"], "declared": "yes"})
        Node.objects.filter(pk=node.pk).update(verified={"features": {"arch": d["arch"], "os": "linux"}})
        NodeResource.objects.filter(node=node, name="cpu").update(allocated=d["cpu_used"])
        state = d["state"]
        if state in CONDITIONS:
            verdict, reasons = health.evaluate(
                CONDITIONS[state], unhealthy=["MemoryPressure"], degraded=["DiskPressure"]
            )
            Node.objects.filter(pk=node.pk).update(conditions=CONDITIONS[state], health=verdict, health_reasons=reasons)
        fields = {
            "pending": {"lifecycle": Lifecycle.PENDING},
            "admitting": {"lifecycle": Lifecycle.ADMITTING},
            "retired": {"lifecycle": Lifecycle.RETIRED},
            "cordoned": {"cordoned": True},
            "stale": {"liveness": Liveness.STALE},
            "not_ready": {"ready": False, "ready_reason": "booting"},
            "overdue": {"status_report_overdue": True},
        }.get(state)
        if fields:
            Node.objects.filter(pk=node.pk).update(**fields)
        if state == "no_credential":
            NodeCredential.objects.filter(node=node).update(revoked_at=timezone.now())
        node.refresh_from_db()
        if d["lease_in_group"]:
            make_lease(node, f"{pool.name}-w{i}", group=f"{pool.name}-g", resources={"cpu": 0})
        nodes.append(node)
    return nodes


def request_body(pool, nodes, r) -> dict:
    body = {"workload_id": "w", "pool": pool.name, "resources": {"cpu": r["cpu"]}}
    if r["memory"]:
        body["resources"]["memory"] = r["memory"]
    some = nodes[0] if nodes else None
    selector = {
        "zone": {"zone": "a"},
        "declared": {"declared": "yes"},
        "hostname": {"kubernetes.io/hostname": (some.hostname or str(some.pk)) if some else "h1"},
        "node-id": {"nodepool.dev/node-id": str(some.pk) if some else "x"},
    }.get(r["selector"])
    if selector:
        body["node_selector"] = selector
    required = {
        "arch": [{"key": "arch", "operator": "In", "values": ["amd64"]}],
        "hostname-notin": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["h1", "label-0"]}],
    }.get(r["required"])
    if required:
        body["affinity"] = {"required": required}
    if r["tolerate"]:
        body["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
    if r["feature"]:
        body["features"] = {"arch": r["feature"]}
    if r["spread"]:
        key = {"host": "host", "zone": "zone", "node-id": "nodepool.dev/node-id"}[r["spread"]]
        body["spread"] = {"group": f"{pool.name}-g", "topology_key": key, "mode": "anti-affinity"}
    return body


def node_by_node(pool, spec, exclude=()) -> tuple[Counter, int]:
    """The reference: each node's first failed filter, one node at a time."""
    counts = placement.group_counts(spec, pool)
    reasons: Counter = Counter()
    nodes = Node.objects.filter(pool=pool).exclude(lifecycle=Lifecycle.RETIRED)
    considered = 0
    for node in nodes.annotate(has_valid_credential=valid_credential_exists()):
        considered += 1
        if node.pk in exclude:
            reasons[placement.EXCLUDED] += 1
            continue
        not_schedulable = unschedulable_reasons(node)
        if not_schedulable:
            reasons[not_schedulable[0]["code"]] += 1
            continue
        code = placement.constraint_failure(node, pool, spec, counts)
        if code is None:
            free = {r.name: max(0, r.allocatable - r.allocated) for r in node.resources.all()}
            code = placement.resource_failure(free, spec)
        if code:
            reasons[code] += 1
    return reasons, considered


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(descriptions=nodes_strategy, request=request_strategy)
def test_the_set_based_explanation_counts_what_a_node_by_node_walk_counts(descriptions, request):
    pool = PoolFactory(trust_node_labels=request["trust_node_labels"])
    nodes = build(pool, descriptions)
    spec = parse_spec(request_body(pool, nodes, request))
    exclude = (nodes[0].pk,) if request["exclude_first"] and nodes else ()
    expected, considered = node_by_node(pool, spec, exclude)
    explanation = placement.diagnose(pool, spec, exclude_node_ids=exclude)
    assert explanation["reasons"] == dict(expected)
    assert explanation["nodes_considered"] == considered
    assert sum(explanation["reasons"].values()) <= considered
    pending = sum(1 for d in descriptions if d["state"] in ("pending", "admitting"))
    assert explanation["pending_admission"] == pending


def _reads(queries) -> list[str]:
    """The statements that read data (not SAVEPOINT/RELEASE, nor the census' planner SET LOCAL)."""
    return [q["sql"] for q in queries if q["sql"].lstrip().upper().startswith("SELECT")]


def test_a_request_spread_over_hosts_is_explained_in_three_queries():
    """Anti-affinity over hosts is the common spread. The hosts that hold the group's leases are
    told apart in the grouped query; all other alike nodes form one group. (A request no node could
    ever hold also reads the pool's node templates, leases.impossible: one query more.)"""
    pool = PoolFactory()
    nodes = [make_schedulable_node(pool, labels={"zone": "a"}, resources={"cpu": 16000})[0] for _ in range(30)]
    NodeResource.objects.filter(node__pool=pool, name="cpu").update(allocated=8000)  # 8 of 16 free: 9 fits once freed
    for node in nodes[:10]:
        make_lease(node, f"w-{node.pk}", group="g", resources={"cpu": 0})
    spec = parse_spec(
        {"workload_id": "w", "pool": pool.name, "resources": {"cpu": "9"},
         "spread": {"group": "g", "topology_key": "host", "mode": "anti-affinity"}}
    )  # fmt: skip
    with CaptureQueriesContext(connection) as queries:
        explanation = placement.diagnose(pool, spec)
    assert len(_reads(queries.captured_queries)) <= 3, _reads(queries.captured_queries)
    assert explanation["reasons"] == {"anti_affinity_conflict": 10, "insufficient_cpu": 20}
    assert explanation["message"].startswith("0/30 nodes are available: 20 Insufficient cpu, 10 node(s) didn't")


def test_the_ready_condition_is_named_before_other_health_reasons():
    pool = PoolFactory()
    node, _ = make_schedulable_node(pool)
    conditions = [{"type": "MemoryPressure", "status": "True"}, {"type": "Ready", "status": "False"}]
    verdict, reasons = health.evaluate(conditions, unhealthy=["MemoryPressure"], degraded=[])
    Node.objects.filter(pk=node.pk).update(conditions=conditions, health=verdict, health_reasons=reasons)
    assert verdict == Health.UNHEALTHY
    spec = parse_spec({"workload_id": "w", "pool": pool.name, "resources": {"cpu": "1"}})
    assert placement.diagnose(pool, spec)["reasons"] == {"ready_condition_false": 1}


def test_a_node_short_of_two_resources_is_counted_once_under_the_first_by_name():
    pool = PoolFactory()
    make_schedulable_node(pool, resources={"cpu": 1000})  # no memory at all
    make_schedulable_node(pool, resources={"cpu": 8000})
    spec = parse_spec({"workload_id": "w", "pool": pool.name, "resources": {"cpu": "5", "memory": "2Gi"}})
    explanation = placement.diagnose(pool, spec)
    assert explanation["reasons"] == {"insufficient_cpu": 1, "insufficient_memory": 1}
    assert explanation["reasons"] == dict(node_by_node(pool, spec)[0])


def test_declared_labels_count_only_in_a_pool_that_trusts_them():
    for trusted, expected in ((True, {"insufficient_cpu": 1}), (False, {"node_selector_mismatch": 1})):
        pool = PoolFactory(trust_node_labels=trusted)
        node, _ = make_schedulable_node(pool, resources={"cpu": 1000})
        Node.objects.filter(pk=node.pk).update(node_labels={"declared": "yes"})
        body = {"workload_id": "w", "pool": pool.name, "resources": {"cpu": "5"}, "node_selector": {"declared": "yes"}}
        assert placement.diagnose(pool, parse_spec(body))["reasons"] == expected


@pytest.mark.parametrize("key", ["kubernetes.io/hostname", "nodepool.dev/node-id"])
def test_a_request_for_one_named_node_tells_that_node_apart_from_its_alike_peers(key):
    pool = PoolFactory()
    nodes = [make_schedulable_node(pool, resources={"cpu": 1000})[0] for _ in range(5)]
    named = nodes[3]
    value = named.hostname if key == "kubernetes.io/hostname" else str(named.pk)
    spec = parse_spec({"workload_id": "w", "pool": pool.name, "resources": {"cpu": "2"}, "node_selector": {key: value}})
    assert placement.diagnose(pool, spec)["reasons"] == {"insufficient_cpu": 1, "node_selector_mismatch": 4}


def test_nodes_that_differ_only_in_declared_labels_are_told_apart_in_a_trusting_pool():
    pool = PoolFactory(trust_node_labels=True)
    for declared in ("yes", "no", "no"):
        node, _ = make_schedulable_node(pool, resources={"cpu": 1000})
        Node.objects.filter(pk=node.pk).update(node_labels={"declared": declared})
    spec = parse_spec(
        {"workload_id": "w", "pool": pool.name, "resources": {"cpu": "2"}, "node_selector": {"declared": "yes"}}
    )
    assert placement.diagnose(pool, spec)["reasons"] == {"insufficient_cpu": 1, "node_selector_mismatch": 2}


def test_the_candidate_walk_stops_after_one_page_when_the_census_finds_no_fitting_node():
    """A constraint that excludes every node used to make the walk read the whole pool in Python
    (a minute at 100,000 nodes) before the 409; one full page without a feasible node now asks the
    set-based census, and the walk stops when it says nothing fits."""
    pool = PoolFactory()
    for _ in range(placement.FIRST_PAGE_SIZE + 8):
        make_schedulable_node(pool, labels={"zone": "a"})
    spec = parse_spec(
        {"workload_id": "w", "pool": pool.name, "resources": {"cpu": "1"}, "node_selector": {"zone": "b"}}
    )
    candidates, examined, explanation = placement.find_candidates(pool, spec)
    assert candidates == [] and examined == placement.FIRST_PAGE_SIZE
    assert explanation["reasons"] == {"node_selector_mismatch": placement.FIRST_PAGE_SIZE + 8}


def test_the_walk_goes_on_when_the_census_finds_a_fitting_node_beyond_the_first_page():
    pool = PoolFactory(scheduling_policy="binpack")
    for _ in range(placement.FIRST_PAGE_SIZE + 8):
        make_schedulable_node(pool, labels={"zone": "a"}, resources={"cpu": 2000})
    emptiest, _ = make_schedulable_node(pool, labels={"zone": "b"}, resources={"cpu": 8000})  # last in binpack order
    spec = parse_spec(
        {"workload_id": "w", "pool": pool.name, "resources": {"cpu": "1"}, "node_selector": {"zone": "b"}}
    )
    candidates, examined, explanation = placement.find_candidates(pool, spec)
    assert [c.node.pk for c in candidates] == [emptiest.pk] and examined == placement.FIRST_PAGE_SIZE + 9
    assert explanation is None


def test_a_409_runs_the_census_once_when_the_candidate_search_already_ran_it(client_user):
    """A full first page of candidates without one feasible node asks the census; the 409's
    explanation is that same census, not a second run of it."""
    from fleet.events import Actor
    from leases.services import lease_create
    from nodepool.api.problems import Conflict

    pool = PoolFactory(name="general")
    for _ in range(placement.FIRST_PAGE_SIZE + 3):
        make_schedulable_node(pool, labels={"zone": "a"})
    body = {"workload_id": "w", "pool": pool.name, "resources": {"cpu": "1"}, "node_selector": {"zone": "b"}}
    with CaptureQueriesContext(connection) as queries, pytest.raises(Conflict) as refused:
        lease_create(data=body, client=client_user, actor=Actor.system("test"))
    census = [sql for sql in _reads(queries.captured_queries) if '"representative"' in sql]
    assert len(census) == 1, census
    assert refused.value.extra["reasons"] == {"node_selector_mismatch": placement.FIRST_PAGE_SIZE + 3}


@pytest.mark.skipif(connection.vendor != "postgresql", reason="a PostgreSQL planner setting")
def test_the_census_hashes_its_groups_and_leaves_the_planner_settings_as_they_were():
    from django.db import transaction

    pool = PoolFactory()
    make_schedulable_node(pool)
    spec = parse_spec({"workload_id": "w", "pool": pool.name, "resources": {"cpu": "64"}})
    plans = []

    settings = []

    def explain(execute, sql, params, many, context):
        if '"representative"' in sql and not sql.startswith("EXPLAIN"):
            with connection.cursor() as cursor:
                cursor.execute("EXPLAIN " + sql, params)
                plans.append("\n".join(row[0] for row in cursor.fetchall()))
                cursor.execute("SHOW parallel_tuple_cost")
                settings.append(cursor.fetchone()[0])
        return execute(sql, params, many, context)

    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SHOW parallel_tuple_cost")
            before = cursor.fetchone()[0]
        with connection.execute_wrapper(explain):
            assert placement.diagnose(pool, spec)["reasons"] == {"insufficient_cpu": 1}
        with connection.cursor() as cursor:
            cursor.execute("SHOW enable_sort")
            assert cursor.fetchone()[0] == "on"
            cursor.execute("SHOW parallel_tuple_cost")
            assert cursor.fetchone()[0] == before
    assert len(plans) == 1 and "HashAggregate" in plans[0], plans
    assert settings == ["0.02"]  # parallel workers for the scans and joins of a large pool


def test_a_label_key_of_digits_is_told_apart_by_the_census_and_the_walk_goes_on():
    """``"7"`` is a valid label key, which Django's JSON key transforms read as an array index
    (``-> 7``): grouped by that, every node would look alike and the census would stop the walk
    with a false 409. The census groups such keys by the whole document instead."""
    pool = PoolFactory(scheduling_policy="binpack")
    for _ in range(placement.FIRST_PAGE_SIZE + 2):
        make_schedulable_node(pool, labels={"7": "a"}, resources={"cpu": 2000})
    wanted, _ = make_schedulable_node(pool, labels={"7": "b"}, resources={"cpu": 8000})  # last in binpack order
    spec = parse_spec({"workload_id": "w", "pool": pool.name, "resources": {"cpu": "1"}, "node_selector": {"7": "b"}})
    candidates, _, explanation = placement.find_candidates(pool, spec)
    assert [c.node.pk for c in candidates] == [wanted.pk] and explanation is None
    nowhere = parse_spec(
        {"workload_id": "w", "pool": pool.name, "resources": {"cpu": "1"}, "node_selector": {"7": "c"}}
    )
    assert placement.diagnose(pool, nowhere)["reasons"] == {"node_selector_mismatch": placement.FIRST_PAGE_SIZE + 3}
