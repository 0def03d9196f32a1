"""maintenance 0003: quarantine events written before it keep only the public part of the evidence."""

from __future__ import annotations

import uuid

import pytest

from tests.maintenance.test_migration_cordon_holds import migrate, migrate_to_latest

BEFORE = [("maintenance", "0002_drain_holds"), ("fleet", "0009_fleet_state")]
AFTER = [("maintenance", "0003_scrub_private_evidence_from_events")]


@pytest.mark.django_db(transaction=True)
def test_private_evidence_is_removed_from_stored_quarantine_events_and_nothing_else_changes():
    try:
        old = migrate(BEFORE)
        Pool, Node, NodeEvent = (old.get_model("fleet", name) for name in ("Pool", "Node", "NodeEvent"))
        node = Node.objects.create(id=uuid.uuid4(), pool=Pool.objects.create(name="migrated"))
        evidence = {"hash": "abc", "private": {"informant": "x"}, "ip_log": ["10.0.0.9"], "private_keys": ["ip_log"]}
        leaky = NodeEvent.objects.create(node=node, type="quarantine", reason="r", actor_type="system",
                                         data={"rule": "manual", "evidence": evidence})  # fmt: skip
        clean = NodeEvent.objects.create(node=node, type="quarantine", reason="r", actor_type="system",
                                         data={"rule": "manual", "evidence": {"hash": "abc"}})  # fmt: skip
        other = NodeEvent.objects.create(node=node, type="lifecycle", reason="r", actor_type="system",
                                         data={"evidence": evidence})  # fmt: skip

        new = migrate(AFTER)
        NodeEvent = new.get_model("fleet", "NodeEvent")
        assert NodeEvent.objects.get(pk=leaky.pk).data == {"rule": "manual", "evidence": {"hash": "abc"}}
        assert NodeEvent.objects.get(pk=clean.pk).data == {"rule": "manual", "evidence": {"hash": "abc"}}
        assert NodeEvent.objects.get(pk=other.pk).data == {"evidence": evidence}  # not a quarantine event
    finally:
        migrate_to_latest()
