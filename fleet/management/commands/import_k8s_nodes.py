"""``manage.py import_k8s_nodes FILE [FILE ...] --pool NAME``: Kubernetes nodes → pending nodes."""

from __future__ import annotations

import json
import sys

from django.core.management.base import BaseCommand, CommandError

from fleet.events import Actor
from fleet.k8s_import import ImportError_, import_nodes
from fleet.models import Pool


class Command(BaseCommand):
    help = (
        "Create pending nodes from `kubectl get nodes -o json|yaml` output (a Node, a NodeList or a List). "
        "Re-importing the same nodes (same metadata.uid) updates them in place. Reports what it could not map."
    )

    def add_arguments(self, parser):
        parser.add_argument("files", nargs="+", metavar="FILE", help="kubectl output; '-' reads standard input")
        parser.add_argument("--pool", required=True, help="the pool the nodes join")
        parser.add_argument("--dry-run", action="store_true", help="map and report, change nothing")
        parser.add_argument("--json", action="store_true", help="print the report as JSON")

    def handle(self, *args, files, pool, dry_run, json: bool, **options):
        try:
            target = Pool.objects.get(name=pool)
        except Pool.DoesNotExist:
            raise CommandError(f"no pool named {pool!r}") from None
        actor = Actor.system("import_k8s_nodes")
        reports = {}
        for path in files:
            try:
                text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()  # noqa: SIM115
            except OSError as exc:
                raise CommandError(f"{path}: {exc}") from exc
            try:
                reports[path] = import_nodes(text=text, pool=target, actor=actor, dry_run=dry_run, source=path)
            except ImportError_ as exc:
                raise CommandError(f"{path}: {exc}") from exc
        if json:
            self.stdout.write(_json({path: vars(report) for path, report in reports.items()}))
            return
        for path, report in reports.items():
            self._print(path, report, dry_run)

    def _print(self, path, report, dry_run):
        prefix = "[dry run] " if dry_run else ""
        self.stdout.write(self.style.MIGRATE_HEADING(f"{prefix}{path}"))
        for outcome in ("created", "updated", "unchanged"):
            for name in getattr(report, outcome):
                node_id = report.node_ids.get(name, "")
                self.stdout.write(f"  {outcome:9} {name} {node_id}".rstrip())
        for reason in report.skipped:
            self.stdout.write(self.style.WARNING(f"  skipped   {reason}"))
        for note in report.notes:
            self.stdout.write(self.style.WARNING(f"  note      {note}"))
        if report.unmapped:
            self.stdout.write("  could not map:")
            for name, items in report.unmapped.items():
                for item in items:
                    self.stdout.write(f"    {name}: {item}")
        self.stdout.write(
            self.style.SUCCESS(
                f"  {len(report.created)} created, {len(report.updated)} updated, "
                f"{len(report.unchanged)} unchanged, {len(report.skipped)} skipped"
            )
        )


def _json(data) -> str:
    return json.dumps(data, indent=2, sort_keys=True)
