"""Give every drain that still keeps its node out of service its own hold (owner ``drain:<id>``).

Since fleet 0003 a cordon is a hold, and a drain places one when it starts (maintenance.drains):
an active drain, and the latest finished drain of a node parked in ``maintenance``, get the hold
they would have placed, so that cancelling the drain or returning the node to service removes it
the same way for drains started before and after this migration.
"""

from django.db import migrations, models
from django.utils import timezone


def drains_to_holds(apps, schema_editor):
    Drain = apps.get_model("maintenance", "Drain")
    Node = apps.get_model("fleet", "Node")
    NodeHold = apps.get_model("fleet", "NodeHold")
    now = timezone.now()
    drains = list(Drain.objects.filter(state="active", node__lifecycle="draining"))
    for node in Node.objects.filter(lifecycle="maintenance").order_by("pk").iterator():
        latest = Drain.objects.filter(node_id=node.pk, state__in=["completed", "forced"]).order_by("-created_at")
        if latest.exists():
            drains.append(latest.first())
    for drain in drains:
        owner = f"drain:{drain.pk}"
        if NodeHold.objects.filter(node_id=drain.node_id, owner=owner, removed_at__isnull=True).exists():
            continue
        NodeHold.objects.create(
            node_id=drain.node_id,
            owner=owner,
            reason=f"drain: {drain.reason}",
            created_at=drain.created_at or now,
            created_by_id=drain.requested_by_id,
            created_by_name=drain.requested_by_name,
        )
        Node.objects.filter(pk=drain.node_id).update(cordoned=True)


class Migration(migrations.Migration):
    dependencies = [
        ("maintenance", "0001_initial"),
        ("fleet", "0003_node_holds"),
    ]

    operations = [
        migrations.RunPython(drains_to_holds, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="drain",
            name="state",
            field=models.CharField(
                choices=[
                    ("active", "active"),
                    ("completed", "completed (every lease ended and unreported)"),
                    ("forced", "completed as forced at the deadline"),
                    ("cancelled", "cancelled (node back to ready, the drain's hold removed)"),
                    ("aborted", "aborted (node quarantined or retired)"),
                ],
                default="active",
                max_length=16,
            ),
        ),
    ]
