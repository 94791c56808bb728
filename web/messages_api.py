"""Anthropic's Messages API over HTTP: ``POST /v1/messages`` (JSON or SSE) and
``POST /v1/messages/count_tokens`` (issue 42).

The route only frames: ``Runner.start`` runs the request on the one request path (a
chat request translated by ``app.messages_api``); this module writes Anthropic's events
(``event:`` + ``id:`` + ``data:``, ``ping`` while waiting) or the folded message. Keys
come as ``x-api-key`` (Anthropic's) or ``Authorization: Bearer`` (the app-wide hook
checks either); ``anthropic-version`` is accepted whatever it says. Errors are in
Anthropic's shape (``web.errors`` answers every ``/v1/messages`` path so).

Every event's id is the output cursor of the event that made it and its place among
the events made of it (``<cursor>/<k>``: one output event may end a block, say why the
message stopped and stop it): a client that lost its connection sends the last id back
to ``GET /v1/streams/<request_id>`` (the ``request-id`` response header names it) and
gets exactly the events after it, framed from the message's start again so its content
block indexes are the same. An id without ``/<k>`` (sent before 2026-12-06) names every
event of its cursor.
"""

from __future__ import annotations

import json
from typing import Any

from flask import Blueprint, Response, current_app, g, request

from app.intake import Endpoint
from app.messages_api import ROUTE, MessageFeed, anthropic_error
from broker import drive
from broker.run import Run
from web import sse
from web.auth import tenant_of
from web.bodies import client_trace, json_body
from web.clients import client_gone_probe
from web.context import runner_of, settings_of
from web.tokenize import intake_for

blueprint = Blueprint("messages", __name__)

PING = 'event: ping\ndata: {"type": "ping"}\n\n'
OPENING_CURSOR = "0/0"  # message_start: before every output event


def authorization() -> str | None:
    """The request's key as a Bearer header: Anthropic's ``x-api-key`` or the header."""
    header = request.headers.get("Authorization")
    key = request.headers.get("x-api-key")
    return header if header or not key else f"Bearer {key}"


def _json(value: Any) -> Response:
    return Response(json.dumps(value, ensure_ascii=False), mimetype="application/json")


@blueprint.post(ROUTE)
def create_message() -> Response:
    runner = runner_of(current_app)
    tenant = tenant_of(settings_of(current_app), authorization())
    run = runner.start(
        Endpoint.MESSAGES, json_body(request), owner=tenant.owner, trace=client_trace(request)
    )
    if not g.client_request_id:
        g.request_id = run.request_id
    try:
        if run.prepared.stream:
            return stream(run)
        return _unary(run)
    except BaseException as exc:
        run.close(error=exc)
        raise


@blueprint.post(f"{ROUTE}/count_tokens")
def count_tokens() -> Response:
    """``{"input_tokens": N}``: the prompt the same body would be (template, tools as
    its ``tool_choice`` leaves them, thinking and effort), built by the request's own
    intake."""
    intake, body = intake_for(json_body(request))
    return _json({"input_tokens": intake.message_tokens(body)})


def feed_for(run: Run) -> MessageFeed:
    record = run.prepared.record
    return MessageFeed(
        message_id=f"msg_{run.request_id}",
        model=run.shape.model,
        input_tokens=sum(len(p) for p in record.prompts),
    )


def _unary(run: Run) -> Response:
    """The whole message, with the ``request-id`` header a stream has (the anthropic
    SDK's ``_request_id``); a request that failed before any output is the error's HTTP
    status."""
    feed = feed_for(run)
    if not drive.unary(run, feed.feed, lambda: feed.done, client_gone_probe(request.environ)):
        return Response(status=499)
    run.close()
    if feed.error is not None and not feed.blocks:
        raise feed.error
    response = _json(feed.message())
    response.headers["request-id"] = run.request_id
    return response


EVERY_EVENT = 1 << 30  # an id without its event's place: every event of its cursor


def _event_key(event_id: str) -> tuple[int, int, int]:
    """An event id (``<chunk>/<index>/<k>``, or one sent before ids had ``k``) as the
    key that orders events."""
    chunk, index, *k = (int(part) for part in event_id.split("/"))
    return chunk, index, k[0] if k else EVERY_EVENT


def _error_event(exc: BaseException) -> str:
    _status, error = anthropic_error(exc)
    return f"event: error\ndata: {json.dumps(error)}\n\n"


def stream(run: Run, *, last_seen: str | None = None) -> Response:
    """Anthropic's event stream of ``run`` (read from its start), less the events up to
    ``last_seen`` (a resumed stream)."""
    keepalive_s = max(settings_of(current_app).sse_keepalive_s, 0.001)
    seen = _event_key(last_seen) if last_seen is not None else None
    first = drive.opening(run, keepalive_s) if seen is None else []
    feed = feed_for(run)

    def frames(events: list[dict[str, Any]], cursor: str) -> str:
        chunk, _, index = cursor.partition("/")
        out = []
        for k, ev in enumerate(events):
            if seen is None or (int(chunk), int(index), k) > seen:
                data = json.dumps(ev, ensure_ascii=False)
                out.append(f"event: {ev['type']}\nid: {cursor}/{k}\ndata: {data}\n\n")
        return "".join(out)

    response = sse.event_stream(
        run,
        first,
        keepalive_s,
        opening=lambda: frames(feed.opening(), OPENING_CURSOR),
        frames=lambda read: "".join(frames(feed.feed(ev), cursor) for cursor, ev in read),
        done=lambda: feed.done,
        ping=PING,
        error=_error_event,
    )
    response.headers["request-id"] = run.request_id
    return response
