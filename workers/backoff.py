"""Retry pacing for loops whose dependency (Redis) can go away.

A loop that fails a round trip asks ``failed(now)`` and waits until ``ready(now)``:
the pause doubles from ``initial_s`` up to ``max_s``, so an outage costs a few
attempts per second at most, never a spin. ``failed`` answers True only for the first
failure of an outage and ``recovered`` only for the first success after one, so a loop
logs one line when Redis goes away and one when it is back.
"""

from __future__ import annotations


class Backoff:
    """Exponential backoff with outage bookkeeping (times are the caller's clock)."""

    def __init__(self, *, initial_s: float = 0.1, max_s: float = 2.0, factor: float = 2.0):
        self.initial_s = initial_s
        self.max_s = max_s
        self.factor = factor
        self.failures = 0
        self.delay_s = 0.0
        self.since: float | None = None  # when the current outage began
        self._retry_at = float("-inf")

    @property
    def failing(self) -> bool:
        return self.failures > 0

    def ready(self, now: float) -> bool:
        """Whether the next attempt may run now."""
        return now >= self._retry_at

    def failed(self, now: float) -> bool:
        """Record a failure at ``now``; True when it starts an outage (log it)."""
        first = self.failures == 0
        if first:
            self.since = now
        self.delay_s = min(self.initial_s * self.factor ** min(self.failures, 32), self.max_s)
        self.failures += 1
        self._retry_at = now + self.delay_s
        return first

    def recovered(self) -> bool:
        """Record a success; True when it ends an outage (log it)."""
        was_failing = self.failures > 0
        self.failures = 0
        self.delay_s = 0.0
        self.since = None
        self._retry_at = float("-inf")
        return was_failing
