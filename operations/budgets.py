"""The grammar of pool disruption budgets (``PoolOperations.disruption_budgets``), validated when
written: ``nodes`` (a count or a percentage), ``reasons``, a cron ``schedule`` with its
``duration`` and ``timezone``; durations as ``"8h"``, ``"1h30m"`` or seconds. Reading them (the
windows, the limits, the gate) is :mod:`operations.disruption`'s.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from nodepool.api.problems import Problem

from .choices import BUDGETED_REASONS
from .errors import INVALID_DISRUPTION_BUDGET

MAX_BUDGETS = 50
NODES = re.compile(r"^(\d{1,6})(%?)$")
DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
BUDGET_MEMBERS = ("nodes", "reasons", "schedule", "duration", "timezone")
# Blockers that hold every node of the pool alike: once one says no, the rest of a pass waits too.


# --- validation (when written) -------------------------------------------------------------------
def _bad(path: str, message: str) -> Problem:
    return Problem(
        f"{path}: {message}", INVALID_DISRUPTION_BUDGET, field=path, errors=[{"field": path, "message": message}]
    )


def parse_duration(value: Any, path: str = "duration") -> int:
    """``"1h30m"``, ``"45m"``, ``"90s"`` (Go's duration grammar, hours/minutes/seconds) or an
    integer of seconds → seconds (> 0). Raises 400 ``invalid_disruption_budget``."""
    if isinstance(value, int) and not isinstance(value, bool):
        seconds = value
    elif isinstance(value, str) and value and (match := DURATION.match(value.strip())) and any(match.groups()):
        hours, minutes, secs = (int(g or 0) for g in match.groups())
        seconds = hours * 3600 + minutes * 60 + secs
    else:
        raise _bad(path, 'must be a duration like "8h", "1h30m", "90s" or a number of seconds')
    if not 0 < seconds <= 366 * 86400:
        raise _bad(path, "must be more than 0 seconds and at most 366 days")
    return seconds


def format_duration(seconds: int) -> str:
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return "".join(f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if n) or "0s"


def shortest_period(schedule: str, tz: ZoneInfo) -> int:
    """The shortest gap in seconds between consecutive firings of ``schedule`` (sampled over its
    next 60 firings from a fixed date, so the answer does not depend on when it is written)."""
    it = croniter(schedule, datetime(2026, 1, 1, tzinfo=tz))
    previous = it.get_next(datetime)
    gaps = []
    for _ in range(60):
        current = it.get_next(datetime)
        gaps.append((current - previous).total_seconds())
        previous = current
    return int(min(gaps))


def parse_budget(value: Any, path: str) -> dict:
    """One budget → its stored shape ``{"nodes": "10%", "reasons": [...], "schedule", "duration",
    "timezone"}`` (absent members left out). Raises 400 naming ``path.<member>``."""
    if not isinstance(value, dict):
        raise _bad(path, "must be an object {nodes, reasons, schedule, duration, timezone}")
    unknown = sorted(set(value) - set(BUDGET_MEMBERS))
    if unknown:
        raise _bad(f"{path}.{unknown[0]}", "unknown member")
    if "nodes" not in value:
        raise _bad(f"{path}.nodes", "is required: a count or a percentage")
    nodes = value["nodes"]
    text = str(nodes).strip() if isinstance(nodes, int | str) and not isinstance(nodes, bool) else ""
    match = NODES.match(text)
    if not match or (match.group(2) and int(match.group(1)) > 100):
        raise _bad(f"{path}.nodes", 'must be a count of 0 or more ("2") or a percentage from 0 to 100 ("10%")')
    budget: dict = {"nodes": f"{int(match.group(1))}{match.group(2)}"}
    if "reasons" in value:
        reasons = value["reasons"]
        if not isinstance(reasons, list) or not reasons or not all(isinstance(r, str) for r in reasons):
            raise _bad(f"{path}.reasons", f"must be a non-empty list of {', '.join(BUDGETED_REASONS)}")
        for reason in reasons:
            if reason not in BUDGETED_REASONS:
                raise _bad(f"{path}.reasons", f"unknown reason {reason!r}: one of {', '.join(BUDGETED_REASONS)}")
        budget["reasons"] = sorted(set(reasons), key=BUDGETED_REASONS.index)
    schedule, duration = value.get("schedule"), value.get("duration")
    if (schedule is None) != (duration is None):
        missing = "duration" if duration is None else "schedule"
        raise _bad(f"{path}.{missing}", "schedule and duration go together (both or neither)")
    tz_name = value.get("timezone")
    if tz_name is not None and schedule is None:
        raise _bad(f"{path}.timezone", "only with a schedule")
    if schedule is not None:
        if not isinstance(schedule, str) or not croniter.is_valid(schedule) or len(schedule) > 100:
            raise _bad(f"{path}.schedule", 'must be a cron expression ("0 9 * * 1-5") or a macro ("@daily")')
        if tz_name is None:
            tz_name = "UTC"
        try:
            if not isinstance(tz_name, str) or not tz_name:
                raise ValueError
            tz = ZoneInfo(tz_name)
        except (ZoneInfoNotFoundError, ValueError):
            raise _bad(f"{path}.timezone", "must be an IANA time zone name (UTC, Europe/Berlin)") from None
        seconds = parse_duration(duration, f"{path}.duration")
        period = shortest_period(schedule, tz)
        if seconds > period:
            raise _bad(
                f"{path}.duration",
                f"{format_duration(seconds)} is longer than the schedule's period ({format_duration(period)})",
            )
        budget.update(schedule=schedule, duration=format_duration(seconds), timezone=tz_name)
    return budget


def parse_budgets(value: Any) -> list[dict]:
    """A PATCH's ``disruption_budgets`` → the stored list. An empty list means "no pool limit"
    for automation (then only upgrades' ``max_unavailable_nodes`` and workload budgets apply).
    Raises 400 ``invalid_disruption_budget`` naming ``disruption_budgets[i].<member>``."""
    if not isinstance(value, list) or len(value) > MAX_BUDGETS:
        raise _bad("disruption_budgets", f"must be a list of at most {MAX_BUDGETS} budgets")
    return [parse_budget(item, f"disruption_budgets[{i}]") for i, item in enumerate(value)]
