"""The one race helper: threads released together, each on its own database connection, with an
optional hold that keeps the race window open inside the critical section.

Why the hold: two threads released by a barrier rarely overlap inside a few milliseconds of
critical section, so a test could pass with its lock removed (one such test caught a removed
``FOR UPDATE`` only 1 time in 2). :class:`Hold` wraps a function the product calls *inside* the
section (after the lock is taken, before the write that depends on what was read) and makes
each thread that reaches it wait there until every racer has arrived, or ``timeout`` passes.

* With the lock, only one thread can be inside; it waits ``timeout`` for the others (who are
  blocked on the lock), then goes on. ``hold.max_inside == 1``.
* Without it, every thread arrives, so they all read the same state before any of them writes:
  the lost update or the oversubscription happens on every run, not by luck.

Use with ``@pytest.mark.django_db(transaction=True)`` (each thread has its own connection, so
the data must be committed) and ``@pytest.mark.race`` (CI checks that those ran on PostgreSQL,
where ``select_for_update`` takes row locks; on SQLite the project's ``BEGIN IMMEDIATE``
serialises every writing transaction, so a missing row lock cannot show there)::

    @pytest.mark.race
    @pytest.mark.django_db(transaction=True)
    def test_two_grants_never_share_the_last_cpu(client_user):
        with Hold("leases.grant._hold_schedulable_node", parties=2) as hold:
            outcome = race(lambda i: grant_status(client_user, f"job-{i}"), 2)
        assert sorted(outcome.results) == [201, 409]
        assert hold.max_inside == 1
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from django.db import connection, connections


@dataclass
class RaceResult:
    """What each racer returned (by racer index) and the exceptions any of them raised."""

    results: list[Any]
    errors: list[BaseException] = field(default_factory=list)

    def count(self, value: Any) -> int:
        return self.results.count(value)


def race(target: Callable[[int], Any], count: int, *, timeout: float = 60.0) -> RaceResult:
    """Run ``target(i)`` for ``i`` in ``range(count)`` in as many threads, released at once.

    Each thread uses its own database connections (Django's are per thread) and closes them
    when done. Exceptions are collected, not raised, so that the test can say which outcome
    it expected; a racer still running after ``timeout`` seconds fails the test.

    Returns a :class:`RaceResult` (``results[i]`` is racer ``i``'s return value, or ``None``
    when it raised).
    """
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def racer(index: int) -> None:
        try:
            barrier.wait(timeout)
            results[index] = target(index)
        except BaseException as exc:  # collected for the test's assertion message
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=racer, args=(i,), name=f"racer-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"racers still running after {timeout}s: {stuck}"
    return RaceResult(results, errors)


def _resolve(where: str) -> tuple[Any, str]:
    module_name, _, attribute = where.replace(":", ".").rpartition(".")
    return importlib.import_module(module_name), attribute


class Hold:
    """Keep the race window open inside a critical section (see the module docstring).

    Args:
        where: dotted name of a function the product calls inside the section, patched where it
            is looked up (``"leases.grant._hold_schedulable_node"``).
        parties: how many racers to wait for at that point (usually the race's ``count``).
        timeout: seconds a racer waits there for the others; with the lock in place, this is
            what each serialised racer costs, so keep it short.
        after: hold after the function returns (default: its reads and locks are done) or,
            with ``False``, before it is called.
        when: ``callable(*args, **kwargs) -> bool``: hold only the calls it accepts (say, only
            the locking calls of a function that also serves unlocked reads).

    Attributes after use: ``arrivals`` (how many times a racer reached the point) and
    ``max_inside`` (the most racers inside the window at once: 1 proves the section serialised).
    ``arrived`` is an Event set when the first racer reaches the point: a competing action (say an
    operator's quarantine racing grants) can wait on it to start while a racer is inside.
    """

    def __init__(self, where: str, *, parties: int, timeout: float = 0.5, after: bool = True, when=None):
        self.where, self.parties, self.timeout, self.after, self.when = where, parties, timeout, after, when
        self.arrivals = 0
        self.inside = 0
        self.max_inside = 0
        self._cond = threading.Condition()
        self._patch = None
        self.arrived = threading.Event()

    def wait_here(self) -> None:
        """Count this racer in, and wait until all parties are in or ``timeout`` passes."""
        with self._cond:
            self.arrivals += 1
            self.inside += 1
            self.max_inside = max(self.max_inside, self.inside)
            self.arrived.set()
            self._cond.notify_all()
            deadline = time.monotonic() + self.timeout
            while self.arrivals < self.parties:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            self.inside -= 1

    def __enter__(self) -> Hold:
        module, attribute = _resolve(self.where)
        original = getattr(module, attribute)

        @functools.wraps(original)
        def held(*args, **kwargs):
            if self.when is not None and not self.when(*args, **kwargs):
                return original(*args, **kwargs)
            if not self.after:
                self.wait_here()
                return original(*args, **kwargs)
            value = original(*args, **kwargs)
            self.wait_here()
            return value

        self._patch = mock.patch.object(module, attribute, held)
        self._patch.start()
        return self

    def __exit__(self, *exc) -> None:
        self._patch.stop()


# --- waiting on a row lock (PostgreSQL) ------------------------------------------------------------
# For lock-order tests: a transaction holds a row, a thread's writer waits for it, and a third
# connection probes with NOWAIT which rows the waiting writer already holds.


def in_thread(target: Callable[[], Any], errors: list) -> threading.Thread:
    """Start ``target`` in a daemon thread on its own database connection; an exception it raises
    is appended to ``errors`` (for the test's assertion message)."""

    def run():
        try:
            target()
        except BaseException as exc:  # shown by the test's assertion
            errors.append(exc)
            raise
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def waiting_on_locks() -> int:
    """How many backends of this database wait for a lock now (PostgreSQL's pg_stat_activity)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")  # else one snapshot per transaction
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]


def wait_until_waiting_on_locks(seconds: float = 20.0) -> bool:
    """Poll :func:`waiting_on_locks` until some backend waits, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not waiting_on_locks() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(waiting_on_locks())
