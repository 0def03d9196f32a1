"""nodepool.demo.stop: a stop signal's KeyboardInterrupt that Python dropped (raised inside a
weakref callback or a ``__del__``) comes again until it is taken."""

from __future__ import annotations

import contextlib
import signal
import time

import pytest

from nodepool.demo import stop


@pytest.fixture
def handlers():
    saved = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    yield
    stop.interrupt_taken()
    for number, handler in saved.items():
        signal.signal(number, handler)


def test_a_dropped_interrupt_is_sent_again_until_it_is_taken(handlers):
    stop.install()
    with contextlib.suppress(KeyboardInterrupt):
        stop.interrupt(signal.SIGTERM, None)  # raised where Python drops it
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        time.sleep(5)  # the same signal, sent again
    assert time.monotonic() - started < 3
    stop.interrupt_taken()
    time.sleep(2 * stop.AGAIN_AFTER_SECONDS + 0.5)  # taken: nothing comes again


def test_once_taken_a_second_signal_does_not_interrupt_the_cleanup(handlers):
    stop.install()
    stop.interrupt_taken()
    stop.interrupt(signal.SIGINT, None)  # returns: no KeyboardInterrupt
