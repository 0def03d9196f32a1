# Node.device_fingerprint (fleet.device_counts.fingerprint_of), filled in for the nodes that have
# devices already; sync_counts keeps it from then on. On SQLite, AddField of a NOT NULL column
# copies fleet_node into a new table, which the node_hard_tainted triggers of migration 0010 name:
# they are dropped before and made again after (as in 0020).

import importlib

from django.db import migrations, models

WALK_KEY = importlib.import_module("fleet.migrations.0020_noderesource_walk_key")


def fill_in(apps, schema_editor):
    from fleet.device_counts import refresh_fingerprints

    refresh_fingerprints(device_model=apps.get_model("fleet", "Device"), node_model=apps.get_model("fleet", "Node"))


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0021_drop_duplicate_indexes"),
    ]

    operations = [
        migrations.RunPython(WALK_KEY.sqlite_triggers(create=False), WALK_KEY.sqlite_triggers(create=True)),
        migrations.AddField(
            model_name="node",
            name="device_fingerprint",
            field=models.CharField(blank=True, default="", editable=False, max_length=64),
        ),
        migrations.RunPython(WALK_KEY.sqlite_triggers(create=True), WALK_KEY.sqlite_triggers(create=False)),
        migrations.RunPython(fill_in, migrations.RunPython.noop, elidable=True),
    ]
