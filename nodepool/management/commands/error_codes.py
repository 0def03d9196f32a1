"""``manage.py error_codes``: print the table of declared problem codes (nodepool.api.errors);
``--write`` replaces the generated table in docs/api-contract.md; ``--check`` exits 1 if it differs."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from nodepool.api import errors

CONTRACT = Path(settings.BASE_DIR) / "docs" / "api-contract.md"


def documented_table(text: str) -> str:
    """The generated part of ``text`` (from the start marker to the end marker, both included)."""
    start, end = text.find(errors.TABLE_START), text.find(errors.TABLE_END)
    if start < 0 or end < start:
        raise CommandError(f"{CONTRACT} has no error-code table markers")
    return text[start : end + len(errors.TABLE_END)]


class Command(BaseCommand):
    help = "Print (or --write, or --check) the table of problem codes in docs/api-contract.md."

    def add_arguments(self, parser):
        parser.add_argument("--write", action="store_true", help="rewrite the table in docs/api-contract.md")
        parser.add_argument("--check", action="store_true", help="exit 1 when docs/api-contract.md is stale")

    def handle(self, *args, write=False, check=False, **options):
        table = errors.markdown_table()
        if not (write or check):
            self.stdout.write(table)
            return
        text = CONTRACT.read_text()
        current = documented_table(text)
        if check:
            if current != table:
                raise CommandError("the table of problem codes in docs/api-contract.md is stale: error_codes --write")
            return
        CONTRACT.write_text(text.replace(current, table))
        self.stdout.write(f"wrote {len(errors.registered())} codes to {CONTRACT}")
