"""Quarantine events written before this release carried the whole evidence, operator-only notes
included; the event stream is read by the node's owner. Keep only the public part in the events
(the full evidence stays on each Quarantine row)."""

from django.db import migrations

PRIVATE_KEYS = ("private", "private_keys")


def scrub(apps, schema_editor):
    NodeEvent = apps.get_model("fleet", "NodeEvent")
    for event in NodeEvent.objects.filter(type="quarantine").iterator(chunk_size=500):
        evidence = (event.data or {}).get("evidence")
        if not isinstance(evidence, dict):
            continue
        listed = evidence.get("private_keys")
        hidden = {str(name) for name in listed} if isinstance(listed, list) else set()
        hidden.update(PRIVATE_KEYS)
        public = {key: value for key, value in evidence.items() if key not in hidden}
        if public != evidence:
            event.data = {**event.data, "evidence": public}
            event.save(update_fields=["data"])


class Migration(migrations.Migration):
    dependencies = [
        ("maintenance", "0002_drain_holds"),
        ("fleet", "0009_fleet_state"),
    ]

    operations = [migrations.RunPython(scrub, migrations.RunPython.noop)]
