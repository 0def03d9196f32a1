"""Times on nodepoolctl's command line: RFC 3339 with an offset (the API refuses one without), and
a drain's deadline as a duration (``2h``) or a time (split from nodepoolctl/cli.py, issue 28 step 8)."""

from __future__ import annotations

import re
from datetime import datetime

import click

DURATION = re.compile(r"^(\d+)([smhd])$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def rfc3339(value: str) -> str:
    """``value`` if it is an RFC 3339 time with a UTC offset or ``Z`` (the API refuses a time
    without one: 400 timezone_required), else a usage error (exit 2) saying what is expected."""
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an RFC 3339 time such as 2026-12-01T06:00:00Z") from None
    if moment.tzinfo is None:
        raise click.BadParameter(f"{value!r} has no UTC offset: add Z or +HH:MM (2026-12-01T06:00:00Z)")
    return value.strip()


def time_option(ctx, param, value: str | None) -> str | None:
    return None if value is None else rfc3339(value)


def parse_deadline(value: str) -> dict:
    """``2h`` / ``90m`` / ``45s`` / ``1d`` → ``{"deadline_in": seconds}``; RFC 3339 → ``{"deadline": value}``."""
    if match := DURATION.match(value.strip()):
        return {"deadline_in": int(match.group(1)) * UNITS[match.group(2)]}
    try:
        return {"deadline": rfc3339(value)}
    except click.BadParameter as exc:
        raise click.BadParameter(
            f"a duration (30m, 2h, 1d) or an RFC 3339 time with an offset: {exc.message}"
        ) from None


def deadline_option(ctx, param, value: str) -> dict:
    return parse_deadline(value)
