"""Keeps a worker's leases alive while one engine step runs longer than a lease.

The engine thread refreshes each request's lease when it publishes, after every step. A
step that outlasts the lease (a long prompt's prefill, a machine so loaded that a step
takes seconds) let the lease expire: the streamer then declared the worker lost and the
request was resumed elsewhere as a new attempt, redoing its prefill, while this worker
was fenced on its next publish and threw its work away. Under overload that turned into
more work for everybody (measured with ``benchmarks/peer.py`` at load 15: every request
restarted, some up to three times).

This thread refreshes the leases of the requests the engine thread holds (running, or
claimed and waiting in its inbox for the step to end), on a timer
of a third of the lease, but only while the engine is inside a step that has not run
for longer than ``max_step_s``: a wedged engine, or a dead engine thread, stops the
refresh and the leases expire, so the requests still resume on another worker. Between
steps the engine thread's own publish refreshes them. A worker process that dies takes
this thread with it, and its leases expire as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import redis

from broker.requests import RequestStore
from workers.backoff import Backoff

logger = logging.getLogger(__name__)

#: A step running longer than this many leases is taken for a wedged engine.
MAX_STEP_LEASES = 12


class LeaseHolder(Protocol):
    """What the keeper reads from the engine thread (both without locks: one attribute
    read, and a copy of a dict taken in one call)."""

    @property
    def step_started(self) -> float | None: ...

    def held_leases(self) -> list[tuple[str, str]]: ...

    def is_alive(self) -> bool: ...


class LeaseKeeper(threading.Thread):
    """Refreshes the holder's leases during long steps; see the module docstring."""

    def __init__(
        self,
        holder: LeaseHolder,
        store: RequestStore,
        *,
        lease_ttl_s: float,
        max_step_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="lease-keeper", daemon=True)
        self.holder = holder
        self.store = store
        self.lease_ttl_s = lease_ttl_s
        self.max_step_s = lease_ttl_s * MAX_STEP_LEASES if max_step_s is None else max_step_s
        self.clock = clock
        self.refreshed = 0  # leases refreshed so far (tests, logs)
        self._stop_event = threading.Event()
        self._outage = Backoff(initial_s=lease_ttl_s / 3, max_s=lease_ttl_s / 3)

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        while not self._stop_event.wait(self.lease_ttl_s / 3):
            if not self.holder.is_alive():
                return
            try:
                self.keep()
            except redis.RedisError as exc:
                if self._outage.failed(time.monotonic()):
                    logger.warning("lease refresh failed (%s); retrying", exc)
            except Exception:  # a bug here must not end the refreshes
                logger.exception("lease refresh failed")
            else:
                self._outage.recovered()

    def keep(self) -> int:
        """One round: refresh the leases if a step is running and not wedged."""
        started = self.holder.step_started
        if started is None:
            return 0  # between steps: the engine thread's publish refreshes them
        running = self.clock() - started
        if running < self.lease_ttl_s / 3 or running > self.max_step_s:
            return 0  # a short step needs nothing; a wedged one must let them expire
        leases = self.holder.held_leases()
        n = self.store.refresh_leases(leases, self.lease_ttl_s)
        self.refreshed += n
        if n:
            logger.debug("step running for %.1f s: refreshed %d leases", running, n)
        return n
