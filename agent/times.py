"""The agent's wall-clock times on the wire: RFC 3339 in UTC (``...Z``) to and from epoch seconds.

Its own module so that the runner and the modules it drives (preemption) share one reader without
importing each other."""

from __future__ import annotations

from datetime import UTC, datetime


def rfc3339(ts: float) -> str:
    """Epoch seconds as ``2026-12-02T14:00:00.5Z``."""
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def parse_time(value: str | None) -> float | None:
    """An RFC 3339 time (``Z`` or an offset) as epoch seconds; None for empty or unreadable text."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
