"""fleet 0003 + maintenance 0002: the lifecycle state ``cordoned`` becomes a hold owned by whoever cordoned."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

BEFORE = [("fleet", "0002_general_events"), ("maintenance", "0001_initial")]
AFTER = [("fleet", "0003_node_holds"), ("maintenance", "0002_drain_holds")]


def migrate(targets):
    """Migrate to ``targets`` and return the apps of that state.

    Backwards, one migration at a time, each with a fresh executor. Django computes the state
    "before" each migration it unapplies by walking the whole forward plan, and that walk is one
    linear order of a branched graph: unapplying everything back to fleet 0002 in one call gives
    0003_pool_ready_objective_and_request_classes a "before" state that still holds
    0005_status_reports_and_renewals's ``Pool.status_report_interval`` (earlier in that order,
    already unapplied by then). On PostgreSQL that state is harmless (its reverse AddConstraint is a
    DROP CONSTRAINT); SQLite rebuilds fleet_pool from it, so the column came back while the
    migration was recorded unapplied, and the forward migration then failed on it (duplicate
    column), leaving the database on the old schema. Unapplied alone, a migration's state is built
    from the migrations still applied, which is what the database holds.
    """
    while True:
        executor = MigrationExecutor(connection)
        plan = executor.migration_plan(targets)
        if not plan:
            break
        backwards = plan[0][1]
        executor.migrate(targets, plan=plan[:1] if backwards else plan)
        if not backwards:
            break
    return MigrationExecutor(connection).loader.project_state(targets).apps


def schema_differences(apps, app_labels=("fleet", "maintenance")) -> dict:
    """{table: (columns the models lack, columns the table lacks)} for the models of ``apps``."""
    differences = {}
    with connection.cursor() as cursor:
        for model in apps.get_models():
            if model._meta.app_label not in app_labels or not model._meta.managed:
                continue
            table = model._meta.db_table
            present = {column.name for column in connection.introspection.get_table_description(cursor, table)}
            expected = {field.column for field in model._meta.local_concrete_fields}
            if present != expected:
                differences[table] = (sorted(present - expected), sorted(expected - present))
    return differences


def migrate_to_latest():
    """Every app at its latest migration, as the rest of the suite expects."""
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.mark.django_db(transaction=True)
def test_each_cordoned_node_becomes_ready_with_one_hold_owned_by_whoever_cordoned_it():
    try:
        old = migrate(BEFORE)
        assert schema_differences(old) == {}
        Pool, Node, NodeEvent = (old.get_model("fleet", name) for name in ("Pool", "Node", "NodeEvent"))
        Drain = old.get_model("maintenance", "Drain")
        User = old.get_model("auth", "User")
        olivia = User.objects.create(username="olivia")
        pool = Pool.objects.create(name="migrated")
        by_olivia = Node.objects.create(id=uuid.uuid4(), pool=pool, lifecycle="cordoned", lifecycle_reason="bios")
        NodeEvent.objects.create(
            node=by_olivia, type="lifecycle", from_state="ready", to_state="cordoned", actor_type="user",
            actor_user=olivia, actor_name="olivia", reason="bios",
        )  # fmt: skip
        unknown = Node.objects.create(id=uuid.uuid4(), pool=pool, lifecycle="cordoned", lifecycle_reason="legacy")
        ready = Node.objects.create(id=uuid.uuid4(), pool=pool, lifecycle="ready")
        draining = Node.objects.create(id=uuid.uuid4(), pool=pool, lifecycle="draining")
        drain = Drain.objects.create(
            id=uuid.uuid4(), node=draining, reason="rack", deadline=timezone.now(), requested_by_name="olivia"
        )

        new = migrate(AFTER)
        Node, NodeHold = new.get_model("fleet", "Node"), new.get_model("fleet", "NodeHold")
        migrated = Node.objects.get(pk=by_olivia.pk)
        assert (migrated.lifecycle, migrated.cordoned, migrated.version) == ("ready", True, 2)
        hold = NodeHold.objects.get(node_id=by_olivia.pk)
        assert (hold.owner, hold.reason, hold.created_by_id, hold.removed_at) == (
            "user:olivia",
            "bios",
            olivia.pk,
            None,
        )
        assert NodeHold.objects.get(node_id=unknown.pk).owner == "system:migration"
        assert Node.objects.get(pk=unknown.pk).lifecycle == "ready"
        assert (Node.objects.get(pk=ready.pk).cordoned, NodeHold.objects.filter(node_id=ready.pk).exists()) == (
            False,
            False,
        )
        assert NodeHold.objects.get(node_id=draining.pk).owner == f"drain:{drain.pk}"
        assert not Node.objects.filter(lifecycle="cordoned").exists()
    finally:
        # Whatever happened above: every app at its latest migration, as the rest of the suite expects.
        migrate_to_latest()
    assert schema_differences(MigrationExecutor(connection).loader.project_state().apps) == {}
