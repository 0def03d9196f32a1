"""Retry delays: exponential backoff with a cap and jitter, and jittered periodic intervals.

The "equal jitter" variant from Marc Brooker's "Exponential Backoff And Jitter" (AWS
Architecture Blog, 2015): half of the exponential delay is kept and the other half drawn at
random, so delays still grow while a fleet that lost its control plane at the same moment
does not come back in lockstep.
"""

from __future__ import annotations

import random


class Backoff:
    """Delays for consecutive failures: ``min(cap, base * factor**n)`` with equal jitter.

    Args:
        base: first delay in seconds.
        cap: the largest delay in seconds.
        factor: growth per consecutive failure.
        rng: a ``random.Random`` (tests pass a seeded one).
    """

    def __init__(self, *, base: float = 1.0, cap: float = 300.0, factor: float = 2.0, rng: random.Random | None = None):
        if base <= 0 or cap < base or factor < 1:
            raise ValueError("backoff needs 0 < base <= cap and factor >= 1")
        self.base, self.cap, self.factor = base, cap, factor
        self.failures = 0
        self.rng = rng or random.Random()

    def ceiling(self) -> float:
        """The un-jittered delay for the current failure count."""
        return min(self.cap, self.base * self.factor ** max(0, self.failures - 1))

    def next_delay(self) -> float:
        """Record one more failure and return how long to wait (seconds, ``<= cap``)."""
        self.failures += 1
        ceiling = self.ceiling()
        return ceiling / 2 + self.rng.uniform(0, ceiling / 2)

    def reset(self) -> None:
        """A success: the next failure starts again from ``base``."""
        self.failures = 0


def jittered(interval: float, *, fraction: float = 0.1, rng: random.Random | None = None) -> float:
    """``interval`` ± ``fraction`` at random, so that a fleet's heartbeats spread out over time."""
    rng = rng or random
    return max(0.0, interval * (1 + rng.uniform(-fraction, fraction)))
