"""OpenAI's Responses API over HTTP: ``/v1/responses`` and its stored objects.

The route only translates and frames: ``app.responses_api`` turns the body into a chat
request, which takes the one request path (``Runner.start``: intake, readiness,
admission, submit); ``app.responses_events`` turns the run's output events into the
Responses API's typed events (SSE, ``event:`` + ``data:``, with ``sequence_number``)
or, folded, into the response object. Stored responses live in Redis
(``broker.responses``), owned by the API key that made them: another key gets 404.

Background responses (``background: true``) answer ``queued`` at once. The web process
that created one follows its run to the end in a daemon thread (counted as a
follower, so the generation is never cancelled for want of a client) and writes the
final object; if that process dies, the generation goes on regardless (nobody
decrements its follower count) and the first ``GET`` on any web process folds the
output stream into the stored object (``ResponseStore.settle``). ``GET
/v1/responses/{id}?stream=true&starting_after=N`` replays the request's output stream
from its start through the same framer, which numbers events deterministically, and
sends the events after N: exact from any web process, after any disconnect.

``start_response`` and ``relay`` are shared with the WebSocket's ``response`` message
(``web.ws``), so both transports store, chain and background responses alike.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
from flask import Blueprint, Response, current_app, g, request

from app.errors import InvalidRequest, NotFound, TokenRelayError
from app.intake import Endpoint
from app.responses_api import (
    ResponseSkeleton,
    ResponsesRequest,
    dumps,
    parse_responses_request,
    response_id_of,
    responses_param,
    to_chat_body,
    with_ids,
)
from app.responses_events import Event, ResponseEvents
from app.settings import Settings
from broker import drive
from broker.responses import ResponseStore, StoredResponse
from broker.run import Item, Run
from broker.runner import Runner
from web import sse
from web.auth import Tenant, tenant_of
from web.bodies import json_body
from web.clients import client_gone_probe
from web.context import runner_of, settings_of

logger = logging.getLogger(__name__)

blueprint = Blueprint("responses", __name__)

ROUTE = "/v1/responses"
# How long a cancel waits for the stream's own end (partial output and usage) before
# it marks the response cancelled itself.
CANCEL_SETTLE_S = 2.0


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


def _view(stored: StoredResponse) -> Run:
    """A run over a stored response's output from its start: a ``BackgroundView`` for a
    background response, else an ordinary resumed run (``Runner.resume``)."""
    runner = runner_of(current_app)
    if not stored.background:
        return runner.resume(stored.request_id, None, route=ROUTE, scope=None)
    loaded = runner.store.load(stored.request_id)
    if loaded is None:
        raise NotFound(
            f"The events of response '{stored.response_id}' have expired.",
            param="response_id",
            code="stream_not_found",
        )
    return BackgroundView(runner, runner.intake.restore(loaded[0]))


def response_store(runner: Runner, settings: Settings) -> ResponseStore:
    return ResponseStore(
        runner.redis,
        runner.store.keys,
        ttl_s=settings.responses_ttl_s,
        requests=runner.store,
        outputs=runner.outputs,
    )


def _store() -> ResponseStore:
    return response_store(runner_of(current_app), settings_of(current_app))


def _tenant() -> Tenant:
    return tenant_of(settings_of(current_app), request.headers.get("Authorization"))


def _json(value: Any, status: int = 200) -> Response:
    return Response(dumps(value), status=status, mimetype="application/json")


def _not_found(response_id: str) -> NotFound:
    return NotFound(
        f"No response with id '{response_id}' exists (or it has expired).",
        param="response_id",
        code="response_not_found",
    )


def _load(store: ResponseStore, response_id: str, tenant: Tenant) -> StoredResponse:
    stored = store.load(response_id, tenant.scope)
    if stored is None:
        raise _not_found(response_id)
    return stored


# -- create ----------------------------------------------------------------------------------


def _previous_items(store: ResponseStore, req: ResponsesRequest, tenant: Tenant) -> list[Any]:
    """The conversation ``previous_response_id`` continues: every input and output of
    it, oldest first."""
    if req.previous_response_id is None:
        return []
    prev = store.load(req.previous_response_id, tenant.scope)
    if prev is None:
        raise NotFound(
            f"Previous response with id '{req.previous_response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    prev = store.settle(prev)
    if not prev.terminal:
        raise InvalidRequest(
            f"Previous response '{prev.response_id}' is still {prev.status}; wait for it "
            "to finish before continuing from it.",
            param="previous_response_id",
        )
    items = store.conversation(prev)
    if items is None:
        raise InvalidRequest(
            f"An earlier response of the conversation of '{prev.response_id}' has expired "
            "or was deleted, so it cannot be continued.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return items


@dataclass(frozen=True, slots=True)
class StartedResponse:
    """A response whose generation was admitted and submitted.

    ``run`` is what the caller frames (None for a background response nobody watches:
    the background thread owns the generation); ``store`` is where the caller writes
    the final object when it reads the end (None: not stored, or the background
    thread writes it)."""

    request: ResponsesRequest
    stored: StoredResponse
    run: Run | None
    store: ResponseStore | None


def start_response(
    runner: Runner,
    settings: Settings,
    body: Any,
    tenant: Tenant,
    *,
    route: str = ROUTE,
    stream: bool | None = None,
) -> StartedResponse:
    """Translate, admit and submit one Responses body; store it when asked. Shared by
    the HTTP route and the WebSocket's ``response`` message (``stream`` True there)."""
    if stream is not None and isinstance(body, dict):
        body = {**body, "stream": stream}
    req = parse_responses_request(body)
    store = response_store(runner, settings)
    context = _previous_items(store, req, tenant) + with_ids(
        req.input_items, lambda: uuid.uuid4().hex
    )
    chat = to_chat_body(req, context)
    try:
        run = runner.start(Endpoint.CHAT, chat, route=route, owner=tenant.owner)
    except TokenRelayError as exc:
        exc.param = responses_param(exc.param)
        raise
    try:
        rid = run.request_id
        base = ResponseSkeleton(
            response_id_of(rid), int(run.record.created), runner.model_name, req
        ).base()
        status = "queued" if req.background else "in_progress"
        stored = StoredResponse(
            response_id=base["id"],
            request_id=rid,
            owner=tenant.owner,
            status=status,
            response={**base, "status": status},
            base=base,
            input_items=context[len(context) - len(req.input_items) :],
            background=req.background,
        )
        if req.store:
            store.create(stored)
        if not req.background:
            return StartedResponse(req, stored, run, store if req.store else None)
        _follow_in_background(run, stored, store)
    except BaseException as exc:
        run.close(error=exc)
        raise
    # The background thread owns ``run``; a stream only watches.
    view = BackgroundView(runner, run.prepared) if req.stream else None
    return StartedResponse(req, stored, view, None)


