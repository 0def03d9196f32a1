"""NodeResource.node_hard_tainted: the database triggers of fleet migration 0010 keep it equal to
"the node has a NoSchedule or NoExecute taint" (what leases.placement.constraint_failure refuses
without a toleration) through every way a node's taints or a resource row are written; the
candidate search of a request without tolerations relies on it to skip tainted nodes in SQL."""

from __future__ import annotations

import random
import threading
import uuid

import pytest
from django.db import connection, transaction

from fleet.models import Node, NodeResource
from leases import placement
from leases.spec import PlacementSpec, parse_spec
from tests.factories import PoolFactory, make_schedulable_node
from tests.races import race

pytestmark = pytest.mark.django_db

NO_SCHEDULE = {"key": "gpu", "value": "true", "effect": "NoSchedule"}
NO_EXECUTE = {"key": "broken", "effect": "NoExecute"}
PREFER_NO = {"key": "spot", "effect": "PreferNoSchedule"}


def python_says(taints) -> bool:
    """The rule as placement applies it (placement.node_taints + HARD_TAINT_EFFECTS)."""
    return any(isinstance(t, dict) and t.get("effect") in placement.HARD_TAINT_EFFECTS for t in taints or [])


def flags(node) -> set[bool]:
    return set(NodeResource.objects.filter(node=node).values_list("node_hard_tainted", flat=True))


@pytest.fixture
def node():
    node, _ = make_schedulable_node(PoolFactory(), resources={"cpu": 4000, "memory": 2**30})
    return node


