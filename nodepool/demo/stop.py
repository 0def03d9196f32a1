"""The demo's stop signals: SIGINT and SIGTERM stop it as Ctrl-C does, by KeyboardInterrupt in
the main thread, in every phase.

Python drops an exception raised while it runs a weakref callback or a ``__del__`` (it prints
"Exception ignored in …" and goes on), and a signal's handler runs wherever the main thread is, so
a KeyboardInterrupt can be lost: seen in CI, where the demo printed the dropped interrupt and went
on with its story for minutes after a SIGTERM. :func:`interrupt` therefore also sends the signal
again a second later, and every second after, until the interrupt has been taken
(:func:`interrupt_taken`, called where it is caught) or the handler is no longer this one (the
runner's cleanup ignores stop signals). Light on purpose: ``manage.py demo`` installs it before it
loads the runner.
"""

from __future__ import annotations

import os
import signal
import threading

AGAIN_AFTER_SECONDS = 1.0
_taken = threading.Event()


def install() -> None:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt in the main thread (:func:`interrupt`)."""
    _taken.clear()
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, interrupt)


def interrupt(number: int, frame) -> None:
    """The handler: KeyboardInterrupt, and the same signal again in a second unless it was taken."""
    if _taken.is_set():
        return  # stopping already: a second signal must not cut the cleanup short
    again = threading.Timer(AGAIN_AFTER_SECONDS, _again, (number,))
    again.daemon = True
    again.start()
    raise KeyboardInterrupt


def interrupt_taken() -> None:
    """Say that a KeyboardInterrupt was caught and the demo is stopping: no more re-sends."""
    _taken.set()


def _again(number: int) -> None:
    if not _taken.is_set() and signal.getsignal(number) is interrupt:
        os.kill(os.getpid(), number)
