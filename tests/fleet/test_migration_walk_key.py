"""fleet 0020: every existing resource row gets a random walk_key of its own, and migration 0010's
node_hard_tainted triggers still work afterwards (SQLite copies the table to add the column)."""

from __future__ import annotations

import uuid

import pytest

from tests.maintenance.test_migration_cordon_holds import migrate, migrate_to_latest

BEFORE = [("fleet", "0019_admission_check_benchmark_fsm")]
AFTER = [("fleet", "0020_noderesource_walk_key")]


@pytest.mark.django_db(transaction=True)
def test_existing_rows_draw_their_own_walk_key_and_the_taint_triggers_survive():
    try:
        old = migrate(BEFORE)
        Pool, Node, NodeResource = (old.get_model("fleet", name) for name in ("Pool", "Node", "NodeResource"))
        pool = Pool.objects.create(name="migrated")
        tainted = Node.objects.create(id=uuid.uuid4(), pool=pool, taints=[{"key": "gpu", "effect": "NoSchedule"}])
        plain = [Node.objects.create(id=uuid.uuid4(), pool=pool) for _ in range(30)]
        for node in [tainted, *plain]:
            for name in ("cpu", "memory"):
                NodeResource.objects.create(node=node, name=name, capacity=8, allocatable=8)

        new = migrate(AFTER)
        Node, NodeResource = new.get_model("fleet", "Node"), new.get_model("fleet", "NodeResource")

        keys = list(NodeResource.objects.values_list("walk_key", flat=True))
        assert len(keys) == 62 and all(0 <= key < 2**31 for key in keys)
        assert len(set(keys)) >= 55  # one draw per row, not the one default AddField wrote into all
        assert set(NodeResource.objects.filter(node_hard_tainted=True).values_list("node_id", flat=True)) == {
            tainted.pk
        }
        # The triggers after the migration: a taint written on a node, and a row inserted.
        Node.objects.filter(pk=plain[0].pk).update(taints=[{"key": "x", "effect": "NoExecute"}])
        NodeResource.objects.create(node_id=tainted.pk, name="disk", capacity=1, allocatable=1, walk_key=7)
        flagged = set(NodeResource.objects.filter(node_hard_tainted=True).values_list("node_id", "name"))
        assert flagged == {(tainted.pk, "cpu"), (tainted.pk, "memory"), (tainted.pk, "disk")} | {
            (plain[0].pk, "cpu"),
            (plain[0].pk, "memory"),
        }
    finally:
        migrate_to_latest()
