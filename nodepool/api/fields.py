"""Serializer fields shared by every app's API.

One rule for timestamps: every time the API accepts needs an explicit UTC offset or ``Z``
(RFC 3339 ``date-time``). A time without one is answered ``400 timezone_required`` and changes
nothing, everywhere — a deadline is never silently taken as UTC (DRF's default with ``USE_TZ``).
"""

from __future__ import annotations

from datetime import datetime

from django.utils.dateparse import parse_datetime
from rest_framework import serializers

from nodepool.api.errors import INVALID_DATETIME, TIMEZONE_REQUIRED

from .problems import Problem


def timezone_required(field: str) -> Problem:
    """The 400 for a time without a UTC offset (``field`` names the member)."""
    return Problem(
        f"{field} must be an RFC 3339 time with a UTC offset or Z, e.g. 2026-11-29T18:00:00Z.",
        TIMEZONE_REQUIRED,
        errors=[{"field": field, "code": TIMEZONE_REQUIRED, "message": "a UTC offset or Z is required"}],
    )


def parse_aware_datetime(value, field: str, *, code: str = INVALID_DATETIME) -> datetime:
    """An RFC 3339 time from request data (views that read a body without a serializer).

    Args:
        value: the member as sent (a string of at most 64 characters to be a time).
        field: the member's name, for the answer.
        code: the problem code of a missing or malformed time (the endpoint's documented one).

    Raises:
        Problem: 400 ``timezone_required`` (a time without an offset), 400 ``code`` (missing, not
            a string, malformed, or a date that does not exist such as month 13).
    """
    parsed = None
    if isinstance(value, str) and len(value) <= 64:
        try:
            parsed = parse_datetime(value.strip())
        except ValueError:  # well formed but impossible (2026-13-01)
            parsed = None
    if parsed is not None and parsed.tzinfo is None:
        raise timezone_required(field)
    if parsed is None:
        raise Problem(
            f"{field}: an RFC 3339 time with a UTC offset or Z, e.g. 2026-12-01T00:00:00Z.", code, field=field
        )
    return parsed


class AwareDateTimeField(serializers.DateTimeField):
    """A ``DateTimeField`` that refuses a time without an offset (400 ``timezone_required``).

    Raises the problem directly (not a field error) so the answer's ``code`` is the same stable
    ``timezone_required`` on every endpoint; malformed times stay ordinary validation errors.
    """

    def to_internal_value(self, value):
        if isinstance(value, datetime):
            naive = value.tzinfo is None
        elif isinstance(value, str):
            try:
                parsed = parse_datetime(value.strip())
            except ValueError:
                parsed = None
            naive = parsed is not None and parsed.tzinfo is None
        else:
            naive = False
        if naive:
            raise timezone_required(self.field_name or "time")
        return super().to_internal_value(value)
