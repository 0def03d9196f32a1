"""Beat's scheduler: django-celery-beat's DatabaseScheduler, with the database as the authority.

The stock scheduler writes every code-declared entry (``BEAT_SCHEDULE``) over its database row
each time beat starts, so an interval or an "enabled" switch an operator changed in the admin
silently reverts at the next deploy. Here code only *seeds* the database: a missing entry is
created from code, an existing row is left as the operator left it (delete the row in the admin
to get the code's default back at the next beat start).
"""

from __future__ import annotations

import logging

from django_celery_beat.models import PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler as _DatabaseScheduler

logger = logging.getLogger(__name__)


class DatabaseScheduler(_DatabaseScheduler):
    def update_from_dict(self, mapping):
        existing = set(PeriodicTask.objects.filter(name__in=list(mapping)).values_list("name", flat=True))
        seeds = {name: fields for name, fields in mapping.items() if name not in existing}
        if seeds:
            logger.info("beat: seeding %d schedule entries from code: %s", len(seeds), ", ".join(sorted(seeds)))
        # Rows that already exist are read from the database by the scheduler's normal sync.
        super().update_from_dict(seeds)
