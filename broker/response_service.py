"""The Responses API as a service beside ``Runner``: create, chain, store, follow, cancel.

Its transports (``web.responses_api`` over HTTP, the WebSocket's ``response`` message)
only parse, call and frame; everything a response is beyond one generation lives here:

- ``start`` settles ``previous_response_id`` from the stored responses, then submits
  through the one request path (``Runner.start`` with ``Endpoint.RESPONSES``: the
  body is prepared by ``app.intake`` like every other API), and stores the response
  when asked. A background response is followed to its end by a daemon thread of this
  process (counted as a follower, so it is never cancelled for want of a client).
- ``feed`` is how every framer turns a run's output into typed events: it writes the
  final object once, when the events end (``ResponseFeed``). ``ResponseStore.settle``
  does the same for a response whose process died (``broker.responses``).
- ``view`` is a run over a stored response's output from its start, for a replay;
  ``cancel``, ``delete`` and ``input_items`` act on stored responses, each visible only
  to the key that made it (another key gets 404).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from app.errors import InvalidRequest, NotFound
from app.intake import Endpoint
from app.messages import OutputEvent
from app.responses_api import (
    ResponseSkeleton,
    ResponsesRequest,
    dumps,
    parse_responses_request,
    response_id_of,
    with_ids,
)
from app.responses_events import Event, ResponseEvents
from broker import drive
from broker.responses import ResponseStore, StoredResponse
from broker.run import Item, Run
from broker.runner import Runner

logger = logging.getLogger(__name__)

ROUTE = "/v1/responses"
# How long a cancel waits for the stream's own end (partial output and usage) before
# it marks the response cancelled itself.
CANCEL_SETTLE_S = 2.0


class Caller(Protocol):
    """Who acts (``web.auth.Tenant``): the owner stamped on what it creates, and the owner
    it may see (None: every owner's)."""

    @property
    def owner(self) -> str: ...

    @property
    def scope(self) -> str | None: ...


class BackgroundView(Run):
    """A client streaming a background response: it follows the output but owns nothing.

    The generation belongs to the background follower (or, once that process is gone,
    to nobody: it runs to its end), so a client that stalls, times out or leaves never
    cancels it; leaving only stops following. Once the end was read, the admission slot
    is released (idempotent), in case the follower's process died."""

    def _stalled(self) -> None:
        logger.info("a client of background request %s stopped reading", self.request_id)

    def close(
        self,
        *,
        disconnected: bool = False,
        resumable: bool = False,
        error: BaseException | None = None,
    ) -> None:
        if self.ended and not self.ended_here:
            try:
                self.runner.store.release(self.request_id)
            except redis.RedisError as exc:
                logger.warning("could not release request %s: %s", self.request_id, exc)
        self.detach()


class ResponseFeed:
    """A response's typed events from its run's output; the final object is stored once,
    when the events end (``store`` None: not stored here)."""

    def __init__(self, stored: StoredResponse, store: ResponseStore | None) -> None:
        self._events = ResponseEvents(stored.base, stored.request_id, queued=stored.background)
        self._stored = stored
        self._store = store
        self._finished = False

    @property
    def done(self) -> bool:
        return self._events.done

    @property
    def response(self) -> dict[str, Any]:
        return self._events.response

    def opening(self) -> list[Event]:
        return self._events.opening()

    def feed(self, ev: OutputEvent) -> list[Event]:
        out = self._events.feed(ev)
        if self._events.done and not self._finished:
            self._finished = True
            if self._store is not None:
                self._store.finish(self._stored, self._events.response)
        return out


@dataclass(frozen=True, slots=True)
class StartedResponse:
    """A response whose generation was admitted and submitted.

    ``run`` is what the caller frames (None for a background response nobody watches:
    the background thread owns the generation); ``feed`` turns its output into events
    and stores the final object when this caller is the one to store it."""

    request: ResponsesRequest
    stored: StoredResponse
    run: Run | None
    feed: ResponseFeed


class ResponseService:
    """Stored responses and their runs, over one process's ``Runner``."""

    def __init__(self, runner: Runner, *, ttl_s: int, max_bytes: int = 0) -> None:
        self.runner = runner
        self.store = ResponseStore(
            runner.redis,
            runner.store.keys,
            ttl_s=ttl_s,
            requests=runner.store,
            outputs=runner.outputs,
            max_bytes=max_bytes,
        )

    # -- create ------------------------------------------------------------------------
    def start(
        self,
        body: Any,
        caller: Caller,
        *,
        route: str = ROUTE,
        stream: bool | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> StartedResponse:
        """Settle, admit and submit one Responses body; store it when asked. ``stream``
        overrides the body's (the WebSocket always streams); ``trace``: the client's
        trace context headers."""
        if stream is not None and isinstance(body, dict):
            body = {**body, "stream": stream}
        # Parsed here only to find the conversation it continues; ``Runner.start``
        # prepares the body itself, on the one path every API takes.
        parsed = parse_responses_request(body)
        if parsed.store:  # a key over its stored bytes is refused before it generates
            self.store.check_room(caller.owner, len(dumps(body)))
        context = self._previous_items(parsed, caller)
        run = self.runner.start(
            Endpoint.RESPONSES, body, route=route, owner=caller.owner, context=context,
            trace=trace,
        )  # fmt: skip
        try:
            req = run.prepared.responses
            assert req is not None
            base = ResponseSkeleton(
                response_id_of(run.request_id),
                int(run.record.created),
                run.prepared.shape.model,
                req,
            ).base()
            status = "queued" if req.background else "in_progress"
            stored = StoredResponse(
                response_id=base["id"],
                request_id=run.request_id,
                owner=caller.owner,
                status=status,
                response={**base, "status": status},
                base=base,
                input_items=with_ids(req.input_items, lambda: uuid.uuid4().hex),
                background=req.background,
            )
            if req.store:
                self.store.create(stored)
            store = self.store if req.store else None
            if not req.background:
                return StartedResponse(req, stored, run, ResponseFeed(stored, store))
            self._follow_in_background(run, stored)
        except BaseException as exc:
            run.close(error=exc)
            raise
        # The background thread owns ``run`` and stores the object; a stream only watches.
        view = BackgroundView(self.runner, run.prepared) if req.stream else None
        return StartedResponse(req, stored, view, ResponseFeed(stored, None))

    def _previous_items(self, req: ResponsesRequest, caller: Caller) -> list[Any]:
        """The conversation ``previous_response_id`` continues: every input and output of
        it, oldest first ([] when it continues none)."""
        if req.previous_response_id is None:
            return []
        prev = self.store.load(req.previous_response_id, caller.scope)
        if prev is None:
            raise NotFound(
                f"Previous response with id '{req.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        prev = self.store.settle(prev)
        if not prev.terminal:
            raise InvalidRequest(
                f"Previous response '{prev.response_id}' is still {prev.status}; wait for "
                "it to finish before continuing from it.",
                param="previous_response_id",
            )
        items = self.store.conversation(prev)
        if items is None:
            raise InvalidRequest(
                f"An earlier response of the conversation of '{prev.response_id}' has "
                "expired or was deleted, so it cannot be continued.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return items

    def _follow_in_background(self, run: Run, stored: StoredResponse) -> None:
        """Follow ``run`` to its end in a daemon thread, storing the final object."""

        def follow() -> None:
            feed = ResponseFeed(stored, self.store)
            feed.opening()

            def one(item: Item) -> bool:
                feed.feed(item[1])
                return True  # nobody to send to: never gone

            try:
                drive.follow(run, one, lambda: feed.done)
                run.close()
            except Exception as exc:  # one bad response never ends the process
                logger.exception("background response %s failed", stored.response_id)
                run.close(error=exc)

        threading.Thread(target=follow, name=f"resp-{stored.request_id}", daemon=True).start()

    def relay(
        self,
        started: StartedResponse,
        send: Callable[[Event], bool],
        stopped: Callable[[], bool],
        tick_s: float,
    ) -> None:
        """Send a started response's events (``send`` returns False once its client is
        gone) until the end; the caller closes the run."""
        run, feed = started.run, started.feed
        assert run is not None
        if not all(send(ev) for ev in feed.opening()):
            return

        def one(item: Item) -> bool:
            return all(send(e) for e in feed.feed(item[1]))

        drive.follow(run, one, lambda: feed.done, stopped=stopped, tick_s=tick_s)

    # -- stored responses --------------------------------------------------------------
    def load(self, response_id: str, caller: Caller) -> StoredResponse:
        """A stored response the caller may see, as last written; else 404."""
        stored = self.store.load(response_id, caller.scope)
        if stored is None:
            raise NotFound(
                f"No response with id '{response_id}' exists (or it has expired).",
                param="response_id",
                code="response_not_found",
            )
        return stored

    def get(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """The response object, settled from its output stream when not yet final."""
        return self.store.settle(self.load(response_id, caller)).response

    def view(self, stored: StoredResponse) -> Run:
        """A run over a stored response's output from its start: a ``BackgroundView``
        for a background response, else an ordinary resumed run."""
        if not stored.background:
            return self.runner.resume(stored.request_id, None, route=ROUTE, scope=None)
        loaded = self.runner.store.load(stored.request_id)
        if loaded is None:
            raise NotFound(
                f"The events of response '{stored.response_id}' have expired.",
                param="response_id",
                code="stream_not_found",
            )
        return BackgroundView(self.runner, self.runner.intake.restore(loaded[0]))

    def replay(self, stored: StoredResponse) -> ResponseFeed:
        """The events of a replay, storing the object if this reader sees the end first
        (the creator's process may be gone)."""
        return ResponseFeed(stored, self.store)

    def delete(self, response_id: str, caller: Caller) -> None:
        """Delete a stored response; one still generating is cancelled."""
        stored = self.load(response_id, caller)
        if not stored.terminal:
            self.runner.cancel(stored.request_id)
        self.store.delete(stored)

    def cancel(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """Cancel a background response: its generation stops and it ends ``cancelled``
        (with what it had written); a finished one is returned as it is."""
        stored = self.store.settle(self.load(response_id, caller))
        if not stored.background:
            raise InvalidRequest(
                "Only responses created with 'background': true can be cancelled.",
                param="response_id",
            )
        if stored.terminal:
            return stored.response
        self.runner.cancel(stored.request_id)
        deadline = self.runner.clock() + CANCEL_SETTLE_S
        while not stored.terminal and self.runner.clock() < deadline:
            time.sleep(0.05)
            stored = self.store.settle(stored)
        if not stored.terminal:
            self.store.finish(stored, {**stored.response, "status": "cancelled"})
            stored = self.store.settle(self.load(response_id, caller))
        return stored.response

    def input_items(
        self, response_id: str, caller: Caller, *, order: str, limit: int, after: str | None
    ) -> dict[str, Any]:
        """A page of this response's own input items (ids assigned at creation)."""
        stored = self.load(response_id, caller)
        if order not in ("asc", "desc"):
            raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order")
        if not 1 <= limit <= 100:
            raise InvalidRequest("'limit' must be an integer from 1 to 100.", param="limit")
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        if after:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise InvalidRequest(f"No input item with id '{after}'.", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
