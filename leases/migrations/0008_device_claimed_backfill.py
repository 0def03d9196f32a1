"""Set fleet.Device.claimed for the devices live leases hold (or whose MIG instances they hold)."""

from django.db import migrations
from django.db.models import Exists, OuterRef, Q


def backfill(apps, schema_editor):
    Device = apps.get_model("fleet", "Device")
    LeaseDevice = apps.get_model("leases", "LeaseDevice")
    held = LeaseDevice.objects.filter(live=True)
    Device.objects.filter(
        Q(Exists(held.filter(device_id=OuterRef("pk"))))
        | Q(
            Exists(
                held.filter(device__node_id=OuterRef("node_id"), device__parent_device_id=OuterRef("device_id"))
            )
        )
    ).update(claimed=True)


class Migration(migrations.Migration):
    dependencies = [
        ("leases", "0007_evidence_devices"),
        ("fleet", "0018_device_claimed"),
    ]

    operations = [migrations.RunPython(backfill, migrations.RunPython.noop)]
