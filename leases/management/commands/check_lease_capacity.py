"""``manage.py check_lease_capacity [--repair]``: allocated counters against live leases."""

import json

from django.core.management.base import BaseCommand

from fleet.events import Actor
from leases.sweeps import check_consistency


class Command(BaseCommand):
    help = "Compare NodeResource.allocated with the sum of live leases; report (and optionally repair) drift."

    def add_arguments(self, parser):
        parser.add_argument("--repair", action="store_true", help="set each drifted counter to the leases' sum")

    def handle(self, *args, repair=False, **options):
        report = check_consistency(repair=repair, actor=Actor.system("manage.py check_lease_capacity"))
        for item in report.drift:
            self.stdout.write(json.dumps(item))
        summary = f"{report.nodes_checked} node(s) checked, {len(report.drift)} drift(s)"
        if report.drift:
            self.stdout.write(self.style.WARNING(summary + (" repaired" if report.repaired else "")))
        else:
            self.stdout.write(self.style.SUCCESS(summary))
