"""Quiet routine traffic: periodic work, and the fleet's liveness renewals.

**Task lines.** Beat's "Sending due task" and the worker's "received" and "succeeded" lines go to
DEBUG, for every task (issue 33: they were 80 % of ``make run``'s output), except the "succeeded"
line of a periodic task whose return value says it changed something. Retries, failures and
errors keep their levels.

Left alone, ``make run`` logs about eight INFO lines every 5 s (beat's "Sending due task", the
worker's "received" and "succeeded" for each sweep), which buries the lines that matter. This
filter, attached in settings.LOGGING to Celery's ``celery.beat``, ``celery.worker.strategy`` and
``celery.app.trace`` loggers, rewrites those INFO records of periodic tasks (the tasks named in
the beat schedule) to DEBUG, except a "succeeded" line whose return value says that something
changed (see :func:`changed_something`). Warnings and errors pass untouched.

**Renewals.** A fleet of 20,000 nodes renews about 1,000 times a second: one request log line
each would be most of the log and a real share of the renewal's cost, and a flooding node's
refusals (429) would be a line each too. :class:`RoutineMachineTraffic` moves the request log
line of an applied renewal (200) and of any 429 to DEBUG; their counts are in
``nodepool_heartbeats_total{kind,outcome}``. Every other answer (401, 403, 410, ordering codes,
errors) and every status report keep their line. Kubernetes' API server does not log node Lease
renewals either, at its default verbosity.
"""

from __future__ import annotations

import ast
import logging
import re
from functools import cache

# Keys of sweep summaries that count or measure without being a change.
NOT_CHANGES = frozenset({"pending", "held", "evaluated", "gap_seconds", "nodes_checked", "recovering"})


@cache
def periodic_task_names() -> frozenset[str]:
    # On first use: settings.LOGGING names this module's filters, and nodepool.celery reads the
    # settings at import (Celery's config_from_object), so a head import would be a cycle.
    from nodepool.celery import collect_beat_schedule

    return frozenset(entry["task"] for entry in collect_beat_schedule().values())


def changed_something(value) -> bool:
    """Whether a periodic task's return value reports a change: a positive count (not a bool),
    a non-empty list (of ids), or a dict holding either under a key not in :data:`NOT_CHANGES`.
    Floats are measurements; strings are states. ``{"moved": {}, "lost": 0}`` → False."""
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, int):
        return value > 0
    if isinstance(value, list | tuple):
        return len(value) > 0
    if isinstance(value, dict):
        return any(changed_something(v) for k, v in value.items() if k not in NOT_CHANGES)
    return False


class PeriodicTaskChatter(logging.Filter):
    """See the module docstring. Records become DEBUG (kept only if the logger shows DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        name, result = self._task_of(record)
        if name is None or _outcome(record) not in ("received", "succeeded", "due"):
            return True
        if name in periodic_task_names() and result is not _NO_RESULT and changed_something(_parsed(result)):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)

    @staticmethod
    def _task_of(record: logging.LogRecord):
        args = record.args
        if isinstance(args, dict):  # the worker: "Task %(name)s[%(id)s] received/succeeded…"
            return args.get("name"), args.get("return_value", _NO_RESULT)
        if isinstance(args, tuple) and len(args) == 2 and "due task" in str(record.msg):
            return args[1], _NO_RESULT  # beat: "Scheduler: Sending due task %s (%s)"
        return None, _NO_RESULT


def _outcome(record: logging.LogRecord) -> str:
    """``received``, ``succeeded`` or ``due`` (beat) from Celery's message, else ``""``."""
    text = str(record.msg)
    if "due task" in text:
        return "due"
    for word in ("received", "succeeded"):
        if word in text:
            return word
    return ""


_NO_RESULT = object()
_UNREADABLE = [object()]  # counts as a change: when in doubt, keep the line


def _parsed(text):
    """Celery logs the return value as its repr (possibly truncated): read it back, safely."""
    if not isinstance(text, str):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return _UNREADABLE


_RENEWAL = re.compile(r"^POST /api/v1/nodes/[^/]+/renewals$")


class RoutineMachineTraffic(logging.Filter):
    """See the module docstring: for ``django_structlog``'s request logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        event = record.msg
        if not isinstance(event, dict) or event.get("event") != "request_finished":
            return True
        code = event.get("code")
        if code == 429 or (code == 200 and _RENEWAL.match(str(event.get("request", "")))):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True