@blueprint.post(ROUTE)
def create_response() -> Response:
    started = start_response(
        runner_of(current_app), settings_of(current_app), json_body(request), _tenant()
    )
    if not g.client_request_id:
        g.request_id = started.stored.request_id
    run = started.run
    if run is None:
        return _json(started.stored.response)
    try:
        if started.request.stream:
            return _stream(run, started.stored, started.store, -1, opening=True)
        return _unary(run, started.stored, started.store)
    except BaseException as exc:
        run.close(error=exc)
        raise


def relay(
    started: StartedResponse,
    send: Callable[[Event], bool],
    stopped: Callable[[], bool],
    tick_s: float,
) -> None:
    """Send a started response's events (``send`` returns False once its client is
    gone) until the end, storing the final object; the caller closes the run."""
    run, stored = started.run, started.stored
    assert run is not None
    events = ResponseEvents(stored.base, stored.request_id, queued=stored.background)
    if not all(send(ev) for ev in events.opening()):
        return
    drive.follow(
        run,
        lambda item: all(send(e) for e in events.feed(item[1])),
        lambda: events.done,
        stopped=stopped,
        tick_s=tick_s,
    )
    if events.done and started.store is not None:
        started.store.finish(stored.response_id, events.response)


def _follow_in_background(run: Run, stored: StoredResponse, store: ResponseStore) -> None:
    """Follow ``run`` to its end in a daemon thread and store the final object."""

    def follow() -> None:
        events = ResponseEvents(stored.base, stored.request_id, queued=True)
        events.opening()

        def feed(item: Item) -> bool:
            events.feed(item[1])
            return True

        try:
            if drive.follow(run, feed, lambda: events.done):
                store.finish(stored.response_id, events.response)
            run.close()
        except Exception as exc:  # one bad response never ends the process
            logger.exception("background response %s failed", stored.response_id)
            run.close(error=exc)

    threading.Thread(target=follow, name=f"resp-{stored.request_id}", daemon=True).start()


def _unary(run: Run, stored: StoredResponse, store: ResponseStore | None) -> Response:
    """The whole response in one body; a request that failed before any output is the
    error's HTTP status, as for chat completions."""
    events = ResponseEvents(stored.base, stored.request_id)
    events.opening()
    client_gone = client_gone_probe(request.environ)
    if not drive.unary(run, events.feed, lambda: events.done, client_gone):
        return Response(status=499)
    run.close()
    response = events.response
    if store is not None:
        store.finish(stored.response_id, response)
    if run.failure is not None and not any(o for o in response["output"]):
        raise run.failure
    return _json(response)


