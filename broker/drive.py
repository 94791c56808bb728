"""Reading a request's output, the same way for every transport.

A ``Run`` (``broker.run``) hands out a request's output items under its deadline
guard; ``close`` ends it once. Every transport reads a run in one of three shapes, and
each shape is written here once, so that they cannot drift apart:

- ``unary``: the whole output before answering (chat and completions as JSON, the
  Responses API's JSON). It looks every ``UNARY_TICK_S`` whether its client is still
  there, and closes the run as disconnected when not.
- ``opening`` + ``reads``: a stream (SSE, the WebSocket). ``opening`` reads until the
  request shows how it starts and raises the request's error if it fails before any
  output, so the client gets the real HTTP status, not a 200 with an error event;
  ``reads`` then yields what each wait brought, or None for a keep-alive tick.
- ``follow``: to the end with nobody to answer but a callback (a background response,
  the WebSocket's messages).
- ``drain``: what is there now, without waiting, for a reader of many runs at once (the
  batch driver's lines).

A transport is a framer over these: it turns events into its frames and holds no loop
of its own. Who closes the run stays with the caller (each transport closes it once,
knowing whether its client left); these functions close it only where the shape
itself decides (a unary client gone).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from app.errors import KeyRevoked
from app.messages import OutputEvent, OutputKind
from broker.run import Item, Run

# How often a non-streaming request looks whether its client is still there.
UNARY_TICK_S = 0.25
# Most events a stream writes at once (one write per read, not one per event): what a
# read brings may be a replay's whole buffer, and framed (a token with 20 logprobs is
# ~1.5 KB of SSE) and decoded at once, 1 MiB of it held 18 MB per client that did not
# read. The rest stays encoded in its buffer until the next write.
WRITE_EVENTS = 256


class HandedOver(Exception):
    """This process hands its streams over (its drain time is up, ``Runner.closing``):
    the stream ends here without its final event, for the client to resume it on
    another process (SSE ``Last-Event-ID``, the WebSocket's ``resume``)."""


class Pump(Protocol):
    """Something that writes a flowing stream from the hub's thread while the request's
    thread waits (``web.sse_pump.SsePump``)."""

    wrote: bool

    def start(self) -> bool: ...

    def settle(self) -> None: ...


def unary(
    run: Run,
    feed: Callable[[OutputEvent], object],
    done: Callable[[], bool],
    client_gone: Callable[[], bool],
    *,
    tick_s: float = UNARY_TICK_S,
) -> bool:
    """Feed every event to ``feed`` until ``done()`` or the run ended; False when the
    client went away first (the run is then closed as disconnected)."""
    next_look = time.monotonic() + tick_s
    while not done():
        item = run.next(tick_s)
        if item is not None:
            feed(item[1])
        elif run.ended:
            break
        if time.monotonic() >= next_look:
            next_look = time.monotonic() + tick_s
            if client_gone():
                run.close(disconnected=True)
                return False
    return True


def opening(run: Run, wait_s: float) -> list[Item]:
    """Items up to the first one that shows how the request starts.

    Raises the request's error if it fails before any output (a request-level error,
    or every choice failed); returns what it read after ``wait_s`` without output
    (the stream then starts and keeps the client waiting).
    """
    seen: list[Item] = []
    while True:
        item = run.next(wait_s)
        if item is None:
            return seen
        if run.failure is not None:
            raise run.failure
        seen.append(item)
        ev = item[1]
        if ev.kind is OutputKind.DELTA and not (ev.text or ev.logprobs):
            continue
        if ev.kind is OutputKind.FINAL and ev.choice in run.choice_errors:
            continue  # one choice failed; the others may still start
        return seen


def reads(
    run: Run, keepalive_s: float, first: list[Item] | None = None, pump: Pump | None = None
) -> Iterator[list[Item] | None]:
    """What a stream writes, read by read: ``first`` (what ``opening`` read), then the
    item each wait brought and every one already behind it (one write per read, not
    one per event), or None for a keep-alive tick, until the run ended. With a pump,
    each wait lets the hub write what flows meanwhile (``pump.settle`` raises what
    went wrong there). Raises ``HandedOver`` when the process hands its streams over,
    ``KeyRevoked`` when the request's API key was revoked meanwhile.
    """
    if first:
        yield first
    while not run.ended:
        if run.runner.closing.is_set():
            if run.trace is not None:
                run.trace.event("handed_over")
            raise HandedOver(run.request_id)
        if run.runner.key_revoked(run.record.owner):
            raise KeyRevoked()
        pumping = pump is not None and pump.start()
        item = run.next(keepalive_s)
        if pumping:
            assert pump is not None
            pump.settle()
            if item is None and pump.wrote:
                continue  # it flowed through the pump: no keep-alive is due
        if item is None and run.ended:
            break  # it ended without an item for this reader (resumed after the end)
        yield None if item is None else [item, *run.poll(WRITE_EVENTS - 1)]


def follow(
    run: Run,
    feed: Callable[[Item], bool],
    done: Callable[[], bool],
    *,
    stopped: Callable[[], bool] = lambda: False,
    tick_s: float = 1.0,
) -> bool:
    """Feed every item (cursor, event) until ``done()``, the run ended, ``stopped()`` or
    ``feed`` returned False (its receiver is gone); whether it got to ``done()``."""
    while not done() and not stopped():
        if run.runner.key_revoked(run.record.owner):
            raise KeyRevoked()
        item = run.next(tick_s)
        if item is None:
            if run.ended:
                break
            continue
        if not feed(item):
            return False
    return done()


def drain(run: Run, feed: Callable[[OutputEvent], object]) -> bool:
    """Feed every event available now, without waiting; whether there was any."""
    items = run.poll()
    for _, ev in items:
        feed(ev)
    return bool(items)
