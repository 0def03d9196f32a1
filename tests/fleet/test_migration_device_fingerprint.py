"""fleet 0022: every existing node with live devices gets its device fingerprint (the one
sync_counts would write), alike nodes the same one, nodes without devices none; and migration
0010's node_hard_tainted triggers still work afterwards (SQLite copies fleet_node to add the column)."""

from __future__ import annotations

import uuid

import pytest
from django.utils import timezone

from tests.maintenance.test_migration_cordon_holds import migrate, migrate_to_latest

BEFORE = [("fleet", "0021_drop_duplicate_indexes")]
AFTER = [("fleet", "0022_node_device_fingerprint")]


@pytest.mark.django_db(transaction=True)
def test_existing_nodes_get_their_devices_fingerprint_and_the_taint_triggers_survive():
    try:
        old = migrate(BEFORE)
        Pool, Node, NodeResource, Device = (
            old.get_model("fleet", n) for n in ("Pool", "Node", "NodeResource", "Device")
        )
        pool = Pool.objects.create(name="migrated")
        alike = [Node.objects.create(id=uuid.uuid4(), pool=pool) for _ in range(3)]
        other, bare = Node.objects.create(id=uuid.uuid4(), pool=pool), Node.objects.create(id=uuid.uuid4(), pool=pool)
        now = timezone.now()
        for n, node in enumerate([*alike, other]):
            for i in range(4):
                Device.objects.create(
                    node=node, device_id=f"GPU-{n}-{i}", type="nvidia.com/gpu", index=i, model="NVIDIA H100",
                    memory_bytes=80 * 2**30 if node != other else 40 * 2**30, first_seen_at=now, last_seen_at=now,
                    verified_at=now, health="healthy",
                )  # fmt: skip
        Device.objects.create(node=other, device_id="GPU-gone", type="nvidia.com/gpu", index=9, first_seen_at=now,
                              last_seen_at=now, retired_at=now)  # fmt: skip
        NodeResource.objects.create(node=bare, name="cpu", capacity=8, allocatable=8)

        new = migrate(AFTER)
        Node, NodeResource = new.get_model("fleet", "Node"), new.get_model("fleet", "NodeResource")
        stored = dict(Node.objects.values_list("pk", "device_fingerprint"))
        assert len({stored[n.pk] for n in alike}) == 1 and len(stored[alike[0].pk]) == 64
        assert stored[other.pk] not in ("", stored[alike[0].pk])
        assert stored[bare.pk] == ""
        # What sync_counts writes from then on is the same text (fleet.device_counts.fingerprint_of).
        from fleet.device_counts import FINGERPRINT_COLUMNS, fingerprint_of

        Device = new.get_model("fleet", "Device")
        rows = Device.objects.filter(node_id=other.pk, retired_at__isnull=True).values(
            *FINGERPRINT_COLUMNS, "verified_at"
        )
        assert fingerprint_of(list(rows)) == stored[other.pk]
        # The triggers after the migration: a taint written on a node flags its resource rows.
        Node.objects.filter(pk=bare.pk).update(taints=[{"key": "x", "effect": "NoExecute"}])
        assert set(NodeResource.objects.filter(node_hard_tainted=True).values_list("node_id", flat=True)) == {bare.pk}
    finally:
        migrate_to_latest()
