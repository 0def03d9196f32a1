"""``manage.py state_machines``: print the state-machine graphs of every model with a django-fsm-2
``FSMField``, generated from the declared transitions (nodepool.fsm.mermaid); ``--write`` replaces
docs/state-machines.md; ``--check`` exits 1 when it differs (tests/project/test_state_machines.py)."""

from __future__ import annotations

from pathlib import Path

from django.apps import apps
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django_fsm import FSMFieldMixin

from nodepool import fsm

DOC = Path(settings.BASE_DIR) / "docs" / "state-machines.md"

HEADER = """# State machines

Generated from the declared django-fsm-2 transitions by `python manage.py state_machines --write`;
`tests/project/test_state_machines.py` fails when this page and the code disagree. Do not edit by
hand.

Each arrow is a transition method on the model (a verb). Set-based statements (sweeps, claims,
the grant) move many rows with `nodepool.fsm.move(queryset, "<method>")`, whose
`WHERE state IN (…)` and new state are read from the same declaration, so a statement cannot allow
a move the graph does not. `any` is django-fsm-2's `*` (from every state), `any_other` its `+`
(from every state but the target). Liveness, readiness and health are computed dimensions, and a
node's `workload_state` is reported by its agent: none of them is a state machine.
"""


def fsm_models() -> list:
    """Every installed concrete model with at least one ``FSMField``, by app label then model
    name (a proxy model shares its concrete model's graph and is not listed twice)."""
    found = [
        model
        for model in apps.get_models()
        if not model._meta.proxy and any(isinstance(f, FSMFieldMixin) for f in model._meta.get_fields())
    ]
    return sorted(found, key=lambda m: m._meta.label)


def render() -> str:
    """The whole page: header, then one section per app and model."""
    parts = [HEADER]
    app = None
    for model in fsm_models():
        if model._meta.app_label != app:
            app = model._meta.app_label
            parts.append(f"## {app}\n")
        parts.append(f"### {model.__name__}\n")
        parts.append(fsm.mermaid(model))
    return "\n".join(parts).rstrip() + "\n"


class Command(BaseCommand):
    help = "Print (or --write, or --check) docs/state-machines.md from the declared transitions."

    def add_arguments(self, parser):
        parser.add_argument("--write", action="store_true", help="rewrite docs/state-machines.md")
        parser.add_argument("--check", action="store_true", help="exit 1 when docs/state-machines.md is stale")

    def handle(self, *args, write=False, check=False, **options):
        page = render()
        if check:
            if not DOC.exists() or DOC.read_text() != page:
                raise CommandError("docs/state-machines.md is stale: python manage.py state_machines --write")
            return
        if write:
            DOC.write_text(page)
            self.stdout.write(f"wrote {len(fsm_models())} state machines to {DOC}")
            return
        self.stdout.write(page)
