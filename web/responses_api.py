"""OpenAI's Responses API over HTTP: ``/v1/responses`` and its stored objects.

The routes only parse, call and frame (vLLM's ``responses/api_router.py`` against
``responses/serving.py`` is the shape): ``broker.response_service.ResponseService``
settles ``previous_response_id``, submits on the one request path, stores responses
(owned by the API key that made them: another key gets 404), follows background ones
and cancels; ``broker.drive`` reads the run; this module frames the events of
``app.responses_events`` as SSE (``event:`` + ``data:``, with ``sequence_number``) or
returns the folded object as JSON.

``GET /v1/responses/{id}?stream=true&starting_after=N`` replays the request's output
stream from its start through the same framer, which numbers events deterministically,
and sends the events after N: exact from any web process, after any disconnect.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, current_app, g, request

from app.errors import InvalidRequest
from app.responses_api import dumps
from app.responses_events import Event
from broker import drive
from broker.response_service import ROUTE, ResponseFeed
from broker.run import Run
from web import sse
from web.auth import Tenant, tenant_of
from web.bodies import client_trace, json_body
from web.clients import client_gone_probe
from web.context import connections_of, responses_of, settings_of

blueprint = Blueprint("responses", __name__)


def _tenant() -> Tenant:
    return tenant_of(settings_of(current_app), request.headers.get("Authorization"))


def _json(value: Any, status: int = 200) -> Response:
    return Response(dumps(value), status=status, mimetype="application/json")


@blueprint.post(ROUTE)
def create_response() -> Response:
    started = responses_of(current_app).start(
        json_body(request), _tenant(), trace=client_trace(request)
    )
    if not g.client_request_id:
        g.request_id = started.stored.request_id
    run = started.run
    if run is None:
        return _json(started.stored.response)
    try:
        if started.request.stream:
            return _stream(run, started.feed, -1, opening=not started.stored.background)
        return _unary(run, started.feed)
    except BaseException as exc:
        run.close(error=exc)
        raise


def _unary(run: Run, feed: ResponseFeed) -> Response:
    """The whole response in one body; a request that failed before any output is the
    error's HTTP status, as for chat completions."""
    feed.opening()
    client_gone = client_gone_probe(request.environ)
    if not drive.unary(run, feed.feed, lambda: feed.done, client_gone):
        return Response(status=499)
    run.close()
    response = feed.response
    if run.failure is not None and not any(o for o in response["output"]):
        raise run.failure
    return _json(response)


def _frame(ev: Event) -> str:
    return f"event: {ev['type']}\nid: {ev['sequence_number']}\ndata: {dumps(ev)}\n\n"


def _stream(
    run: Run, feed: ResponseFeed, starting_after: int, *, opening: bool = False
) -> Response:
    """The response's events after ``starting_after`` as SSE; ``run`` reads the output
    stream from its start (the framer numbers events the same way on every replay).

    ``opening``: a response just created, which, when it fails before its first
    output, is answered with the error's HTTP status, as chat completions are
    (``drive.opening``); a replay (GET) streams whatever the response came to."""
    keepalive_s = max(settings_of(current_app).sse_keepalive_s, 0.001)
    first = drive.opening(run, keepalive_s) if opening else []

    def frames(batch: list[Event]) -> str:
        return "".join(_frame(ev) for ev in batch if ev["sequence_number"] > starting_after)

    return sse.event_stream(
        run,
        first,
        keepalive_s,
        opening=lambda: frames(feed.opening()),
        frames=lambda read: frames([e for _, ev in read for e in feed.feed(ev)]),
        done=lambda: feed.done,
    )


# -- stored objects ----------------------------------------------------------------------------


@blueprint.get(f"{ROUTE}/<response_id>")
def get_response(response_id: str) -> Response:
    """The stored response (settled from its output stream when not yet final), or with
    ``stream=true`` its events after ``starting_after``."""
    service = responses_of(current_app)
    if request.args.get("stream", "").lower() not in ("true", "1"):
        return _json(service.get(response_id, _tenant()))
    stored = service.load(response_id, _tenant())
    raw = request.args.get("starting_after", "-1")
    try:
        after = int(raw)
    except ValueError:
        raise InvalidRequest(
            "'starting_after' must be an integer sequence number.", param="starting_after"
        ) from None
    close = connections_of(current_app).open(_tenant().owner)  # a follower holds a thread
    try:
        response = _stream(service.view(stored), service.replay(stored), after)
    except BaseException:
        close()
        raise
    response.call_on_close(close)
    return response


@blueprint.delete(f"{ROUTE}/<response_id>")
def delete_response(response_id: str) -> Response:
    """Delete a stored response; one still generating is cancelled."""
    responses_of(current_app).delete(response_id, _tenant())
    return _json({"id": response_id, "object": "response.deleted", "deleted": True})


@blueprint.post(f"{ROUTE}/<response_id>/cancel")
def cancel_response(response_id: str) -> Response:
    """Cancel a background response: its generation stops and it ends ``cancelled``
    (with what it had written); a finished one is returned as it is."""
    return _json(responses_of(current_app).cancel(response_id, _tenant()))


@blueprint.get(f"{ROUTE}/<response_id>/input_items")
def list_input_items(response_id: str) -> Response:
    """This response's own input items (ids assigned at creation), paginated."""
    try:
        limit = int(request.args.get("limit", "20"))
    except ValueError:
        limit = 0
    page = responses_of(current_app).input_items(
        response_id,
        _tenant(),
        order=request.args.get("order", "desc"),
        limit=limit,
        after=request.args.get("after") or None,
    )
    return _json(page)
