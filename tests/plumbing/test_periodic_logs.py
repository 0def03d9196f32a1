"""Task lines log at DEBUG, except a periodic task that changed something (nodepool.logs)."""

from __future__ import annotations

import logging

import pytest

from nodepool.logs import PeriodicTaskChatter, changed_something


@pytest.mark.parametrize(
    ("value", "changed"),
    [
        (0, False), (3, True), (True, False), (None, False), ("completed", False), ([], False), (["n1"], True),
        ({"gap_seconds": 5.1, "moved": {}, "lost": 0, "held": 2, "guards": {}}, False),
        ({"gap_seconds": 0.0, "moved": {"alive->stale": 2}, "lost": 0}, True),
        ({"evaluated": 4, "completed": 0, "forced": 0}, False),
        ({"placed": 0, "pending": 7}, False), ({"placed": 1, "pending": 0}, True),
    ],
)  # fmt: skip
def test_a_return_value_changed_something_only_when_it_counts_a_change(value, changed):
    assert changed_something(value) is changed


def record(logger: str, msg: str, args) -> logging.LogRecord:
    return logging.LogRecord(logger, logging.INFO, __file__, 1, msg, args, None)


def success(name: str, value: str) -> logging.LogRecord:
    trace = "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s"
    return record("celery.app.trace", trace, ({"name": name, "id": "x", "runtime": 0.1, "return_value": value},))


def test_routine_lines_of_periodic_tasks_are_dropped_from_an_info_log():
    chatter = PeriodicTaskChatter()
    assert not chatter.filter(
        record("celery.beat", "Scheduler: Sending due task %s (%s)", ("e", "fleet.sweep_liveness"))
    )
    received = "Task %(name)s[%(id)s] received"
    assert not chatter.filter(
        record("celery.worker.strategy", received, ({"name": "leases.expire_leases", "id": "x"},))
    )
    assert not chatter.filter(success("leases.expire_leases", "0"))
    assert not chatter.filter(success("fleet.sweep_liveness", "{'gap_seconds': 5.0, 'moved': {}, 'lost': 0}"))


def test_a_periodic_task_that_changed_something_and_other_tasks_keep_their_info_line():
    chatter = PeriodicTaskChatter()
    moved = success("fleet.sweep_liveness", "{'gap_seconds': 5.0, 'moved': {'alive->stale': 1}, 'lost': 0}")
    assert chatter.filter(moved) and moved.levelno == logging.INFO
    assert chatter.filter(success("leases.expire_leases", "2"))
    assert chatter.filter(success("leases.expire_leases", "{'truncated': ..."))  # unreadable: kept


def test_every_other_tasks_received_and_succeeded_lines_are_debug():
    chatter = PeriodicTaskChatter()
    assert not chatter.filter(success("fleet.run_admission", "'ready'"))
    received = record("celery.worker.strategy", "Task %(name)s[%(id)s] received", ({"name": "x.y", "id": "1"},))
    assert not chatter.filter(received)
    retry = record(
        "celery.app.trace", "Task %(name)s[%(id)s] retry: %(exc)s", ({"name": "x.y", "id": "1", "exc": "e"},)
    )
    assert chatter.filter(retry) and retry.levelno == logging.INFO


def test_periodic_lines_stay_visible_at_debug(caplog):
    logging.getLogger("celery.app.trace").setLevel(logging.DEBUG)
    try:
        quiet = success("leases.expire_leases", "0")
        assert PeriodicTaskChatter().filter(quiet)
        assert quiet.levelno == logging.DEBUG
    finally:
        logging.getLogger("celery.app.trace").setLevel(logging.NOTSET)
