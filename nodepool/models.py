"""Models of the plumbing app: only what the metrics need to keep series true to the objects."""

from __future__ import annotations

from django.db import models


class MetricBaseline(models.Model):
    """The per-process series of an object-valued label at the moment its object was deleted
    (nodepool.metrics.forget_object): when an object of the same name is created later, its
    series start from zero by subtracting these values at scrape time.

    ``samples`` maps ``"<sample name>|<label>=<value>,..."`` (labels sorted) to the value summed
    over every process when the object was deleted.
    """

    label = models.CharField(max_length=64)
    value = models.CharField(max_length=200)
    taken_at = models.DateTimeField()
    samples = models.JSONField(default=dict)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["label", "value"], name="metric_baseline_unique_object")]

    def __str__(self) -> str:
        return f"{self.label}={self.value} at {self.taken_at:%Y-%m-%d %H:%M:%S}"


class AuthFailureCount(models.Model):
    """Refused authentications in one fixed window (nodepool.auth_failures): per client address
    (scope ``address``: user tokens and node credentials) or per account (scope ``login``: failed
    password logins across addresses). Kept in the database, not the cache, so the limits hold
    while Redis is down; rows of past windows are pruned hourly.

    ``window`` is the window's number: ``floor(unix seconds / window length)``.
    """

    scope = models.CharField(max_length=16)
    key = models.CharField(max_length=200)
    window = models.BigIntegerField()
    count = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "key", "window"], name="auth_failure_count_unique_window")
        ]

    def __str__(self) -> str:
        return f"{self.scope} {self.key} window {self.window}: {self.count}"