def test_the_triggers_exist_after_every_migration():
    """SQLite drops a table's triggers when a migration remakes the table (AlterField and the like):
    a later migration of fleet_node or fleet_noderesource must create them again."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal AND tgname LIKE 'fleet_%%hard_tainted%%'"
            )
        else:
            cursor.execute("SELECT name FROM sqlite_master WHERE type = 'trigger' AND name LIKE 'fleet_%hard_tainted%'")
        names = {row[0] for row in cursor.fetchall()}
    expected = {
        "postgresql": {"fleet_node_hard_tainted", "fleet_noderesource_hard_tainted"},
        "sqlite": {
            "fleet_node_hard_tainted",
            "fleet_noderesource_hard_tainted_insert",
            "fleet_noderesource_hard_tainted_update",
        },
    }[connection.vendor]
    assert names == expected


@pytest.mark.parametrize(
    "taints",
    [[], [PREFER_NO], [NO_SCHEDULE], [NO_EXECUTE], [PREFER_NO, NO_EXECUTE], ["NoSchedule"], [{"effect": "noschedule"}]],
)
def test_a_node_saved_with_taints_flags_its_resources_as_placement_does(node, taints):
    node.taints = taints
    node.save()
    assert flags(node) == {python_says(taints)}


def test_every_write_of_taints_or_of_a_resource_row_keeps_the_flag(node):
    Node.objects.filter(pk=node.pk).update(taints=[NO_SCHEDULE])  # a queryset update
    assert flags(node) == {True}
    NodeResource.objects.create(node=node, name="example.com/fpga", capacity=1, allocatable=1)  # a new row
    NodeResource.objects.bulk_create([NodeResource(node=node, name="disk", capacity=10, allocatable=10)])
    assert flags(node) == {True}
    node.refresh_from_db()
    node.taints = [PREFER_NO]
    node.save(update_fields=["taints"])
    assert flags(node) == {False}
    # A row saved with a wrong value in memory, or a raw write of the flag, is put right.
    row = NodeResource.objects.get(node=node, name="cpu")
    row.node_hard_tainted, row.capacity = True, 5000
    row.save()
    NodeResource.objects.filter(node=node, name="memory").update(node_hard_tainted=True)
    assert flags(node) == {False}
    # A write that leaves the taints as they were, and a capacity write, change nothing.
    Node.objects.filter(pk=node.pk).update(taints=[PREFER_NO])
    NodeResource.objects.filter(node=node).update(allocated=100)
    assert flags(node) == {False}


def test_random_taint_lists_agree_with_the_python_rule(node):
    rng = random.Random(20261201)
    pieces = [NO_SCHEDULE, NO_EXECUTE, PREFER_NO, {"key": "k"}, {"effect": None}, "x", 7, None, [NO_SCHEDULE]]
    for _ in range(60):
        taints = rng.sample(pieces, rng.randrange(0, 4))
        Node.objects.filter(pk=node.pk).update(taints=taints)
        assert flags(node) == {python_says(taints)}, taints


def test_the_candidate_search_skips_tainted_nodes_only_without_a_toleration():
    pool = PoolFactory()
    plain, _ = make_schedulable_node(pool, hostname="plain", resources={"cpu": 8000})
    tainted, _ = make_schedulable_node(pool, hostname="tainted", resources={"cpu": 1000}, taints=[NO_SCHEDULE])
    spec = PlacementSpec(workload_id="w", pool=pool.name, resources={"cpu": 100})
    assert [row[0] for row in placement.candidate_query(pool, spec)] == [plain.pk]
    tolerating = parse_spec(
        {
            "workload_id": "w",
            "pool": pool.name,
            "resources": {"cpu": "100m"},
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
        }  # fmt: skip
    )
    assert [row[0] for row in placement.candidate_query(pool, tolerating)] == [tainted.pk, plain.pk]  # binpack
    Node.objects.filter(pk=tainted.pk).update(taints=[])
    assert [row[0] for row in placement.candidate_query(pool, spec)] == [tainted.pk, plain.pk]


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="SQLite runs one writer at a time")
@pytest.mark.parametrize("before, after", [([NO_SCHEDULE], []), ([], [NO_EXECUTE])])
def test_a_resource_row_written_while_the_nodes_taints_change_gets_the_committed_value(node, before, after):
    """The resource row's trigger reads the node row FOR SHARE: it waits for a transaction changing
    the taints and reads what that one committed. Without the lock it read the old taints, and a
    node whose NoSchedule taint was just removed kept a row flagged tainted: invisible to every
    request without tolerations."""
    Node.objects.filter(pk=node.pk).update(taints=before)
    changed = threading.Event()

    def racer(index: int):
        if index == 0:
            with transaction.atomic():
                Node.objects.filter(pk=node.pk).update(taints=after)
                changed.set()
                threading.Event().wait(0.5)  # the resource write starts while this is uncommitted
        else:
            assert changed.wait(10)
            NodeResource.objects.create(node_id=node.pk, name="example.com/fpga", capacity=1, allocatable=1)

    outcome = race(racer, 2)
    assert not outcome.errors, outcome.errors
    assert flags(node) == {python_says(after)}


@pytest.mark.django_db(transaction=True)
def test_the_migration_fills_the_flag_of_existing_rows_and_its_reverse_drops_the_triggers():
    from tests.maintenance.test_migration_cordon_holds import migrate, migrate_to_latest

    try:
        old = migrate([("fleet", "0009_fleet_state")])
        Pool, Node, NodeResource_ = (old.get_model("fleet", name) for name in ("Pool", "Node", "NodeResource"))
        pool = Pool.objects.create(name="before-0010")
        nodes = {}
        for name, taints in (("tainted", [NO_SCHEDULE]), ("preferred", [PREFER_NO]), ("bare", [])):
            nodes[name] = Node.objects.create(id=uuid.uuid4(), pool=pool, hostname=name, taints=taints)
            NodeResource_.objects.create(node=nodes[name], name="cpu", capacity=1000, allocatable=1000)
        # Without the triggers (reversed), a taint change leaves the rows alone; the migration's fill
        # then puts them right.
        Node.objects.filter(pk=nodes["bare"].pk).update(taints=[NO_EXECUTE])
        migrate([("fleet", "0010_noderesource_node_hard_tainted")])
        got = dict(
            NodeResource.objects.filter(node__pool__name="before-0010").values_list(
                "node__hostname", "node_hard_tainted"
            )
        )
        assert got == {"tainted": True, "preferred": False, "bare": True}
    finally:
        migrate_to_latest()
