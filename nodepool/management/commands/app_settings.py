"""``manage.py app_settings``: print the table of every app's declared settings (nodepool.appsettings);
``--write`` replaces the generated table in docs/foundation.md; ``--check`` exits 1 if it differs."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from nodepool import appsettings

FOUNDATION = Path(settings.BASE_DIR) / "docs" / "foundation.md"


def documented_table(text: str) -> str | None:
    """The generated part of ``text`` (markers included), or None when it has none yet."""
    start, end = text.find(appsettings.TABLE_START), text.find(appsettings.TABLE_END)
    if start < 0 or end < start:
        return None
    return text[start : end + len(appsettings.TABLE_END)]


class Command(BaseCommand):
    help = "Print (or --write, or --check) the table of app settings in docs/foundation.md."

    def add_arguments(self, parser):
        parser.add_argument("--write", action="store_true", help="rewrite the table in docs/foundation.md")
        parser.add_argument("--check", action="store_true", help="exit 1 when docs/foundation.md is stale")

    def handle(self, *args, write=False, check=False, **options):
        table = appsettings.markdown_table()
        if not (write or check):
            self.stdout.write(table)
            return
        text = FOUNDATION.read_text()
        current = documented_table(text)
        if check:
            if current != table:
                raise CommandError("the app settings table in docs/foundation.md is stale: app_settings --write")
            return
        if current is None:
            raise CommandError(f"{FOUNDATION} has no app settings table markers")
        FOUNDATION.write_text(text.replace(current, table))
        self.stdout.write(f"wrote {sum(len(a.declared) for a in appsettings.every_app())} settings to {FOUNDATION}")