# -- streaming ---------------------------------------------------------------------------------


def _frame(ev: Event) -> str:
    return f"event: {ev['type']}\nid: {ev['sequence_number']}\ndata: {dumps(ev)}\n\n"


def _stream(
    run: Run,
    stored: StoredResponse,
    store: ResponseStore | None,
    starting_after: int,
    *,
    opening: bool = False,
) -> Response:
    """The response's events after ``starting_after`` as SSE; ``run`` reads the output
    stream from its start (the framer numbers events the same way on every replay).

    ``opening``: a response just created, which, when it fails before its first
    output, is answered with the error's HTTP status, as chat completions are
    (``drive.opening``); a replay (GET) streams whatever the response came to."""
    keepalive_s = max(settings_of(current_app).sse_keepalive_s, 0.001)
    events = ResponseEvents(stored.base, stored.request_id, queued=stored.background)
    first = drive.opening(run, keepalive_s) if opening and not stored.background else []

    def frames(batch: list[Event]) -> str:
        return "".join(_frame(ev) for ev in batch if ev["sequence_number"] > starting_after)

    def body() -> Iterator[str]:
        try:
            head = frames(events.opening())
            if head:
                yield head
            for read in drive.reads(run, keepalive_s, first):
                if read is None:
                    yield sse.KEEPALIVE
                    continue
                text = frames([e for _, ev in read for e in events.feed(ev)])
                if text:
                    yield text
                if events.done:
                    break
            if events.done and store is not None:
                store.finish(stored.response_id, events.response)
        except GeneratorExit:
            raise
        except Exception as exc:
            logger.exception("stream of response %s failed", stored.response_id)
            run.close(error=exc)
            yield sse.error_frame(exc)

    response = Response(body(), mimetype=sse.MIMETYPE, headers=sse.HEADERS)
    response.call_on_close(lambda: run.close(disconnected=not run.ended, resumable=True))
    return response


# -- stored objects ----------------------------------------------------------------------------


@blueprint.get(f"{ROUTE}/<response_id>")
def get_response(response_id: str) -> Response:
    """The stored response (settled from its output stream when not yet final), or with
    ``stream=true`` its events after ``starting_after``."""
    tenant = _tenant()
    store = _store()
    stored = _load(store, response_id, tenant)
    if request.args.get("stream", "").lower() in ("true", "1"):
        raw = request.args.get("starting_after", "-1")
        try:
            after = int(raw)
        except ValueError:
            raise InvalidRequest(
                "'starting_after' must be an integer sequence number.", param="starting_after"
            ) from None
        return _stream(_view(stored), stored, store, after)
    return _json(store.settle(stored).response)


@blueprint.delete(f"{ROUTE}/<response_id>")
def delete_response(response_id: str) -> Response:
    """Delete a stored response; one still generating is cancelled."""
    store = _store()
    stored = _load(store, response_id, _tenant())
    if not stored.terminal:
        runner_of(current_app).cancel(stored.request_id)
    store.delete(response_id)
    return _json({"id": response_id, "object": "response.deleted", "deleted": True})


@blueprint.post(f"{ROUTE}/<response_id>/cancel")
def cancel_response(response_id: str) -> Response:
    """Cancel a background response: its generation stops and it ends ``cancelled``
    (with what it had written); a finished one is returned as it is."""
    store = _store()
    stored = store.settle(_load(store, response_id, _tenant()))
    if not stored.background:
        raise InvalidRequest(
            "Only responses created with 'background': true can be cancelled.",
            param="response_id",
        )
    if stored.terminal:
        return _json(stored.response)
    runner = runner_of(current_app)
    runner.cancel(stored.request_id)
    deadline = runner.clock() + CANCEL_SETTLE_S
    while not stored.terminal and runner.clock() < deadline:
        time.sleep(0.05)
        stored = store.settle(stored)
    if not stored.terminal:
        store.finish(response_id, {**stored.response, "status": "cancelled"})
        stored = store.settle(_load(store, response_id, _tenant()))
    return _json(stored.response)


@blueprint.get(f"{ROUTE}/<response_id>/input_items")
def list_input_items(response_id: str) -> Response:
    """This response's own input items (ids assigned at creation), paginated."""
    stored = _load(_store(), response_id, _tenant())
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order")
    try:
        limit = int(request.args.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequest("'limit' must be an integer from 1 to 100.", param="limit")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    after = request.args.get("after")
    if after:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise InvalidRequest(f"No input item with id '{after}'.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return _json(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )
