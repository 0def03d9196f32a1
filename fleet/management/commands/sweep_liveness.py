"""``manage.py sweep_liveness``: run one liveness sweep now and print what it did (JSON)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand

from fleet.events import Actor
from fleet.liveness_sweep import sweep_liveness


class Command(BaseCommand):
    help = "Run one liveness sweep (alive → stale → unreachable → lost) and print a JSON summary."

    def handle(self, *args, **options):
        summary = sweep_liveness(actor=Actor.system("manage.py sweep_liveness"))
        self.stdout.write(json.dumps(summary, default=str))
