"""The Celery application. Configuration comes from Django settings (``CELERY_*``).

Periodic jobs are declared next to the code they run, as ``BEAT_SCHEDULE`` dicts in
``fleet/schedule.py``, ``leases/schedule.py`` and ``maintenance/schedule.py``::

    BEAT_SCHEDULE = {"fleet.sweep-liveness": {"task": "fleet.sweep_liveness", "schedule": 5.0,
                                              "options": {"expires": 4.0}}}

They are merged into ``app.conf.beat_schedule`` when the app is finalized (worker and beat both
finalize before they start); beat's scheduler (:mod:`nodepool.beat`) then stores them in the
database, where operators can edit them in the admin.
"""

from __future__ import annotations

import gc
import importlib
import logging.config
import os
from typing import Any

from celery import Celery, signals
from celery.signals import setup_logging
from django.conf import settings
from django_structlog.celery.steps import DjangoStructLogInitStep

from . import broker  # noqa: F401  (registers the embedded broker's transport)

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nodepool.settings")

app = Celery("nodepool")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
# Structured logs in the worker: the request context a task was sent with (its request_id) is
# bound while it runs (django-structlog reads it from the task's headers).
app.steps["worker"].add(DjangoStructLogInitStep)


@setup_logging.connect
def _structured_logging(**kwargs) -> None:
    """Worker and beat log through Django's LOGGING (nodepool.logs), not Celery's own format."""
    logging.config.dictConfig(settings.LOGGING)


SCHEDULE_MODULES = (
    "nodepool.schedule",
    "fleet.schedule",
    "leases.schedule",
    "maintenance.schedule",
    "marketplace.schedule",
    "operations.schedule",
)


def collect_beat_schedule(modules: tuple[str, ...] = SCHEDULE_MODULES) -> dict[str, dict[str, Any]]:
    """Merge the ``BEAT_SCHEDULE`` dicts of ``modules`` (each optional) into one schedule.

    ``options["expires"]`` given in seconds is also copied to ``options["expire_seconds"]``:
    django-celery-beat stores only ``expire_seconds`` and would silently drop ``expires``, and
    an entry without expiry piles up duplicate runs behind a stalled worker.

    Raises:
        ValueError: two modules declare the same entry name.
    """
    merged: dict[str, dict[str, Any]] = {}
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only the schedule module itself may be missing; a broken import inside it must fail loudly.
            if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
                raise
            continue
        for name, entry in getattr(module, "BEAT_SCHEDULE", {}).items():
            if name in merged:
                raise ValueError(f"beat entry {name!r} is declared twice (again in {module_name})")
            entry = dict(entry)
            options = dict(entry.get("options") or {})
            expires = options.get("expires")
            if isinstance(expires, int | float) and not isinstance(expires, bool):
                options.setdefault("expire_seconds", int(expires))
            entry["options"] = options
            merged[name] = entry
    return merged


@app.on_after_finalize.connect
def _install_beat_schedule(sender: Celery, **kwargs) -> None:
    # After finalize, Django is set up (so schedule modules may import app code), and both
    # `celery worker` and `celery beat` finalize before they start. Entries set in settings
    # (CELERY_BEAT_SCHEDULE) win over the modules' defaults.
    sender.conf.beat_schedule = {**collect_beat_schedule(), **(sender.conf.beat_schedule or {})}


@app.task(name="nodepool.ping")
def ping(value: str = "pong") -> str:
    """Round-trip probe used by /readyz-style checks and the worker tests."""
    return value


@app.task(name="nodepool.prune_expired_tokens", ignore_result=True)
def prune_expired_tokens() -> int:
    """Beat, hourly: delete user API tokens past their expiry's retention
    (nodepool.tokens.prune_expired_tokens) and failed-authentication counters of windows over a
    day old (nodepool.auth_failures.prune); returns how many rows."""
    # Imported when the task runs: this module loads with the nodepool package (nodepool/__init__),
    # before Django's app registry is ready, and these import models.
    from .auth_failures import prune as prune_counters
    from .tokens import prune_expired_tokens as prune  # (same reason)

    return prune() + prune_counters()


@signals.worker_ready.connect
def _freeze_startup_objects(**kwargs) -> None:
    # Everything loaded at start (Django, DRF, the apps) moves to the permanent GC generation:
    # the interpreter's final collection then skips it. Measured with the embedded broker on a
    # busy 2-core machine: the worker's exit after a warm shutdown spent 3-5 s "Garbage-collecting"
    # before this, enough to push `make run`'s stop past 10 s. Also the documented fork-friendly
    # setting for prefork pools (gc.freeze, Python 3.7+).
    gc.freeze()
